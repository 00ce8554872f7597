"""``TransformerConfig2D`` / ``MLATransformerConfig2D``: megatron-core's TransformerConfig and MLATransformerConfig
with the 2D context-parallel settings (the one table of them, :class:`.fields.Fields2D`, shared by both)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from .attention_settings import check_attention_settings
from .checkpoint_plus import check_checkpoint_plus_config
from .dynamic import check_dynamic_config, given_layouts, is_dynamic
from .fields import NEEDS_2D, NEEDS_CHECKPOINT_PLUS, NEEDS_HYBRID, Fields2D, check_values, ignored_settings
from .launch_checks import LaunchFields, documents_layout_problem
from .mla import check_mla_settings
from .process_groups import group_registry
from .settings import layer_comm_types, settings_from_config, uses_2d


class Checked2D(Fields2D, LaunchFields):
    """The 2D settings of :mod:`.fields`' table, checked when a config is built (mixed in with it), and what the
    layers need of the launch (:class:`.launch_checks.LaunchFields`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        group_registry(self)  # the model's 2D groups live here; Megatron's per-layer config copies share them
        if self.selective_checkpoint_plus_plus:
            problem = check_checkpoint_plus_config(self)
            if problem:
                raise ValueError(problem)
        else:
            unused = ignored_settings(self, NEEDS_CHECKPOINT_PLUS)
            if unused:
                raise ValueError(
                    f"{unused} set without selective_checkpoint_plus_plus, so they would be ignored; set "
                    f"selective_checkpoint_plus_plus=True (--selective-checkpoint-plus-plus) or drop them"
                )
        if not (is_dynamic(self) and uses_2d(self.cp_comm_type)):
            unused = ignored_settings(self, NEEDS_HYBRID)
            if unused:
                raise ValueError(
                    f"{unused} set without hybrid_context_parallel and cp_comm_type '2d', so they would be ignored; "
                    f"set hybrid_context_parallel=True (--hybrid-context-parallel) with cp_comm_type='2d' or drop them"
                )
        if uses_2d(self.cp_comm_type):
            check_values(self, NEEDS_2D)
            check_values(self, NEEDS_HYBRID)
            problem = documents_layout_problem(self)
            if problem:
                raise ValueError(problem)
            check_mla_settings(self)
            if is_dynamic(self):  # each CP group size has its layout: checked here, chosen at construction
                check_dynamic_config(self)
                given_layouts(self)
            else:
                settings_from_config(self)
            check_attention_settings(self)
            return
        given = ignored_settings(self, NEEDS_2D)
        if given:
            raise ValueError(
                f"2D settings {given} are set but cp_comm_type is {layer_comm_types(self.cp_comm_type)}, "
                f"so they would be ignored; set cp_comm_type='2d' (--cp-comm-type 2d) or drop them"
            )


@dataclass
class TransformerConfig2D(Checked2D, TransformerConfig):
    """Select the backend with ``cp_comm_type="2d"`` (or a per-layer list containing "2d").

    Validated when built: hp x cp = context_parallel_size, hp divides the heads per TP rank, w divides cp, a
    known placement, and every attention setting honoured or refused (:mod:`.attention_settings`). 2D settings
    given without the "2d" backend are refused.
    """


@dataclass
class MLATransformerConfig2D(Checked2D, MLATransformerConfig):
    """:class:`TransformerConfig2D` for multi-latent attention (megatron-core's MLATransformerConfig): the same 2D
    settings and validation, and ``cp_2d_mla_ring`` to choose what travels the ring."""
