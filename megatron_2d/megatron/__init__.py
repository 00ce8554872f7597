"""megatron-core integration: the "2d" context-parallel backend.

    from megatron_2d.megatron import TransformerConfig2D, get_gpt_layer_spec_2d
    config = TransformerConfig2D(..., context_parallel_size=8, cp_comm_type="2d", cp_2d_head_parallel_size=2,
                                 cp_2d_inner_ring_size=2, cp_2d_placement="head_first", attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_spec_2d(config), ...)
    model = HybridModel(config, get_hybrid_stack_spec_2d(), ..., hybrid_layer_pattern="M*-M*-")

The layer specs (:mod:`.spec`'s ``get_gpt_layer_spec_2d``, ``gpt_layer_spec_2d`` and the ready
``GPT_LAYER_SPEC_2D``; :mod:`.hybrid_spec`'s ``get_hybrid_stack_spec_2d`` and ready ``hybrid_stack_spec_2d*``) are
loaded on first use: their modules build the ready specs when imported.
"""

from .config import MLATransformerConfig2D, TransformerConfig2D
from .core_attention import CoreAttention2D
from .hybrid_zero import HybridZeRO, model_state_bytes_per_rank
from .process_groups import GroupRegistry, destroy_2d_groups, group_registry, groups_for
from .settings import BACKEND_NAME, Settings2D, settings_from_config, validate_2d_settings

__all__ = [
    "BACKEND_NAME",
    "CoreAttention2D",
    "GPT_LAYER_SPEC_2D",
    "HybridZeRO",
    "MLATransformerConfig2D",
    "model_state_bytes_per_rank",
    "Settings2D",
    "TransformerConfig2D",
    "GroupRegistry",
    "destroy_2d_groups",
    "get_gpt_layer_spec_2d",
    "group_registry",
    "gpt_layer_spec_2d",
    "groups_for",
    "settings_from_config",
    "validate_2d_settings",
]


SPEC_NAMES = ("get_gpt_layer_spec_2d", "gpt_layer_spec_2d", "GPT_LAYER_SPEC_2D")
HYBRID_NAMES = (
    "get_hybrid_stack_spec_2d",
    "hybrid_stack_spec_2d",
    "hybrid_stack_spec_2d_local",
    "hybrid_stack_spec_2d_te",
)


def __getattr__(name: str):
    if name in SPEC_NAMES:
        from . import spec

        return getattr(spec, name)
    if name in HYBRID_NAMES:
        from . import hybrid_spec

        return getattr(hybrid_spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
