"""What a generated Megatron configuration (:mod:`megatron_2d_dev.generated_configs`) trains: its
pretrain_gpt.py / pretrain_hybrid.py flags, its model config and chunks (the 2d specs, or the CP = 1 reference's
Megatron spec with its reference core attention) and its model states (a Hybrid ZeRO choice)."""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import torch

from . import ddp_harness as mcpu
from . import tiny_gpt as tg
from .generated_configs import MOE_LOSS_COEFF, QK_CLIP_THRESHOLD, Draw, Scenario, norm_route

VOCAB = 128
HIDDEN = 64
OPTIMIZER = dict(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0, clip_grad=1.0)
"""Adam (Megatron's distributed optimizer takes no other) with an epsilon far above the rounding level of the
gradients: its first update is lr * g / (|g| + eps), so a gradient element that is zero up to rounding moves its
parameter by a rounding-sized step, not by lr (eps 1e-8 would turn rounding noise into updates of +-lr); clipping at
1 acts in every iteration here, so a wrong gradient norm would also move the next losses."""
YARN_GPT = dict(
    yarn_rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=16,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=True,
)
YARN_MLA = dict(
    rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7, original_max_position_embeddings=16
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ssm_sizes(s: Scenario) -> dict[str, int]:
    """The scenario's Mamba and GDN head counts as config fields (hidden 64, Mamba expand 2)."""
    return dict(
        mamba_head_dim=2 * HIDDEN // s.ssm_heads,
        mamba_num_groups=2,
        linear_num_key_heads=s.ssm_heads,
        linear_num_value_heads=2 * s.ssm_heads,
    )


# ---- the command line the draw corresponds to ------------------------------------------------------------------------
def megatron_flags(draw: Draw) -> list[str]:
    """The pretrain_gpt.py / pretrain_hybrid.py flags of ``draw`` that the launch checks read (model sizes,
    parallel sizes, the 2d settings, how the data is packed, the loss normalisation)."""
    s = draw.scenario
    flags = [
        *("--num-layers", str(len(s.layers)), "--hidden-size", str(HIDDEN)),
        *("--num-attention-heads", str(s.heads), "--seq-length", str(s.seq_length)),
        *("--tensor-model-parallel-size", str(draw.tp), "--pipeline-model-parallel-size", str(draw.pp)),
        *("--context-parallel-size", str(draw.context_parallel_size), "--calculate-per-token-loss"),
    ]
    if draw.sequence_parallel:
        flags.append("--sequence-parallel")
    if s.moe:
        flags += ["--num-experts", "2", "--moe-router-topk", "2", *moe_router_flags(s)]
    if draw.ep > 1:
        flags += ["--expert-model-parallel-size", str(draw.ep)]
    if s.normalization != "LayerNorm":
        flags += ["--normalization", s.normalization]
    if s.query_groups != s.heads and s.model != "mla":
        flags += ["--group-query-attention", "--num-query-groups", str(s.query_groups)]
    if draw.dynamic:  # hybrid CP: a layout per group size, no static one
        flags += [
            "--cp-comm-type",
            "2d",
            "--cp-2d-placement",
            draw.placement,
            "--rerun-mode",
            "disabled",
            "--no-rope-fusion",
        ]
        flags += ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", str(draw.max_seqlen_per_rank)]
        flags += ["--cp-2d-dynamic-layouts", draw.dynamic_layouts] if draw.dynamic_layouts else []
    elif draw.context_parallel_size > 1:
        flags += ["--cp-comm-type", "2d", "--cp-2d-head-parallel-size", str(draw.hp)]
        flags += ["--cp-2d-inner-ring-size", str(draw.inner_ring_size), "--cp-2d-placement", draw.placement]
        if s.data == "documents":
            flags += ["--cp-2d-packing", "documents"]
    if s.data == "zigzag":
        flags.append("--sft")
    elif s.data in ("sequence", "documents"):
        flags.append("--dataloader-inter-document-masking")
    if s.model == "hybrid":
        sizes = ssm_sizes(s)
        flags += ["--hybrid-layer-pattern", draw.pattern, "--mamba-head-dim", str(sizes["mamba_head_dim"])]
        flags += ["--mamba-num-groups", str(sizes["mamba_num_groups"])]
        flags += ["--linear-num-key-heads", str(sizes["linear_num_key_heads"])]
        flags += ["--linear-num-value-heads", str(sizes["linear_num_value_heads"])]
    if s.model == "mla":
        flags += (
            ["--multi-latent-attention", "--cp-2d-mla-ring", draw.mla_ring] if draw.context_parallel_size > 1 else []
        )
    if draw.order == "tp-cp-ep-pp-dp":
        flags.append("--use-tp-pp-dp-mapping")
    if draw.vpp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(len(s.layers) // (draw.pp * draw.vpp))]
    if draw.recompute == "checkpoint_plus_plus":
        flags.append("--selective-checkpoint-plus-plus")
    if s.qk_clip:
        flags += ["--qk-clip", "--qk-clip-threshold", str(QK_CLIP_THRESHOLD)]
    # the clipping the draw trains with (OPTIMIZER), after Hybrid ZeRO's flags (which say --clip-grad 0.0 where its
    # choice needs it): the launch checks see the run as it is
    hz = hybrid_zero(draw).megatron_cli_args(draw.dp, draw.context_parallel_size)
    return flags + hz + ["--clip-grad", str(OPTIMIZER["clip_grad"])]


def moe_router_fields(s: Scenario) -> dict[str, Any]:
    """The TransformerConfig fields of the scenario's MoE router (generated_configs.MOE_ROUTERS)."""
    if s.moe_router in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        return dict(moe_router_load_balancing_type=s.moe_router, moe_aux_loss_coeff=MOE_LOSS_COEFF)
    if s.moe_router == "z_loss":
        return dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=MOE_LOSS_COEFF)
    if s.moe_router == "expert_bias":
        return dict(moe_aux_loss_coeff=0.0, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    return dict(moe_aux_loss_coeff=0.0)


def moe_router_flags(s: Scenario) -> list[str]:
    """The pretrain_gpt.py flags of :func:`moe_router_fields`."""
    if s.moe_router in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        return ["--moe-router-load-balancing-type", s.moe_router, "--moe-aux-loss-coeff", str(MOE_LOSS_COEFF)]
    if s.moe_router == "z_loss":
        return ["--moe-z-loss-coeff", str(MOE_LOSS_COEFF)]
    if s.moe_router == "expert_bias":
        return ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
    return []


def parse_megatron_flags(flags: list[str]):
    """Megatron-LM's parsed arguments (``megatron.training.arguments.parse_args`` with the 2d flags), without its
    validation (which needs a launched world); a copy of the namespace each call, the parse done once per flags (a
    tenth of a second of CPU each: Megatron's parser reads its config classes' source for their help)."""
    return copy.deepcopy(_parsed(tuple(flags)))


@functools.cache
def _parsed(flags: tuple[str, ...]):
    from megatron.training.arguments import parse_args

    from megatron_2d.megatron.arguments import add_2d_arguments

    saved = sys.argv
    sys.argv = ["pretrain.py", *flags]
    try:
        return parse_args(add_2d_arguments)
    finally:
        sys.argv = saved


# ---- the model -------------------------------------------------------------------------------------------------------
def _recompute_fields(draw: Draw) -> dict[str, Any]:
    if draw.recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    fields: dict[str, Any] = {}
    if draw.recompute in ("full", "checkpoint_plus_plus"):
        fields = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if draw.recompute == "checkpoint_plus_plus":
        fields["selective_checkpoint_plus_plus"] = True  # a keep-policy field goes here (CHECKPOINT_PLUS_PLUS_KEEP)
    return fields


def tiny_config(draw: Draw) -> tg.TinyGPTConfig:
    """The TinyGPTConfig of ``draw`` (its reference's when ``draw.reference``)."""
    from megatron_2d.megatron import MLATransformerConfig2D, TransformerConfig2D

    from .mla import MLA_DIMS
    from .tiny_hybrid import SSM_SIZES

    s = draw.scenario
    dtype = DTYPES[s.dtype]
    fields: dict[str, Any] = dict(
        calculate_per_token_loss=True,
        sequence_parallel=draw.sequence_parallel,
        normalization=s.normalization,
        softmax_type=s.softmax_type,
        qk_layernorm=s.qk_layernorm,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **_recompute_fields(draw),
    )
    if s.qk_clip:
        fields.update(qk_clip=True, qk_clip_threshold=QK_CLIP_THRESHOLD)
    if draw.vpp:
        # as Megatron-LM sets them for the interleaved schedule (its default --overlap-p2p-communication): with
        # batched p2p, PP = 2 would post two sends and two receives between the same two ranks in one batch, which
        # pair up crosswise (Megatron-LM's validate_args refuses that; megatron-core's config does not)
        fields.update(virtual_pipeline_model_parallel_size=draw.vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    if s.softmax_scale is not None:
        fields["softmax_scale"] = s.softmax_scale
    if s.window != "none":
        fields["window_size"] = (s.window_size, 0)
        fields["window_attn_skip_freq"] = {"every_layer": 1, "skip_freq": 2}.get(s.window) or s.skip_list()
    if s.moe:
        # top-2 of 2 experts: no routing decision that rounding could flip; no biases (megatron-core 0.19.2 allows
        # MoE biases only without expert tensor parallelism)
        fields.update(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=64, **moe_router_fields(s))
        fields.update(moe_token_dispatcher_type="alltoall", add_bias_linear=False, expert_model_parallel_size=draw.ep)
    if s.model == "hybrid":
        fields.update(SSM_SIZES, **ssm_sizes(s))
    config_class: type
    if s.model == "mla":
        fields.update(MLA_DIMS)
        if s.position == "yarn":
            fields.update(YARN_MLA)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
    else:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    cp_comm_type = None
    if draw.dynamic:  # hybrid CP: each group size's layout (given or the rule's), no static one
        config_class = MLATransformerConfig2D if s.model == "mla" else TransformerConfig2D
        cp_comm_type = "2d"
        fields.update(
            hybrid_context_parallel=True,
            max_seqlen_per_dp_cp_rank=draw.max_seqlen_per_rank,
            cp_2d_dynamic_layouts=draw.dynamic_layouts,
            cp_2d_placement=draw.placement,
        )
    elif draw.context_parallel_size > 1:
        config_class = MLATransformerConfig2D if s.model == "mla" else TransformerConfig2D
        cp_comm_type = "2d"
        fields.update(
            cp_2d_head_parallel_size=draw.hp,
            cp_2d_inner_ring_size=draw.inner_ring_size,
            cp_2d_placement=draw.placement,
            cp_2d_packing=s.data if s.data in ("sequence", "documents") else "zigzag",
        )
        if s.model == "mla":
            fields["cp_2d_mla_ring"] = draw.mla_ring
    elif draw.recompute == "checkpoint_plus_plus":
        config_class = MLATransformerConfig2D if s.model == "mla" else TransformerConfig2D
    return tg.TinyGPTConfig(
        num_layers=len(s.layers),
        hidden_size=HIDDEN,
        num_attention_heads=s.heads,
        num_query_groups=None if s.model == "mla" else s.query_groups,
        ffn_hidden_size=2 * HIDDEN,
        vocab_size=VOCAB,
        seq_length=max(s.seq_length, 256),
        seed=s.seed,
        position_embedding_type="yarn" if s.position == "yarn" and s.model != "mla" else "rope",
        cp_comm_type=cp_comm_type,
        config_overrides=fields,
        config_class=config_class,
    )


def _swap_core_attention(layer_specs, core_attention) -> None:
    for layer in layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core_attention


def megatron_attention_is_the_reference(draw: Draw) -> bool:
    """Whether Megatron's local DotProductAttention is the reference's core attention: it has no THD path, does not
    take MLA's head dims, leaves learnable sinks unmarked for TP (each TP rank's heads would get the same values
    from a full-shape draw) and keeps no max attention logit (QK-clip); :class:`ReferenceCoreAttention` stands in
    there."""
    s = draw.scenario
    return (
        s.data == "sbhd" and s.model != "mla" and not (s.softmax_type == "learnable" and draw.tp > 1) and not s.qk_clip
    )


def _norms(draw: Draw, spec):
    """``spec`` with Transformer Engine's norms where the draw's norm route is "te" (:func:`norm_route`)."""
    from .sp_norms import with_te_norms

    return with_te_norms(spec) if norm_route(draw) == "te" else spec


def _gpt_spec(draw: Draw, config, vp_stage):
    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d, layer_specs_of, megatron_gpt_spec
    from megatron_2d.testing.reference_core_attention import ReferenceCoreAttention

    if draw.context_parallel_size > 1:
        return _norms(draw, get_gpt_layer_spec_2d(config, vp_stage, use_transformer_engine=False))
    spec = megatron_gpt_spec(config, vp_stage, use_transformer_engine=False)
    if not megatron_attention_is_the_reference(draw):
        _swap_core_attention(layer_specs_of(spec), ReferenceCoreAttention)
    return _norms(draw, spec)


def _hybrid_spec(draw: Draw):
    from megatron_2d.megatron.hybrid_spec import ATTENTION_SLOT, get_hybrid_stack_spec_2d, megatron_hybrid_stack_spec
    from megatron_2d.testing.reference_core_attention import ReferenceCoreAttention

    if draw.context_parallel_size > 1:
        return _norms(draw, get_hybrid_stack_spec_2d(use_transformer_engine=False))
    spec = megatron_hybrid_stack_spec(use_transformer_engine=False)
    if not megatron_attention_is_the_reference(draw):
        _swap_core_attention([getattr(spec.submodules, ATTENTION_SLOT)], ReferenceCoreAttention)
    return _norms(draw, spec)


def build_chunks(draw: Draw, cfg: tg.TinyGPTConfig) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), built as Megatron's builder builds them: one
    config, the spec function called with it on every rank, then the model."""
    config = tg.make_transformer_config(cfg)
    if draw.scenario.position == "yarn" and draw.scenario.model != "mla":
        for name, value in YARN_GPT.items():  # megatron.training sets these on the config (argument_utils)
            setattr(config, name, value)
    stages = list(range(draw.vpp)) if draw.vpp else [None]
    chunks = []
    for vp_stage in stages:
        if draw.scenario.model == "hybrid":
            from .tiny_hybrid import build_tiny_hybrid

            chunks.append(build_tiny_hybrid(cfg, draw.pattern, _hybrid_spec(draw), config=config, vp_stage=vp_stage))
        else:
            chunks.append(tg.build_tiny_gpt(cfg, _gpt_spec(draw, config, vp_stage), config=config, vp_stage=vp_stage))
    return chunks


# ---- model states ----------------------------------------------------------------------------------------------------
def hybrid_zero(draw: Draw):
    """The draw's model states as a :class:`megatron_2d.megatron.hybrid_zero.HybridZeRO` choice."""
    from megatron_2d.megatron.hybrid_zero import HybridZeRO

    if draw.state == "ddp":
        return HybridZeRO("none")
    if draw.state == "distributed_optimizer":
        return HybridZeRO("optimizer", overlap_param_gather=True)
    if draw.state == "fsdp_zero2":
        return HybridZeRO("optimizer+grads")
    if draw.state == "fsdp_zero3":
        return HybridZeRO("optimizer+grads+params")
    D = draw.dp * draw.context_parallel_size
    optimizer_shard = D if draw.wider_optimizer_shard else None
    return HybridZeRO(draw.zero_states, shard_size=draw.shard_size, optimizer_shard_size=optimizer_shard)


def ddp_extra(draw: Draw, hz) -> dict[str, Any]:
    extra = dict(mcpu.CPU_DDP_CONFIG_OVERRIDES, bucket_size=4000)  # small buckets: several per chunk
    if draw.scenario.dtype == "bf16":
        extra["grad_reduce_in_fp32"] = True
        if hz.backend == "megatron_fsdp":
            extra["megatron_fsdp_main_grads_dtype"] = torch.float32
    return extra
