# The README's two commands: `make demo` (the main job on CPU) and `make test`. Both install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatron_2d-installed

.PHONY: install demo test bench clean
install: $(STAMP)

$(STAMP): tools/install.sh requirements.txt requirements-dev.txt pyproject.toml
	bash tools/install.sh
	touch $@

demo: $(STAMP)
	$(PY) -m megatron_2d.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) tools/bench_attention.py --ranks 4
	$(PY) -m megatron_2d.demo

clean:
	rm -rf $(VENV) .pytest_cache
