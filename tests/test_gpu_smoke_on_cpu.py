"""tools/gpu_smoke.py (make gpu-check) is what a session lent a GPU runs: its CPU dry run keeps every item working.

The dry run plays the CUDA kernels through their stand-ins (torch_flash, torch_cudnn: CPU kernels for PyTorch's CUDA
flash and cuDNN ops; flash_attn2: the real flash-attn 2.8.3.post2 package over its CPU extension; te_fused: the real
Transformer Engine 2.20.2 Python layer over its CPU extension), megatron-core through the CPU shims,
and runs the distributed item on two CPU ranks under torchrun (gloo), stock Megatron CP (TE's own context_parallel.py
in its CPU context) among them. Items that need CUDA (peak memory, graph
capture, timing) or Transformer Engine's compiled layers (the TE-spec Megatron rows) must say so, never pass, and
the summary counts them.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ("te_fused", "torch_cudnn", "flash_attn2", "torch_flash")
MEGATRON_KINDS = ("GPT", "MLA latent, qk_layernorm", "hybrid *-")


def table_rows(lines: list[str]) -> list[tuple[str, str, str, str]]:
    """(item, case, result, detail) of every table row (columns are two or more spaces apart)."""
    rows = []
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4 and cells[2] in ("ok", "FAIL", "not run"):
            rows.append(tuple(cells))
    return rows


def test_gpu_check_dry_run_on_cpu():
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_smoke.py"), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = run.stdout.splitlines()
    rows = table_rows(lines)
    failed = [row for row in rows if row[2] == "FAIL"]
    assert run.returncode == 0 and not failed, "\n".join(map(str, failed)) + run.stderr[-3000:]

    def ok(item: str, case: str = "") -> int:
        return sum(r[0] == item and case in r[1] and r[2] == "ok" for r in rows)

    for kernel in KERNELS:
        for d in (64, 128, 192):  # every kernel at every head dim
            assert ok(f"kernel {kernel}", f"d={d}:") == 1, (kernel, d)
        assert ok(f"tall bands {kernel}") == 1, kernel
        assert ok(f"MLA dims {kernel}") == 1 and ok(f"varlen {kernel}") == 1, kernel
        assert ok(f"loopback {kernel}") == 6, kernel
        assert ok(f"attention_2d {kernel}") == 2, kernel
        assert ok("no host sync", kernel) == 1, kernel
        for case in ("packed zigzag, ", "packed documents, window, ", "packed zigzag, two-sided window, "):
            assert ok("distributed 2 ranks", case + kernel) == 1, (case, kernel)
    assert ok("distributed 2 ranks") == 4 + 3 * len(KERNELS)
    # stock Megatron CP beside them: TE 2.20.2's own DotProductAttention in its CPU context, each comm type at CP 2
    for case in ("p2p cp2 sbhd", "a2a cp2 sbhd", "all_gather cp2 sbhd", "p2p cp2 thd"):
        assert ok("stock TE, 2 ranks", case) == 1, case
    for kind in MEGATRON_KINDS:
        assert ok(f"megatron {kind}", "local spec") == 1, kind
    assert ok("checkpoint++") == 1

    not_run = [r for r in rows if r[2] == "not run"]
    te_rows = [r for r in not_run if r[0].startswith("megatron") and r[1].startswith("TE spec")]
    assert sorted(r[0] for r in te_rows) == sorted(f"megatron {kind}" for kind in MEGATRON_KINDS)
    # TE's Python layer imports in the dry run (te_fused's stand-in); its layers' CUDA kernels are not played
    assert all(r[3] == "Transformer Engine's layers need CUDA" for r in te_rows), te_rows
    cuda_rows = [r for r in not_run if r[0] in ("peak memory", "CUDA graph capture") or r[0].startswith("timing ")]
    assert len(cuda_rows) == 2 * len(KERNELS) + 1 and all("needs CUDA" in r[3] for r in cuda_rows), cuda_rows
    assert sorted(r[0] for r in cuda_rows if r[0].startswith("timing ")) == sorted(f"timing {k}" for k in KERNELS)
    assert len(not_run) == len(te_rows) + len(cuda_rows), not_run
    passed = sum(r[2] == "ok" for r in rows)
    assert lines[-1] == f"{passed} passed, 0 failed, {len(not_run)} not run (not passes)"  # never "all passed"
