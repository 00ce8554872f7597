"""megatron_2d's development distribution, never shipped: the CPU stand-ins (fake flash-attn, Transformer Engine
and Mamba kernel modules, Megatron's CPU shims), the Megatron harnesses and generated configurations, the emulated
cluster, the demo (``python -m megatron_2d_dev.demo``), gpu-check and the benchmarks (``bench/``). The library's
own test support that users may import (the reference, its tolerances, the distributed helpers) stays in
:mod:`megatron_2d.testing`; this package may import it, never the other way round (tests/test_import_graph.py)."""

from __future__ import annotations

import os
from pathlib import Path

DEV_ROOT = Path(__file__).resolve().parent.parent  # dev/, the folder of this distribution
REPO_ROOT = DEV_ROOT.parent  # the checkout: megatron_2d/, examples/, patches/


def python_path(*first: str) -> str:
    """A PYTHONPATH for processes this checkout starts (torchrun workers, gpu-check's workers): ``first``, then the
    checkout (megatron_2d) and its dev/ folder (megatron_2d_dev), then the caller's PYTHONPATH."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join(filter(None, [*first, str(REPO_ROOT), str(DEV_ROOT), inherited]))
