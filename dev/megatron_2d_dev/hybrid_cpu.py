"""Shims that let megatron-core 0.19.2 build and train a HybridModel (Mamba, GDN, attention, MLP layers) on CPU
ranks: test support only, installed by an explicit ``install_hybrid_cpu_shims()`` (idempotent; refuses where CUDA
is available), on top of :func:`megatron_2d_dev.megatron_cpu.install_megatron_cpu_shims`.

  H1. ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec says: it becomes megatron-core's
      ``WrappedTorchNorm`` (the local norm of the local specs) in ``hybrid_block``.
  H2. The kernels Mamba and GDN layers import (mamba_ssm, causal_conv1d, fla) are CUDA/Triton-only: the pure-torch
      stand-ins of :mod:`megatron_2d_dev.ssm_cpu` are registered under the real module names, and the megatron
      modules that bound them at import (``ssm.mamba_mixer``, ``ssm.gated_delta_net``) are re-executed
      (``importlib.reload``) so they bind the stand-ins. Classes built before the reload (Megatron's spec objects
      hold them) read the same module globals, so they use the stand-ins too.
  H3. Transformer Engine's ``thd_get_partitioned_indices`` (Megatron's THD split of a batch over CP, and Mamba's
      THD load balancing) is answered by :func:`megatron_2d.megatron.packed_data.thd_partitioned_indices`, the same
      split in torch.
"""

from __future__ import annotations

import importlib
import sys
import types

from .megatron_cpu import install_megatron_cpu_shims, refuse_with_cuda

_INSTALLED = False

STAND_IN_VERSIONS = {"mamba_ssm": "2.3.2", "causal_conv1d": "1.7.0", "fla": "0.6.0"}
"""The releases whose Python signatures the stand-ins follow (Megatron's version checks read __version__)."""


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes, __megatron_2d_cpu_stand_in__=True)
    module.__path__ = []  # a package, so that submodules import
    sys.modules[name] = module
    return module


def _register_stand_ins() -> None:
    """H2: the stand-ins under the real packages' module names."""
    from . import ssm_cpu as s

    _module("mamba_ssm", __version__=STAND_IN_VERSIONS["mamba_ssm"])
    _module("mamba_ssm.ops")
    _module("mamba_ssm.ops.triton")
    _module("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=s.RMSNormGated, rmsnorm_fn=s.rmsnorm_fn)
    _module(
        "mamba_ssm.ops.triton.ssd_combined",
        mamba_chunk_scan_combined=s.mamba_chunk_scan_combined,
        mamba_split_conv1d_scan_combined=s.mamba_split_conv1d_scan_combined,
    )
    _module("causal_conv1d", __version__=STAND_IN_VERSIONS["causal_conv1d"], causal_conv1d_fn=s.causal_conv1d_fn)
    _module("causal_conv1d.causal_conv1d_varlen", causal_conv1d_varlen_states=s.causal_conv1d_varlen_states)
    _module("fla", __version__=STAND_IN_VERSIONS["fla"])
    _module("fla.modules")
    _module("fla.modules.convolution", causal_conv1d=s.fla_causal_conv1d)
    _module("fla.modules.l2norm", l2norm=s.l2norm)
    _module("fla.ops")
    _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=s.chunk_gated_delta_rule)


def _rebind_megatron_ssm() -> None:
    """H2: re-execute the megatron modules that bound the optional kernels at import."""
    from megatron.core.ssm.gated_delta_net import common

    before = common._GDNBase
    for name in (
        "megatron.core.ssm.gated_delta_net.common",
        "megatron.core.ssm.gated_delta_net.gdn",
        "megatron.core.ssm.gated_delta_net",
        "megatron.core.ssm.mamba_mixer",
    ):
        module = importlib.import_module(name)
        importlib.reload(module)
    from megatron.core.ssm import gated_delta_net, mamba_mixer

    for cls in (before, common._GDNBase):
        _run_eagerly(cls)
    if not (mamba_mixer.HAVE_MAMBA_SSM and gated_delta_net.HAVE_FLA and mamba_mixer.causal_conv1d_fn is not None):
        raise RuntimeError("megatron-core did not pick up the CPU stand-ins of mamba_ssm / causal_conv1d / fla")


def _run_eagerly(cls: type) -> None:
    """H4: the class's torch.compile'd methods replaced by the functions they compile."""
    for name, attribute in list(vars(cls).items()):
        original = getattr(attribute, "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(cls, name, original)


def _install_final_norm() -> None:
    """H1."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm


def _install_thd_partition() -> None:
    """H3: Megatron's ``tex.thd_get_partitioned_indices`` callers get the torch split (and Mamba's version check
    on TE passes for it)."""
    from megatron.core import utils
    from megatron.core.ssm import mamba_context_parallel

    from megatron_2d.megatron.packed_data import thd_partitioned_indices

    def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank):
        return thd_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank).to(cu_seqlens.device)

    tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)
    utils.tex = tex
    mamba_context_parallel.tex = tex
    mamba_context_parallel.is_te_min_version = lambda version, check_equality=True: True


def install_hybrid_cpu_shims() -> None:
    """H1-H4 (and the megatron CPU shims first). Idempotent; refuses where CUDA is available."""
    global _INSTALLED
    refuse_with_cuda("megatron_2d_dev.hybrid_cpu", "run HybridModel with the real mamba_ssm / fla / TE")
    if _INSTALLED:
        return
    install_megatron_cpu_shims()
    _register_stand_ins()
    _rebind_megatron_ssm()
    _install_final_norm()
    _install_thd_partition()
    _INSTALLED = True


def _megatron_local_hybrid_stack_spec():
    from megatron_2d.megatron.hybrid_spec import megatron_hybrid_stack_spec

    return megatron_hybrid_stack_spec(use_transformer_engine=False)


megatron_local_hybrid_stack_spec = _megatron_local_hybrid_stack_spec()
