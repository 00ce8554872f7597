"""The planner is pure Python: it imports and runs where torch cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

BLOCK_TORCH = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked for this test")
            return None
    sys.meta_path.insert(0, _NoTorch())
""")


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_planner_imports_and_plans_without_torch():
    done = run_blocked(
        textwrap.dedent("""
        import json, sys
        import megatron_2d.plan
        from megatron_2d.plan.cli import main
        assert "torch" not in sys.modules
        main(["--model", "7B-GQA", "--cluster", "8xH100", "--gpus", "64", "--seq", "128K", "--window", "4K",
              "--json"])
    """)
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows and rows[0]["feasible"] and rows[0]["kind"] == "2d"


def test_the_blocker_blocks():
    done = run_blocked("import torch")
    assert done.returncode != 0 and "blocked for this test" in done.stderr
