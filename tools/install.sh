#!/usr/bin/env bash
# One-step CPU setup of a fresh checkout: a virtual environment in .venv with everything the demo and tests need.
#   - torch is pinned to 2.13.0 (a CPU wheel; an unpinned torch pulls a multi-GB CUDA build);
#   - megatron-core 0.19.2 declares Python >= 3.12 but its cp311 wheel works on 3.11: install it without its
#     marker and without deps; the next step keeps it (it satisfies pyproject's megatron-core line) and installs
#     its dependencies (torch, numpy, packaging) with ours;
#   - everything else from the one list, pyproject.toml: this package (editable) with its dependencies and its
#     `dev` extra (tests, demo, benchmarks, ruff);
#   - the development distribution, dev/ (megatron_2d_dev: stand-ins, harnesses, demo, gpu-check, benchmarks),
#     editable; never shipped, its dependencies are the `dev` extra above;
#   - the real flash-attn releases the CPU tests run (their Python layer only, nothing compiled), each in its own
#     folder under $VENV/flash-attn-releases, skipped when present (dev/megatron_2d_dev/flash_attn_package.py);
#     pip caches the downloads, so a second setup does not fetch them again;
#   - likewise the real Transformer Engine releases (the pure-Python transformer-engine wheel of each, nothing
#     compiled) and what their PyTorch layer imports (onnxscript, onnx), under $VENV/te-releases
#     (dev/megatron_2d_dev/te_package.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"Python >= 3.10 is needed, found {sys.version.split()[0]}")
PY
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check)  # -qq: errors only
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
"${PIP[@]}" -e ".[dev]"
"${PIP[@]}" -e ./dev
"${PIP[@]}" "setuptools>=70.1" wheel                 # flash-attn's setup.py imports wheel.bdist_wheel
"$VENV/bin/python" -m megatron_2d_dev.flash_attn_package install
"$VENV/bin/python" -m megatron_2d_dev.te_package install
"$VENV/bin/python" -c "import torch, megatron.core, megatron_2d, megatron_2d_dev; print('installed: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| megatron_2d', megatron_2d.__version__)" 2>/dev/null
