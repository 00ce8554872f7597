"""``AttentionOptions``: the settings of one attention call besides its tensors, and the bounded cache of call plans.

The op's keywords (:func:`megatron_2d.attention_2d`) become one frozen, hashable :class:`AttentionOptions`; with the
groups, the packed layout and the shapes, dtype and device of the tensors it keys the call plan
(:mod:`megatron_2d.call.plan`), which a :class:`BoundedCache` holds: an LRU of fixed size owned by the groups (and,
for packed documents, by the batch's layout), so that nothing grows without bound and nothing lives at module level.
Megatron's core attention builds its options once per layer (:class:`megatron_2d.megatron.core_attention.
CoreAttention2D`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..layout.choices import DkvCommDtype, Kernel, check_dkv_comm_dtype

if TYPE_CHECKING:
    from ..kept_forward import KeptForward

PLAN_CACHE_SIZE = 32
"""Plans one :class:`BoundedCache` holds. A model's layers use a handful of signatures (full and windowed layers, MLA's
head dims, a dtype or two), each one plan per groups, and each packed batch's layout holds its own few: 32 keeps every
plan a training step reuses, so a step builds none after the first, while a caller sweeping shapes (benchmarks,
tests, a planner's trial runs) cannot grow it without bound."""


@dataclass(frozen=True)
class AttentionOptions:
    """What one attention call is asked besides its tensors, groups, sinks and packed layout: the op's keywords
    (see :func:`megatron_2d.attention_2d` for each), checked and made hashable (a window given as a list becomes a
    tuple, the scale a float; ``dkv_comm_dtype`` its :class:`~megatron_2d.layout.choices.DkvCommDtype` member).

    ``kept``: Selective Checkpoint++'s record of the call (:class:`megatron_2d.kept_forward.KeptForward`; None for a
    plain call), set per call by the checkpoint code (:meth:`keeping`). It is not a setting: options are equal, and
    key the same call plan, whatever their ``kept``."""

    causal: bool = True
    softmax_scale: float | None = None
    kernel: Kernel | str | None = None
    sliding_window: tuple[int, int] | None = (-1, -1)
    dkv_comm_dtype: DkvCommDtype = DkvCommDtype.ACCUMULATOR
    return_max_logit: bool = False
    kept: KeptForward | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.sliding_window, list):
            object.__setattr__(self, "sliding_window", tuple(self.sliding_window))
        if self.softmax_scale is not None:
            object.__setattr__(self, "softmax_scale", float(self.softmax_scale))
        object.__setattr__(self, "dkv_comm_dtype", check_dkv_comm_dtype(self.dkv_comm_dtype))

    def keeping(self, kept: KeptForward | None) -> AttentionOptions:
        """These options for one call whose intermediates Selective Checkpoint++ records or replays in ``kept``."""
        return self if kept is self.kept else replace(self, kept=kept)


class BoundedCache(OrderedDict):
    """A least-recently-used cache of at most ``size`` entries (:data:`PLAN_CACHE_SIZE`): the call plans of the
    groups and of packed layouts, and the layouts the groups built for batches."""

    def __init__(self, size: int = PLAN_CACHE_SIZE) -> None:
        super().__init__()
        self.size = size

    def get_or_build(self, key: Hashable, build: Callable[[], object]):
        """The plan under ``key``, built by ``build()`` when absent (then the least recently used one beyond
        ``size`` is dropped)."""
        plan = self.get(key)
        if plan is None:
            plan = self[key] = build()
            if len(self) > self.size:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return plan
