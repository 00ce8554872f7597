# The README's two commands: `make demo` (the main job on CPU) and `make test`. Both install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatron_2d-installed

.PHONY: install demo test test-fast lint bench pretrain-cpu pretrain-stock-cpu pretrain-hybrid-cpu mutation fuzz fuzz-megatron gpu-check clean
install: $(STAMP)

$(STAMP): tools/install.sh pyproject.toml dev/pyproject.toml dev/megatron_2d_dev/flash_attn_package.py \
		dev/megatron_2d_dev/te_package.py
	bash tools/install.sh
	touch $@

demo: $(STAMP)
	$(PY) -m megatron_2d_dev.demo

test: $(STAMP)
	$(PY) -m pytest -q

# The single-process tests only (markers in pyproject.toml): about half a minute on 2 cores, against ~15 minutes
# for `make test`. A test that forks ranks without the `distributed` marker fails here (tests/conftest.py).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not distributed and not megatron and not slow"

# Megatron-LM's pretrain_gpt.py (patched) with 2D CP on 4 CPU ranks under torchrun (needs ../shared/megatron-lm).
pretrain-cpu: $(STAMP)
	PY=$(PY) bash tools/pretrain_gpt_cpu.sh

# Stock Megatron CP beside it: the unpatched pretrain_gpt.py with --cp-comm-type a2a+p2p (hierarchical 2 x 2), bf16,
# megatron-core's TEDotProductAttention over Transformer Engine 2.20.2's own context_parallel.py on 4 CPU ranks
# (STOCK_CP=p2p|a2a|all_gather and TE_RELEASE=2.5.0|2.8.0|2.12.0 to vary; tests/test_megatron_stock_cp.py).
pretrain-stock-cpu: $(STAMP)
	STOCK_CP=a2a+p2p PY=$(PY) bash tools/pretrain_gpt_cpu.sh

# Megatron-LM's pretrain_hybrid.py (patched): Mamba + 2D attention layers ('M*-M*-'), CP=4 on 4 CPU ranks.
pretrain-hybrid-cpu: $(STAMP)
	ENTRY=hybrid PY=$(PY) bash tools/pretrain_gpt_cpu.sh

# ruff's checks and formatting (configuration in pyproject.toml); CI runs this before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) tools/bench_attention.py --ranks 4
	$(PY) -m megatron_2d_dev.demo

# On a machine with GPUs (e.g. an NGC container with this checkout): every GPU path, one table, pass/fail per item
# (tools/gpu_smoke.py; under 5 minutes on one H100). Uses the machine's own Python and torch, not .venv (whose
# torch is the CPU build), with this checkout and its dev/ folder (megatron_2d_dev: gpu-check's code) on the path.
# CI runs the same items on CPU: python tools/gpu_smoke.py --dry-run.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/dev$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/gpu_smoke.py --device cuda

# Not part of CI: applies tools/mutations.toml one mutation at a time to a scratch copy and reports caught/survived
# (exit 1 below 95% caught). Takes tens of minutes on 2 cores.
mutation: $(STAMP)
	$(PY) tools/mutation_check.py --threshold 95

# Generated exactness cases against the fp64 per-document oracle (CI runs a fixed budget of them in
# tests/test_generated_attention.py); every failure prints its replay command. FUZZ_DRAWS=N FUZZ_SEED=S to vary.
FUZZ_DRAWS ?= 2000
FUZZ_SEED ?= 1000
fuzz: $(STAMP)
	$(PY) tools/fuzz_attention.py --draws $(FUZZ_DRAWS) --seed $(FUZZ_SEED)

# Generated Megatron configurations (model x TP/PP x 2D layout x DP x model states x attention x data x recompute x
# dtype) trained against CP=1 (CI runs a fixed budget in tests/test_generated_configs.py); every failure prints its
# replay command, and the refused and skipped draws are counted by rule. FUZZ_MEGATRON_DRAWS=N FUZZ_MEGATRON_SEED=S.
FUZZ_MEGATRON_DRAWS ?= 300
FUZZ_MEGATRON_SEED ?= 1000
fuzz-megatron: $(STAMP)
	$(PY) tools/fuzz_megatron.py --draws $(FUZZ_MEGATRON_DRAWS) --seed $(FUZZ_MEGATRON_SEED)

clean:
	rm -rf $(VENV) .pytest_cache
