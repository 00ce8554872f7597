"""GPT layer specs with the 2d core attention: Megatron's own spec with core_attention swapped.

    --spec megatron_2d.megatron.spec gpt_layer_spec_2d      (pretrain_gpt.py; called with the model config)
    --spec megatron_2d.megatron.spec GPT_LAYER_SPEC_2D      (a ready ModuleSpec, for builders that do not call)
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import CoreAttention2D
from .launch_checks import check_current_launch, packing_mode
from .mla import mla_layer_options, use_latent_ring
from .per_sequence import SelfAttention2D
from .settings import settings_from_config, uses_2d


def transformer_engine_available() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def get_gpt_layer_spec_2d(config=None, vp_stage: Optional[int] = None, *, use_transformer_engine: Optional[bool] = None,
                          head_parallel_size: Optional[int] = None, double_ring_window: Optional[int] = None,
                          placement: Optional[str] = None, kernel: Optional[str] = None) -> ModuleSpec:
    """Megatron's GPT layer spec (Transformer Engine layers when TE is installed, local layers otherwise) with
    :class:`CoreAttention2D` as core attention. ``config`` (a TransformerConfig or pretrain's model config) supplies
    MoE / qk-layernorm / multi-latent attention choices (:mod:`.mla`); the keyword settings override the config's
    ``cp_2d_*`` fields. When packed batches come in Megatron's per-sequence split (:func:`packing_mode`
    "sequence"), self attention is :class:`SelfAttention2D` (RoPE at each token's position in its document)."""
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    layer_options = dict(num_experts=getattr(config, "num_moe_experts", None),
                         moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
                         qk_layernorm=getattr(config, "qk_layernorm", False),
                         **mla_layer_options(config, use_te))
    spec = (get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec)(**layer_options)
    params = {k: v for k, v in dict(head_parallel_size=head_parallel_size, double_ring_window=double_ring_window,
                                    placement=placement, kernel=kernel).items() if v is not None}
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=CoreAttention2D, params=params)
    if packing_mode(config) == "sequence":        # Megatron's per-sequence split: RoPE at document positions
        if getattr(config, "multi_latent_attention", False):
            raise ValueError("Megatron's per-sequence split of packed documents (--dataloader-inter-document-masking "
                             "without --sft) with multi-latent attention is not supported by the 2d backend: MLA's "
                             "RoPE assumes the per-document split; use --sft batches or the documents layout")
        spec.submodules.self_attention.module = SelfAttention2D
    return use_latent_ring(spec, config, use_te)


def gpt_layer_spec_2d(config=None, vp_stage: Optional[int] = None) -> ModuleSpec:
    """For ``--spec megatron_2d.megatron.spec gpt_layer_spec_2d``: settings from the config / flags.

    The unpatched pretrain_gpt.py reaches the library only here, so the launch is checked here, on every rank before
    the model is built: the command line (:mod:`.launch_checks`) and, under CP > 1 with "2d", the 2D settings."""
    check_current_launch()
    if config is not None and getattr(config, "context_parallel_size", 1) > 1 and uses_2d(config.cp_comm_type):
        settings_from_config(config)
    return get_gpt_layer_spec_2d(config, vp_stage)


def __getattr__(name: str):
    """``GPT_LAYER_SPEC_2D`` (for ``--spec megatron_2d.megatron.spec GPT_LAYER_SPEC_2D``) is built when first asked
    for, not at import: building it probes Transformer Engine."""
    if name == "GPT_LAYER_SPEC_2D":
        return get_gpt_layer_spec_2d()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
