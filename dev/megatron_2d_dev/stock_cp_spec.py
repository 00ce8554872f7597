"""Stock Megatron context parallelism in pretrain_gpt.py on CPU ranks: a GPT layer spec of megatron-core's local
linears and norms with megatron-core's own ``TEDotProductAttention`` as core attention.

    --spec megatron_2d_dev.stock_cp_spec gpt_layer_spec_stock_cp     (with --cp-comm-type p2p | a2a | a2a+p2p |
                                                                          all_gather, --hierarchical-context-
                                                                          parallel-sizes, --bf16 or --fp16)

The attention is stock CP exactly as Megatron runs it: ``TEDotProductAttention`` (megatron-core's class, built from
the config's context_parallel_size, cp_comm_type and hierarchical groups) over Transformer Engine's
``DotProductAttention`` and ``context_parallel.py``. The rest is megatron-core's local spec, chosen as
:func:`megatron_2d.megatron.spec.megatron_gpt_spec` chooses it (as Megatron's builder does): TE's Linear,
LayerNormLinear and norms need ``tex.generic_gemm`` and the norm kernels, which the CPU extension does not emulate.
Its parameters and checkpoints are those of ``--transformer-impl local`` (core attention holds no parameter), so a
checkpoint saved with it resumes with the 2D spec (the user's migration from stock CP to 2D).

Megatron-core must see Transformer Engine: run inside ``te_context_parallel_on_cpu(version, megatron=True)``, which
``python -m megatron_2d_dev.pretrain_cpu --te-release VERSION pretrain_gpt.py ...`` enters (``make
pretrain-stock-cpu``). TE's fused attention takes fp16 / bf16 only. In a context entered with ``claim_cuda=False``
(the benchmarks: the claim's per-op cost kept off everything but TE), the core attention is
:func:`claiming_attention`'s subclass, which claims CUDA to TE's checks around its own forward only.
"""

from __future__ import annotations

import contextlib
import sys

from megatron_2d.megatron.spec import LayerSpec, layer_specs_of, megatron_gpt_spec, transformer_config_of

from .te_context_parallel import EXTENSION, active


def te_dot_product_attention() -> type:
    """megatron-core's TEDotProductAttention of the loaded Transformer Engine; a clear error without one."""
    extension = sys.modules.get(EXTENSION)
    if extension is None or not getattr(extension, "HAVE_TE", False):
        raise RuntimeError(
            "the stock-CP spec needs megatron-core with Transformer Engine; on CPU ranks run inside "
            "megatron_2d_dev.te_context_parallel.te_context_parallel_on_cpu(version, megatron=True), e.g. "
            "python -m megatron_2d_dev.pretrain_cpu --te-release 2.20.2 pretrain_gpt.py ... (make "
            "pretrain-stock-cpu)"
        )
    context = active()
    if context is not None and not context.claims_throughout:
        return claiming_attention(extension.TEDotProductAttention)
    return extension.TEDotProductAttention


def claiming_attention(attention: type) -> type:
    """``attention`` (megatron-core's TEDotProductAttention) whose forward runs inside the active TE context's
    :meth:`~.te_context_parallel.TEOnCPU.claiming`: TE's q/k/v ``.is_cuda`` checks pass there, every other torch
    call of the step runs without the claim's TorchFunctionMode. Nothing else differs (no parameter, no state)."""

    class Claiming(attention):
        def forward(self, *args, **kwargs):
            context = active()
            with context.claiming() if context is not None else contextlib.nullcontext():
                return super().forward(*args, **kwargs)

    Claiming.__name__ = Claiming.__qualname__ = attention.__name__
    return Claiming


def _refuse_te_final_norm() -> None:
    """RuntimeError when, in TE's CPU context, GPTModel would build its final norm as TE's TENorm, which the CPU
    extension does not run: ``transformer_block`` picks its norm class when first imported, TENorm if TE is loaded
    then. (With a real TE on GPUs TENorm runs.)"""
    from megatron.core.transformer import transformer_block

    norm = transformer_block.LayerNormImpl
    if active() is not None and norm.__module__ == EXTENSION:
        raise RuntimeError(
            f"megatron.core.transformer.transformer_block was first imported inside Transformer Engine's CPU context, "
            f"so GPTModel's final norm is TE's {norm.__name__}, whose kernels the CPU extension does not run: import "
            f"it (megatron.training, or megatron.core.models.gpt) before entering te_context_parallel_on_cpu"
        )


def gpt_layer_spec_stock_cp(config=None, vp_stage: int | None = None) -> LayerSpec:
    """For ``--spec megatron_2d_dev.stock_cp_spec gpt_layer_spec_stock_cp``: Megatron's local GPT spec for
    ``config`` with TEDotProductAttention as every layer's core attention."""
    t = transformer_config_of(config)
    if t is not None and getattr(t, "params_dtype", None) is not None and not (t.bf16 or t.fp16):
        raise ValueError(
            "Transformer Engine's fused attention (the stock CP path) takes fp16 / bf16 only: add --bf16 or --fp16"
        )
    attention = te_dot_product_attention()
    _refuse_te_final_norm()
    spec = megatron_gpt_spec(config, vp_stage, use_transformer_engine=False)
    for layer in layer_specs_of(spec):
        layer.submodules.self_attention.submodules.core_attention = attention
    return spec
