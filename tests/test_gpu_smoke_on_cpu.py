"""tools/gpu_smoke.py is what a session lent a GPU runs first: keep it working by running it on CPU here."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_smoke_runs_on_cpu():
    run = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_smoke.py"), "--device", "cpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    failed = [line for line in run.stdout.splitlines() if not line.endswith(" ok") and "not run here" not in line]
    assert run.returncode == 0, "\n".join(failed) + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "all passed"
    for case in ("block causal=True", "attention_2d world=1", "packed zigzag", "packed documents"):
        assert any(case in line and line.endswith(" ok") for line in lines), case
