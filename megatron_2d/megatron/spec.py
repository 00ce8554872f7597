"""GPT layer specs with the 2d core attention: Megatron's own spec, chosen as its builder chooses it, with
core_attention swapped.

    --spec megatron_2d.megatron.spec gpt_layer_spec_2d      (pretrain_gpt.py; called with the model config)
    --spec megatron_2d.megatron.spec GPT_LAYER_SPEC_2D      (a ready ModuleSpec, for builders that do not call)

Megatron's ``import_module`` returns ``vars(module)[name]``, so both are plain module attributes; the ready spec is
built when this module is first imported (as :mod:`.hybrid_spec`'s are; ``import megatron_2d.megatron`` loads it only
on first use).

The choice mirrors Megatron-LM's GPT builder (gpt_builders.py, megatron.training.models.gpt.default_layer_spec):
``--transformer-impl`` picks Transformer Engine or local layers; MoE models (``num_moe_experts``) get the decoder
block spec (dense and MoE layers by ``moe_layer_freq``); the layer spec functions get the same arguments Megatron
passes (normalization, qk_layernorm, qk_l2_norm, use_te_activation_func, moe_grouped_gemm, kitchen settings, ...).
So an RMSNorm model gets RMSNorm layers on every route, and apex's FusedLayerNorm (LayerNorm only) is not picked
for it. Only core attention differs from Megatron's own spec (tests/test_megatron_spec.py compares them).
"""

from __future__ import annotations

import inspect

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from ..layout.choices import MegatronSplit
from .attention_settings import check_attention_settings
from .core_attention import CoreAttention2D
from .dynamic import check_dynamic_config, given_layouts, is_dynamic
from .launch_checks import check_current_launch, megatron_split
from .mla import check_mla_settings, use_latent_ring
from .per_sequence import SelfAttention2D
from .process_groups import PG_ATTRIBUTE, build_model_groups, group_registry
from .settings import settings_from_config, uses_2d

LayerSpec = ModuleSpec | TransformerBlockSubmodules


def transformer_engine_available() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def transformer_config_of(config):
    """The TransformerConfig of ``config``: itself, or the ``transformer`` of pretrain's GPTModelConfig."""
    return getattr(config, "transformer", config)


def _refuse_unsupported(config, transformer) -> None:
    if getattr(transformer, "experimental_attention_variant", None) is not None:
        raise ValueError(
            f"experimental_attention_variant {transformer.experimental_attention_variant!r} replaces "
            f"core attention; it cannot run with the 2d backend"
        )
    if getattr(transformer, "transformer_impl", None) == "inference_optimized":
        raise ValueError(
            "--transformer-impl inference_optimized builds inference layers; the 2d backend is a "
            "training backend: use --transformer-impl transformer_engine or local"
        )
    if getattr(config, "restore_modelopt_state", False):
        raise ValueError("ModelOpt layer specs (--restore-modelopt-state) are not supported with the 2d backend")
    if type(transformer).__name__ == "HeterogeneousTransformerConfig":
        raise ValueError(
            "heterogeneous layer configs (--heterogeneous-layers-config-path) are not supported with the 2d backend"
        )


def _uses_transformer_engine(config, use_transformer_engine: bool | None) -> bool:
    """TE layers or local ones: ``use_transformer_engine`` if given, else the config's ``transformer_impl``, else
    (no config) TE's presence."""
    if use_transformer_engine is not None:
        use_te = use_transformer_engine
    elif config is None:
        use_te = transformer_engine_available()
    else:
        impl = getattr(transformer_config_of(config), "transformer_impl", "transformer_engine")
        use_te = impl == "transformer_engine"
    if use_te and not transformer_engine_available():
        raise ValueError(
            "transformer_impl is 'transformer_engine' but Transformer Engine is not installed; install "
            "it or use --transformer-impl local"
        )
    return use_te


def megatron_gpt_spec(config, vp_stage: int | None = None, use_transformer_engine: bool | None = None) -> LayerSpec:
    """Megatron's own GPT layer spec (or, for MoE, decoder block spec) for ``config``, with the arguments its
    builder passes. ``use_transformer_engine`` overrides ``transformer_impl``; without a config, TE's presence
    decides."""
    t = transformer_config_of(config)
    _refuse_unsupported(config, t)
    use_te = _uses_transformer_engine(config, use_transformer_engine)

    def get(name: str, default=None):
        return getattr(t, name, default)  # t is None without a config

    if get("num_moe_experts"):
        return get_gpt_decoder_block_spec(
            t,
            use_transformer_engine=use_te,
            normalization=get("normalization"),
            qk_l2_norm=get("qk_l2_norm", False),
            vp_stage=vp_stage,
        )
    if use_te:
        fuser = (
            {"use_te_op_fuser": get("use_transformer_engine_op_fuser", False)}
            if "use_te_op_fuser" in inspect.signature(get_gpt_layer_with_transformer_engine_spec).parameters
            else {}
        )  # as megatron.training's builder passes it
        return get_gpt_layer_with_transformer_engine_spec(
            get("num_moe_experts"),
            get("moe_grouped_gemm", False),
            get("qk_layernorm", False),
            get("multi_latent_attention", False),
            get("experimental_attention_variant"),
            qk_l2_norm=get("qk_l2_norm", False),
            use_kitchen=get("use_kitchen", False),
            use_te_activation_func=get("use_te_activation_func", False),
            use_kitchen_attention=get("use_kitchen_attention", False),
            kitchen_attention_backend=get("kitchen_attention_backend", "sdpa"),
            mla_down_proj_fusion=get("mla_down_proj_fusion", False),
            use_grouped_gemm_for_dense_mlp=get("use_grouped_gemm_for_dense_mlp", False),
            **fuser,
        )
    return get_gpt_layer_local_spec(
        get("num_moe_experts"),
        get("moe_grouped_gemm", False),
        get("qk_layernorm", False),
        get("multi_latent_attention", False),
        get("experimental_attention_variant"),
        normalization=get("normalization"),
        use_kitchen=get("use_kitchen", False),
        use_kitchen_attention=get("use_kitchen_attention", False),
        kitchen_attention_backend=get("kitchen_attention_backend", "sdpa"),
    )


def layer_specs_of(spec: LayerSpec):
    """The distinct transformer layer specs of a layer spec (itself) or of a block spec (each one once: Megatron's
    block spec lists one object for all its dense layers and one for all its MoE layers)."""
    layers = list(spec.layer_specs) if isinstance(spec, TransformerBlockSubmodules) else [spec]
    return list({id(layer): layer for layer in layers}.values())


def get_gpt_layer_spec_2d(
    config=None,
    vp_stage: int | None = None,
    *,
    use_transformer_engine: bool | None = None,
    head_parallel_size: int | None = None,
    inner_ring_size: int | None = None,
    placement: str | None = None,
    kernel: str | None = None,
) -> LayerSpec:
    """Megatron's GPT spec for ``config`` (a TransformerConfig, or pretrain's GPTModelConfig; see
    :func:`megatron_gpt_spec`) with :class:`CoreAttention2D` as core attention in every layer; the keyword
    settings override the config's ``cp_2d_*`` fields.
    When packed batches come in Megatron's per-sequence split (:func:`.launch_checks.megatron_split`), self
    attention is :class:`SelfAttention2D` (RoPE at each token's position in its document).

    With a config, and once megatron's parallel state is initialized, it also builds the model's 2D groups
    (:func:`.process_groups.build_model_groups`, collective): call it on every rank, as Megatron's builder does,
    including ranks whose pipeline stage holds no layer. With a config, the core attention's params also carry the
    model's group registry (``groups_2d``, the config's: every virtual pipeline stage and every model built from the
    config finds the same), which each layer takes its groups from."""
    spec = megatron_gpt_spec(config, vp_stage, use_transformer_engine)
    params = {
        k: v
        for k, v in dict(
            head_parallel_size=head_parallel_size, inner_ring_size=inner_ring_size, placement=placement, kernel=kernel
        ).items()
        if v is not None
    }
    use_te = _uses_transformer_engine(config, use_transformer_engine)
    model = transformer_config_of(config)
    core_params = dict(params)
    if isinstance(model, TransformerConfig):  # a model's config, not a few spec choices: hand its registry over
        core_params[PG_ATTRIBUTE] = group_registry(model)
    check_mla_settings(model)
    # Megatron's per-sequence split of packed documents: RoPE at each token's position in its document
    per_sequence = megatron_split(model) == MegatronSplit.PER_SEQUENCE
    for layer in layer_specs_of(spec):
        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=CoreAttention2D, params=core_params
        )
        if per_sequence:
            layer.submodules.self_attention.module = SelfAttention2D
        use_latent_ring(layer, model, use_te)  # MLA: the latent ring when asked for
    if PG_ATTRIBUTE in core_params:  # Megatron's builder calls this on every rank
        build_model_groups(model, registry=core_params[PG_ATTRIBUTE], **params)
    return spec


def gpt_layer_spec_2d(config=None, vp_stage: int | None = None) -> LayerSpec:
    """For ``--spec megatron_2d.megatron.spec gpt_layer_spec_2d``: settings from the config / flags.

    The unpatched pretrain_gpt.py reaches the library only here, so the launch is checked here, on every rank before
    the model is built: the command line (:mod:`.launch_checks`) and, under CP > 1 with "2d", the 2D settings."""
    t = transformer_config_of(config)
    check_current_launch(t)
    if t is not None and is_dynamic(t) and uses_2d(t.cp_comm_type):
        check_dynamic_config(t)  # each CP group size's layout is chosen when the groups are built
        given_layouts(t)
        check_attention_settings(t)
    elif t is not None and getattr(t, "context_parallel_size", 1) > 1 and uses_2d(t.cp_comm_type):
        settings_from_config(t)
        check_attention_settings(t)
    return get_gpt_layer_spec_2d(config, vp_stage)


GPT_LAYER_SPEC_2D = get_gpt_layer_spec_2d()
"""``--spec megatron_2d.megatron.spec GPT_LAYER_SPEC_2D``: Megatron's GPT layer spec without a config (TE layers when
Transformer Engine is installed, else local ones; no MoE, MLA or config-chosen normalization) with
:class:`CoreAttention2D`, its settings from the config's ``cp_2d_*`` fields. Built at this module's import, from the
launch then current (Megatron's per-sequence split of packed documents is recognised when the launch has parsed its
flags, as it has when ``import_module`` loads the module); :func:`gpt_layer_spec_2d`, called with the config, follows
every config choice."""
