"""HybridModel stack specs with the 2d core attention: Megatron's own hybrid stack spec with core_attention swapped.

    --spec megatron_2d.megatron.hybrid_spec hybrid_stack_spec_2d         (TE modules when TE is installed, else local)
    --spec megatron_2d.megatron.hybrid_spec hybrid_stack_spec_2d_te      (GPUs: Megatron's hybrid_stack_spec)
    --spec megatron_2d.megatron.hybrid_spec hybrid_stack_spec_2d_local   (local linears and torch norms)

pretrain_hybrid.py's builder reads ``--spec`` with megatron's ``import_module``, which returns the named object
(``vars(module)[name]``) and calls nothing: these are ModuleSpec objects, made when this module is first imported
(never by ``import megatron_2d``). Each is a copy of Megatron's spec with the attention layer's core attention
replaced by :class:`CoreAttention2D`; Mamba, GDN, MLP, MoE, DSA/MLA and MTP slots stay Megatron's, so Megatron's
later changes to them reach our users. The stack module is :class:`HybridStack2D`, Megatron's HybridStack that first
checks the launch and its layers against the CP group (:func:`.launch_checks.check_hybrid_layers`) and then builds
the model's 2D groups, on every rank and every route, before any layer is built (a pipeline stage of Mamba layers
only takes part too). The TE variant copies ``hybrid_layer_specs.hybrid_stack_spec``; the local variant copies
Megatron's local hybrid spec (``get_hybrid_stack_modelopt_spec(local_core_attention=True)``) with its Transformer
Engine norms replaced by megatron-core's ``WrappedTorchNorm``. (HybridStack builds its final norm as
``TENorm`` whatever the spec says, so the local variant still needs TE for that one norm.)

Per-layer settings follow megatron-core 0.19: HybridStack numbers its layers 1..N over the whole pattern (every
symbol one layer, ``|`` and the MTP suffix excluded), TransformerLayer picks ``cp_comm_type[layer_number - 1]`` and
core attention applies ``window_size`` by ``is_layer_window_attention(window_size, window_attn_skip_freq,
layer_number)``. So ``cp_comm_type`` lists and ``window_attn_skip_freq`` lists have one entry per hybrid layer
(the entries at Mamba, GDN and MLP positions are not read), and an integer ``window_attn_skip_freq`` counts hybrid
layer numbers, not attention layers (``*-*-`` with skip frequency 2 windows both attention layers, layers 1 and 3).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.spec_utils import ModuleSpec

from ..layout.choices import PackingMode
from ..layout.hybrid_layers import MAMBA_EXPAND
from .core_attention import CoreAttention2D
from .launch_checks import check_current_launch, check_hybrid_layers, packing_mode
from .per_sequence import SelfAttention2D
from .process_groups import PG_ATTRIBUTE, build_model_groups, model_registry

ATTENTION_SLOT = "attention_layer"


def megatron_hybrid_stack_spec(use_transformer_engine: bool) -> ModuleSpec:
    """A copy of Megatron's hybrid stack spec: ``hybrid_stack_spec`` (TE) or its local-modules spec with torch norms."""
    if use_transformer_engine:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        return copy_spec(hybrid_stack_spec)
    from megatron.core.post_training.modelopt.hybrid.model_specs import get_hybrid_stack_modelopt_spec
    from megatron.core.post_training.modelopt.layers import Norm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return copy_spec(get_hybrid_stack_modelopt_spec(local_core_attention=True), {Norm: WrappedTorchNorm})


def copy_spec(node: Any, replace: dict[Any, Any] | None = None) -> Any:
    """A copy of a spec tree: ModuleSpecs, submodule dataclasses, partials, lists and dicts are copied, their leaves
    (module classes, functions) shared, each leaf found in ``replace`` swapped for its value. (A deep copy would also
    copy the leaves, which fails on the placeholders megatron-core puts in for Transformer Engine classes when TE
    is not installed.)"""
    replace = replace or {}
    if isinstance(node, functools.partial):
        return functools.partial(
            copy_spec(node.func, replace), *node.args, **{k: copy_spec(v, replace) for k, v in node.keywords.items()}
        )
    if isinstance(node, list):
        return [copy_spec(item, replace) for item in node]
    if isinstance(node, dict):
        return {k: copy_spec(v, replace) for k, v in node.items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(
            node, **{f.name: copy_spec(getattr(node, f.name), replace) for f in dataclasses.fields(node) if f.init}
        )
    return replace.get(node, node) if _hashable(node) else node


def _hashable(node: Any) -> bool:
    try:
        hash(node)
    except TypeError:
        return False
    return True


class HybridStack2D(HybridStack):
    """Megatron's HybridStack that first checks the launch (:mod:`.launch_checks`, when megatron.training runs one)
    and its layers against the CP group (:func:`check_hybrid_layers`), then builds the model's 2D groups
    (:func:`.process_groups.build_model_groups`): on every pipeline stage, before any layer, whether or not the
    stage holds an attention layer. The model's registry (its spec's ``groups_2d``, else its ``pg_collection``'s,
    else its config's: :func:`.process_groups.model_registry`) goes to the attention layers in their spec params."""

    def __init__(self, config, submodules, *args, **kwargs) -> None:
        mixer = getattr(getattr(submodules.mamba_layer, "submodules", None), "mixer", None)
        expand = getattr(mixer, "params", {}).get("expand", MAMBA_EXPAND)
        check_current_launch(config)
        check_hybrid_layers(config, "".join(kwargs.get("layer_type_list") or []), expand)
        core_attention = core_attention_spec(submodules)
        if core_attention is not None:
            pg_collection = kwargs.get("pg_collection")
            overrides = {k: v for k, v in core_attention.params.items() if k != PG_ATTRIBUTE}
            registry = model_registry(config, pg_collection, core_attention.params.get(PG_ATTRIBUTE))
            build_model_groups(config, getattr(pg_collection, "cp", None), registry, **overrides)
            submodules = with_registry(submodules, registry)
            if packing_mode(config) == PackingMode.SEQUENCE:
                submodules = per_sequence_attention(submodules)
        super().__init__(config, submodules, *args, **kwargs)


def with_registry(submodules, registry):
    """A copy of hybrid stack ``submodules`` whose CoreAttention2D is handed the model's group ``registry``
    (its ``groups_2d`` spec param)."""
    submodules = copy_spec(submodules)
    core = core_attention_spec(submodules)
    core.params = {**core.params, PG_ATTRIBUTE: registry}
    return submodules


def per_sequence_attention(submodules):
    """A copy of hybrid stack ``submodules`` whose attention layer's self attention is :class:`SelfAttention2D`
    (RoPE at each token's position in its document), as the GPT spec chooses it for Megatron's per-sequence split of
    packed documents (--dataloader-inter-document-masking): Megatron's own THD RoPE assumes the per-document split
    and cannot place these tokens."""
    from megatron.core.transformer.attention import SelfAttention

    submodules = copy_spec(submodules)
    attention = getattr(submodules, ATTENTION_SLOT).submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(
            f"Megatron's per-sequence split of packed documents (--dataloader-inter-document-masking) needs the "
            f"hybrid attention layer's self attention to be Megatron's SelfAttention (megatron_2d replaces it with "
            f"SelfAttention2D); this spec's is {getattr(attention.module, '__name__', attention.module)}"
        )
    attention.module = SelfAttention2D
    return submodules


def core_attention_spec(submodules) -> ModuleSpec | None:
    """The CoreAttention2D spec of a hybrid stack's attention layer, or None when its core attention is another."""
    layer = getattr(submodules, ATTENTION_SLOT, None)
    attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
    core = getattr(getattr(attention, "submodules", None), "core_attention", None)
    return core if isinstance(core, ModuleSpec) and core.module is CoreAttention2D else None


def get_hybrid_stack_spec_2d(
    use_transformer_engine: bool | None = None,
    *,
    head_parallel_size: int | None = None,
    inner_ring_size: int | None = None,
    placement: str | None = None,
    kernel: str | None = None,
) -> ModuleSpec:
    """Megatron's hybrid stack spec (TE when installed, unless ``use_transformer_engine`` says otherwise) with
    :class:`CoreAttention2D` in the attention layer; the keyword settings override the config's ``cp_2d_*``."""
    from .spec import transformer_engine_available

    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    spec = megatron_hybrid_stack_spec(use_te)
    if spec.module is not HybridStack:
        raise TypeError(
            f"Megatron's hybrid stack spec builds {spec.module}, not HybridStack: megatron_2d's hybrid "
            f"spec needs updating for this megatron-core"
        )
    spec.module = HybridStack2D
    attention = getattr(spec.submodules, ATTENTION_SLOT).submodules.self_attention
    params: dict[str, Any] = {
        k: v
        for k, v in dict(
            head_parallel_size=head_parallel_size, inner_ring_size=inner_ring_size, placement=placement, kernel=kernel
        ).items()
        if v is not None
    }
    attention.submodules.core_attention = ModuleSpec(module=CoreAttention2D, params=params)
    return spec


hybrid_stack_spec_2d_te = get_hybrid_stack_spec_2d(use_transformer_engine=True)
hybrid_stack_spec_2d_local = get_hybrid_stack_spec_2d(use_transformer_engine=False)
hybrid_stack_spec_2d = get_hybrid_stack_spec_2d()
