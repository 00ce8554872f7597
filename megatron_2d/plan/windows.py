"""Sliding-window layers in the planner: the work they keep and the transport the op really uses for them.

For a causal window of ``left`` tokens over S tokens, attention keeps sum_i (min(i, left) + 1) of the S(S+1)/2
causal pairs. The op (``megatron_2d.attention_2d``) plans every context-rank pair from the zigzag chunks; when some
pairs see nothing it uses the neighbour exchange instead of the ring, sending each rank only the key slices its
queries see. The planner asks the op's own plan (``context_calls``) which pairs talk and how many keys they
move, and the op's own rule (:func:`megatron_2d.layout.transports.transport_kind`) which transport follows, so it
cannot recommend a ring that carries blocks nobody sees. Context groups beyond MAX_EXACT_CP ranks are charged the
full ring (a conservative bound, stated in the row's reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..layout.band import SlidingWindow
from ..layout.block_calls import context_calls
from ..layout.choices import TransportKind
from ..layout.topology import Layout2D
from ..layout.transports import transport_kind

if TYPE_CHECKING:
    from .packed import PackedWork

MAX_EXACT_CP = 64


@dataclass(frozen=True)
class WindowWork:
    """What a window leaves of one layer's attention on one rank."""

    fraction: float
    """Visible pairs / causal pairs (scales the attention FLOPs)."""
    dense: bool
    """Every context rank sees keys of every other: the op runs the ring (with fewer FLOPs)."""
    messages: int
    """Neighbour exchange: K/V messages the busiest rank sends per pass (0 when dense)."""
    key_tokens: int
    """Neighbour exchange: key tokens the busiest rank sends per pass, summed over its messages (per sequence)."""
    transport: str
    """The op's transport for it (:data:`megatron_2d.layout.transports.TRANSPORT_KINDS`)."""


def visible_fraction(seq: int, left: int) -> float:
    """sum_i (min(i, left) + 1) / (S (S + 1) / 2), closed form."""
    if left < 0 or left >= seq - 1:
        return 1.0
    pairs = (left + 1) * (left + 2) // 2 + (seq - left - 1) * (left + 1)
    return pairs / (seq * (seq + 1) / 2)


def window_work(hp: int, cp: int, placement: str, seq: int, left: int | None) -> WindowWork:
    """The work and neighbour traffic of a causal window of ``left`` tokens for the 2D layout (hp, cp)."""
    if left is None or left < 0 or left >= seq - 1 or cp == 1:
        return _ring_work(visible_fraction(seq, -1 if left is None else left), cp, seq)
    fraction = visible_fraction(seq, left)
    if cp > MAX_EXACT_CP:
        return _ring_work(fraction, cp, seq)
    chunk = seq // (2 * hp * cp)
    plan = context_calls(Layout2D(hp * cp, hp, 1, placement), chunk, True, SlidingWindow(left, 0))
    if transport_kind(cp, seq, plan.dense) != TransportKind.NEIGHBOUR:
        return _ring_work(fraction, cp, seq)
    sent = [
        [hull[1] - hull[0] for (dst, src), hull in plan.keys.items() if src == r and dst != r and hull]
        for r in range(cp)
    ]
    busiest = max(sent, key=sum)
    return WindowWork(fraction, False, len(busiest), sum(busiest), TransportKind.NEIGHBOUR)


def _ring_work(fraction: float, cp: int, seq: int) -> WindowWork:
    """Every pair of context ranks sees something (or is charged as if it did): the ring, or one local block."""
    return WindowWork(fraction, True, 0, 0, transport_kind(cp, seq, every_pair_sees=True))


def packed_window_work(packed: PackedWork, cp: int) -> WindowWork:
    """The transport of a packed batch (its FLOPs already count the window: fraction 1): the layout's ring prefix
    on the ring, the keys the op's calls read on the neighbour exchange, or one local block."""
    kind = transport_kind(cp, packed.ring_tokens, packed.dense)
    return WindowWork(1.0, packed.dense, packed.messages, packed.key_tokens, kind)
