"""The 2D settings of a Megatron model and their validation (no megatron import needed here).

Every failure names the offending values and the valid choices; settings that would silently run as something else
(2D settings without the "2d" backend) are refused. Attention settings the op does not implement (dropout among
them) are refused by :mod:`.attention_settings`, the one table of every config field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..layout.choices import Placement, PlanKind
from ..layout.heads import check_head_split, kv_replication
from ..layout.topology import Layout2D, check_placement, divisors
from .attention_settings import check_attention_settings
from .fields import fields_2d

BACKEND_NAME = PlanKind.TWO_D


def layer_comm_types(cp_comm_type: None | str | Sequence[str]) -> list[str | None]:
    """cp_comm_type as a list (one entry, or one per layer as Megatron allows)."""
    if cp_comm_type is None or isinstance(cp_comm_type, str):
        return [cp_comm_type]
    return list(cp_comm_type)


def uses_2d(cp_comm_type) -> bool:
    """Whether any layer selects the 2d backend."""
    return BACKEND_NAME in layer_comm_types(cp_comm_type)


@dataclass(frozen=True)
class Settings2D:
    """A model's 2D layout in Megatron's words: hp x cp = CP, the Double-Ring inner ring size w, placement.

    The layout itself is ``layout``, the one :class:`~megatron_2d.layout.topology.Layout2D`, made (and so validated)
    once when the settings are; the groups are built from it."""

    context_parallel_size: int
    head_parallel_size: int
    inner_ring_size: int | None = None
    """w; None: w = cp (one ring), resolved here."""
    placement: Placement = Placement.HEAD_FIRST
    layout: Layout2D = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # hp | CP, w | cp, positive sizes, a known placement (LayoutError is a ValueError)
        layout = Layout2D(self.context_parallel_size, self.head_parallel_size, self.inner_ring_size, self.placement)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "inner_ring_size", layout.inner_ring_size)

    @property
    def context_size(self) -> int:
        return self.layout.context_size


def validate_2d_settings(
    *,
    context_parallel_size: int,
    head_parallel_size: int | None,
    context_size: int | None = None,
    inner_ring_size: int | None = None,
    placement: Placement = Placement.HEAD_FIRST,
    num_attention_heads: int,
    num_query_groups: int | None = None,
    tensor_model_parallel_size: int = 1,
    attention_dropout: float = 0.0,
) -> Settings2D:
    """Check 2D settings against the model and the parallel sizes; return them, or raise ValueError.
    ``attention_dropout`` is refused unless 0 (by :mod:`.attention_settings`' refusal of it, the one check)."""
    CP, tp = context_parallel_size, tensor_model_parallel_size
    if head_parallel_size is None:
        raise ValueError(
            f"cp_comm_type '2d' needs a head-parallel size (cp_2d_head_parallel_size, "
            f"--cp-2d-head-parallel-size, or --hierarchical-context-parallel-sizes HP CP); valid for "
            f"context_parallel_size={CP}: {divisors(CP)}"
        )
    hp = head_parallel_size
    if context_size is not None and hp * context_size != CP:
        raise ValueError(
            f"head-parallel size x context size = {hp} x {context_size} = {hp * context_size} does not "
            f"equal context_parallel_size {CP}; choose hp and cp with hp * cp = {CP}, e.g. "
            f"{', '.join(f'{d}x{CP // d}' for d in divisors(CP))}"
        )
    check_placement(placement, "cp_2d_placement")
    settings = Settings2D(CP, hp, inner_ring_size, placement)
    if num_attention_heads % tp != 0:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not divisible by tensor parallel size {tp}")
    heads = num_attention_heads // tp
    kv_heads = max(1, (num_query_groups or num_attention_heads) // tp)  # Megatron gives each TP rank >= 1 group
    check_head_split(
        heads,
        hp,
        heads=f"attention heads per tensor-parallel rank (num_attention_heads {num_attention_heads} / TP {tp})",
        sizes=divisors(CP),
        sizes_for=f" for context_parallel_size={CP}",
    )
    kv_replication(heads, kv_heads, hp)
    if attention_dropout:
        check_attention_settings(SimpleNamespace(attention_dropout=attention_dropout))
    return settings


def settings_from_config(config, **overrides) -> Settings2D:
    """Validated settings from a TransformerConfig (its ``cp_2d_*`` fields, :func:`.fields.fields_2d`), with
    overrides. (Its attention settings, dropout included, are :func:`.attention_settings.check_attention_settings`'
    to refuse.)"""
    fields = fields_2d(config)
    head_parallel_size, context_size = fields.cp_2d_head_parallel_size, fields.cp_2d_context_size
    hierarchical = getattr(config, "hierarchical_context_parallel_sizes", None)
    if head_parallel_size is None and hierarchical:
        # stock flags: --hierarchical-context-parallel-sizes HP CP gives the head x context split
        if len(hierarchical) != 2:
            raise ValueError(
                f"hierarchical_context_parallel_sizes {list(hierarchical)} cannot describe 2D attention; "
                f"give two sizes [hp, cp] (head-parallel, context) or set cp_2d_head_parallel_size"
            )
        head_parallel_size, context_size = hierarchical
    values = dict(
        head_parallel_size=head_parallel_size,
        context_size=context_size,
        inner_ring_size=fields.cp_2d_inner_ring_size,
        placement=fields.cp_2d_placement,
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return validate_2d_settings(
        context_parallel_size=config.context_parallel_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=query_groups(config),
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        **values,
    )


def query_groups(config) -> int | None:
    """The K/V heads ``config``'s layout splits (a TransformerConfig or megatron.training's args): None (one per
    query head) for MLA, which builds K/V per query head, and for flags without --group-query-attention (Megatron-LM
    reads --num-query-groups only with it); else num_query_groups."""
    if getattr(config, "multi_latent_attention", False) or getattr(config, "group_query_attention", True) is False:
        return None
    return config.num_query_groups


def layer_settings(config, cp_size: int, **overrides) -> Settings2D:
    """The settings a 2d core attention layer of ``config`` runs with inside a CP group of ``cp_size`` ranks: one
    rank's trivial layout at CP = 1 (nothing to split; the config's 2D fields are not read), else
    :func:`settings_from_config` with the layer spec's ``overrides`` (head_parallel_size, inner_ring_size,
    placement)."""
    if cp_size == 1:
        return Settings2D(1, 1, 1, Placement.HEAD_FIRST)
    return settings_from_config(config, **overrides)
