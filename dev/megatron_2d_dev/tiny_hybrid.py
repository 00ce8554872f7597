"""A tiny megatron-core HybridModel (Mamba, GDN, attention and MLP layers) on forked CPU ranks: the HybridModel
counterpart of :mod:`megatron_2d_dev.tiny_gpt`, whose parallel-state, batch, loss and gradient helpers it
shares (``tg.forward_backward``, ``tg.train_steps`` and ``tg.compare_results`` take either model).

    install_hybrid_cpu_shims()                       # TENorm final norm, Mamba/GDN kernel stand-ins (explicit)
    tg.init_parallel(context_parallel_size=4)
    cfg = tiny_hybrid_config("M*-M*-", settings=(2, 1, "head_first"))
    model = build_tiny_hybrid(cfg, "M*-M*-", get_hybrid_stack_spec_2d(use_transformer_engine=False))

Sizes: hidden 64, silu activation (GDN's conv needs silu), 4 attention heads / 2 KV heads, Mamba 8 heads of 16 in 2
groups (state 16), GDN 8 key / 16 value
heads of 8: every head count divides over CP = 8, as Megatron's Mamba/GDN context parallelism needs.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_2d.layout.hybrid_layers import decoder_layers
from megatron_2d_dev import tiny_gpt as tg

SSM_SIZES = dict(
    activation_func=torch.nn.functional.silu,
    mamba_state_dim=16,
    mamba_head_dim=16,
    mamba_num_groups=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
)


def tiny_hybrid_config(pattern: str, settings: tuple[int, int, str] | None = None, **fields) -> tg.TinyGPTConfig:
    """TinyGPTConfig of a hybrid ``pattern`` (one config layer per pattern symbol); with 2D settings (hp, w,
    placement): TransformerConfig2D and cp_comm_type "2d". ``fields`` set TinyGPTConfig fields."""
    sizes = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64)
    cfg = tg.TinyGPTConfig(num_layers=len(decoder_layers(pattern)), **{**sizes, **fields})
    cfg.config_overrides = {**SSM_SIZES, **cfg.config_overrides}
    if settings is not None:
        from megatron_2d.megatron import TransformerConfig2D

        hp, w, placement = settings
        cfg.config_class, cfg.cp_comm_type = TransformerConfig2D, cfg.cp_comm_type or "2d"
        cfg.config_overrides.update(cp_2d_head_parallel_size=hp, cp_2d_inner_ring_size=w, cp_2d_placement=placement)
    return cfg


def megatron_local_stack_spec() -> ModuleSpec:
    """The CP=1 reference: Megatron's local hybrid stack spec (its own DotProductAttention), torch norms."""
    from megatron_2d.megatron.hybrid_spec import megatron_hybrid_stack_spec

    return megatron_hybrid_stack_spec(use_transformer_engine=False)


def build_tiny_hybrid(
    cfg: tg.TinyGPTConfig,
    pattern: str,
    stack_spec: ModuleSpec,
    config: TransformerConfig | None = None,
    vp_stage: int | None = None,
) -> HybridModel:
    """This rank's HybridModel of ``pattern`` (its pipeline stage's part, split at ``|``; virtual stage ``vp_stage``
    under interleaved PP) with layout-independent weights (tiny_gpt's canonical names: every parameter drawn in its
    full shape from (seed, name)). ``config``: the TransformerConfig to build from, made from ``cfg`` when None
    (pass one to build two models from it)."""
    config = tg.make_transformer_config(cfg) if config is None else config
    torch.manual_seed(cfg.seed)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=stack_spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        hybrid_layer_pattern=pattern,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type=cfg.position_embedding_type,
        vp_stage=vp_stage,
    )
    tg.reset_parameters_deterministically(model, cfg.seed)
    return model
