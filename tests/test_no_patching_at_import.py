"""Importing any module of the package or of the development distribution (and any tool script) patches nothing:
the megatron CPU shims come only from an explicit call (tests/conftest.py, the demo), so doctest collection and
library users see stock megatron-core and torch.cuda."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

CHECK = r"""
import importlib, importlib.util, pathlib, pkgutil, sys, typing
import torch
before = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "Stream", "Event",
                                                       "current_stream", "device_count", "set_device")}
had_override = hasattr(typing, "override")
import megatron_2d, megatron_2d_dev
names = sorted(m.name for package in (megatron_2d, megatron_2d_dev)
               for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
               if not m.name.endswith("__main__"))
for name in names:
    importlib.import_module(name)
for path in sorted(pathlib.Path(sys.argv[1], "tools").glob("*.py")):
    spec = importlib.util.spec_from_file_location("tool_" + path.stem, path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron_2d_dev import megatron_cpu
changed = [name for name, fn in before.items() if getattr(torch.cuda, name) is not fn]
assert not changed, f"torch.cuda patched at import: {changed}"
assert hasattr(typing, "override") == had_override, "typing.override installed at import"
assert not hasattr(mrandom, "_M2D_ORIGINAL_TRACKER"), "megatron's RNG tracker patched at import"
assert "megatron_2d" not in getattr(rotary_pos_embedding.get_pos_emb_on_this_cp_rank, "__module__", ""), "RoPE patched"
assert not megatron_cpu.shims_installed()
from megatron.core.models.hybrid import hybrid_block
assert "mamba_ssm" not in sys.modules and "fla" not in sys.modules, "Mamba/GDN kernel stand-ins registered at import"
assert hybrid_block.TENorm.__module__.startswith("megatron.core.extensions"), "HybridStack's final norm patched"
print("imported", len(names), "modules; nothing patched")
"""


@pytest.mark.slow
def test_importing_every_module_patches_nothing():
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(REPO)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nothing patched" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="pretends CUDA is there; on a GPU machine it is")
def test_shims_refuse_where_cuda_is_available(monkeypatch):
    from megatron_2d_dev import megatron_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(megatron_cpu.CudaAvailableError, match="CUDA is available here"):
        megatron_cpu.install_megatron_cpu_shims()
    with pytest.raises(megatron_cpu.CudaAvailableError):
        megatron_cpu.install_megatron_ddp_cpu_shims()
