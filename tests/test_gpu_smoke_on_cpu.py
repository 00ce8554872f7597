"""tools/gpu_smoke.py (make gpu-check) is what a session lent a GPU runs: its CPU dry run keeps every item working.

The dry run plays the CUDA kernels through their stand-ins (torch_flash: CPU kernels for PyTorch's CUDA flash ops;
flash_attn2: the real flash-attn 2.8.3.post2 package over its CPU extension) and runs the distributed item on two
CPU ranks under torchrun (gloo). Items that need CUDA (peak memory, graph capture) must say so, never pass.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
ITEMS = [
    "kernel flash_attn2",
    "kernel torch_flash",
    "loopback flash_attn2",
    "loopback torch_flash",
    "attention_2d flash_attn2",
    "attention_2d torch_flash",
    "no host sync",
    "distributed 2 ranks",
]


def test_gpu_check_dry_run_on_cpu():
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_smoke.py"), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = run.stdout.splitlines()
    failed = [line for line in lines if " FAIL " in line]
    assert run.returncode == 0 and not failed, "\n".join(failed) + run.stderr[-3000:]
    assert lines[-1] == "all passed"
    rows = [line for line in lines if line.split("  ")[0].strip()]
    for item in ITEMS:
        assert any(line.startswith(item) and " ok " in line for line in rows), item
    for d in (64, 128, 192):  # every kernel at every head dim
        assert sum(f"d={d}:" in line and " ok " in line for line in rows) == 2, d
    assert sum(line.startswith("loopback") and " ok " in line for line in rows) == 2 * 6
    for item in ("peak memory", "CUDA graph capture"):
        assert any(line.startswith(item) and "not run" in line and "needs CUDA" in line for line in rows), item
