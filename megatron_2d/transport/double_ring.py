"""The Double-Ring loop: it executes :func:`megatron_2d.layout.ring_schedule.double_ring_events`, the one description
of the schedule (the planner replays the same events), for every ring variant, forward and backward.

Notation: a context group of cp ranks is cut into W = cp / w inner rings of w ranks. A rank is (ring, slot),
context rank cr = ring * w + slot. At round o, step t it holds the block of (ring - o, slot - t).
    w = cp: one inner ring, a plain ring on the inner links;  w = 1: a plain ring on the outer links.
K/V blocks move on the inner and outer rings, each transfer posted before the compute it overlaps. Backward sends
dK/dV "riders" with the blocks (see ring_schedule for when each is posted and awaited); a rider's last hop, from
(ring, slot) to its block's owner (ring + 1, slot + 1), is a direct send over the context group, its receive
expected from the start. The own block's dK/dV stays home; K/V and riders move cp-1 times per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..layout.choices import TransportKind
from ..layout.ring_schedule import Channel, EventKind, double_ring_events, final_hop_link
from .base import TRANSPORTS, ComputeFn, KeyRoutes, Partials, add_partials, gather_partials, home_gradient
from .comm import RING_TRAFFIC, BufferPool, CommKind, DirectChannel, PendingTransfer, RingChannel

if TYPE_CHECKING:
    from ..groups import Groups2D


@TRANSPORTS.register
class DoubleRing:
    """The rings of one rank: inner (w ranks) and outer (cp / w ranks), each with K/V and dK/dV channels, and the
    last dK/dV hop (a :class:`~megatron_2d.transport.base.Transport`)."""

    kind: ClassVar[TransportKind] = TransportKind.DOUBLE_RING
    traffic_kinds: ClassVar[tuple[CommKind, ...]] = (CommKind.INNER_RING, CommKind.OUTER_RING)

    def __init__(self, groups: Groups2D, ring_keys: int | None = None) -> None:
        """The rings of this rank, from its place in the layout and its groups (see :mod:`megatron_2d.groups`).

        ring_keys: only the first ``ring_keys`` keys of each block travel (packed documents: the long-document
        prefix that other context ranks see); the own block is still computed whole. None: all keys travel."""
        layout, place, counter = groups.layout, groups.place, groups.comm_bytes
        self.ring_keys = ring_keys
        self.cp, self.w, self.num_inner_rings = layout.context_size, layout.inner_ring_size, layout.num_inner_rings
        self.inner_ring, self.slot = divmod(place.context_rank, self.w)

        def channel(group, ranks, position, kind):
            return None if group is None else RingChannel(group, ranks, position, counter, kind)

        inner, outer = CommKind.INNER_RING, CommKind.OUTER_RING
        self.channels: dict[Channel, RingChannel | DirectChannel | None] = {
            Channel.INNER_KV: channel(groups.inner_kv_group, place.inner_ring_group, self.slot, inner),
            Channel.INNER_DKV: channel(groups.inner_dkv_group, place.inner_ring_group, self.slot, inner),
            Channel.OUTER_KV: channel(groups.outer_kv_group, place.outer_ring_group, self.inner_ring, outer),
            Channel.OUTER_DKV: channel(groups.outer_dkv_group, place.outer_ring_group, self.inner_ring, outer),
            Channel.FINAL_DKV: None,
        }
        if self.cp > 1:
            ranks, nw, w = place.context_group, self.num_inner_rings, self.w
            dst = ((self.inner_ring + 1) % nw) * w + (self.slot + 1) % w
            src = ((self.inner_ring - 1) % nw) * w + (self.slot - 1) % w
            traffic = RING_TRAFFIC[final_hop_link(self.cp, self.w)]
            self.channels[Channel.FINAL_DKV] = DirectChannel(
                groups.context_dkv_group, ranks[dst], ranks[src], counter, traffic
            )

    def source(self, outer_step: int, inner_step: int) -> int:
        """Context rank whose K/V this rank holds at (outer_step, inner_step)."""
        ring = (self.inner_ring - outer_step) % self.num_inner_rings
        slot = (self.slot - inner_step) % self.w
        return ring * self.w + slot

    def run(self, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """:meth:`~megatron_2d.transport.base.Transport.run`: visit every context rank's K/V block with ``compute``,
        following the schedule's events. With ``ring_keys`` the travelling blocks and riders hold the first
        ``ring_keys`` keys (a copy of this rank's, [b, ring_keys, ...]); the own block is computed whole."""
        loop = _RingLoop(self, kv, compute, dkv_dtype)
        for event in double_ring_events(self.cp, self.w, dkv_dtype is not None):
            _ACTIONS[event.kind](loop, event)
        return loop.home

    @classmethod
    def for_routes(cls, groups: Groups2D, routes: KeyRoutes) -> DoubleRing:
        return cls(groups, ring_keys=routes.ring_keys)


class _RingLoop:
    """The state of one :meth:`DoubleRing.run`: the blocks and riders held, the transfers in flight, and one
    method per :class:`~megatron_2d.layout.ring_schedule.EventKind` (:data:`_ACTIONS`)."""

    def __init__(self, ring: DoubleRing, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None) -> None:
        self.ring, self.compute_fn, self.dkv_dtype, self.whole = ring, compute, dkv_dtype, kv
        if ring.ring_keys is not None and ring.ring_keys < kv.shape[1]:
            kv = kv[:, : ring.ring_keys].contiguous()  # [b, ring_keys, ...]: the prefix other ranks see
        self.kv = self.anchor = self.block = kv  # the caller's block is read only: never put in a pool
        self.kv_pool = BufferPool(kv.shape, kv.dtype, kv.device)
        self.riders = BufferPool(kv.shape, dkv_dtype, kv.device) if dkv_dtype is not None else None
        self.pending: dict[Channel, PendingTransfer] = {}
        self.partials: Partials | None = None  # of the latest compute
        self.own_partials: Partials | None = None  # of the own block, kept home
        self.mine: torch.Tensor | None = None  # the rider this rank holds (None: a new one)
        self.last_hop: torch.Tensor | None = None  # the rider of this rank's own block, arrived
        self.home: torch.Tensor | None = None  # this rank's dK/dV (the result of backward)

    def post(self, channel: Channel, send: torch.Tensor, pool: BufferPool | None) -> None:
        """Post a transfer (into a buffer of ``pool``; None: into the buffer it expects)."""
        self.pending[channel] = self.ring.channels[channel].start(send, None if pool is None else pool.get())

    def wait(self, channel: Channel):
        """(received, sent) of the channel's transfer in flight, once both have completed."""
        transfer = self.pending.pop(channel)
        return transfer.wait(), transfer.sent

    # -- K/V -------------------------------------------------------------------------------------------------------
    def post_outer_kv(self, event) -> None:
        self.post(Channel.OUTER_KV, self.anchor, self.kv_pool)

    def post_inner_kv(self, event) -> None:
        self.post(Channel.INNER_KV, self.block, self.kv_pool)

    def compute(self, event) -> None:
        own = event.source_offset == (0, 0)
        partials = self.compute_fn(self.whole if own else self.block, self.ring.source(*event.source_offset), 0)
        self.partials = partials
        if own:
            self.own_partials = partials

    def wait_inner_kv(self, event) -> None:
        nxt, _ = self.wait(Channel.INNER_KV)
        if self.block is not self.anchor:
            self.kv_pool.put(self.block)
        self.block = nxt

    def wait_outer_kv(self, event) -> None:
        nxt, _ = self.wait(Channel.OUTER_KV)
        if self.block is not self.anchor:
            self.kv_pool.put(self.block)
        if self.anchor is not self.kv:  # the caller's block is never overwritten
            self.kv_pool.put(self.anchor)
        self.anchor = self.block = nxt

    # -- dK/dV riders ----------------------------------------------------------------------------------------------
    def expect_final(self, event) -> None:
        self.ring.channels[Channel.FINAL_DKV].expect(self.riders.get)

    def start_rider(self, event) -> None:
        self.mine = None

    def wait_rider(self, event) -> None:
        self.mine, sent = self.wait(Channel.INNER_DKV)
        self.riders.put(sent)

    def accumulate(self, event) -> None:
        if self.mine is None:
            self.mine = gather_partials(self.riders.get(), self.partials)
        else:
            add_partials(self.mine, self.partials)

    def post_rider(self, event) -> None:
        self.post(Channel.INNER_DKV, self.mine, self.riders)

    def wait_carried(self, event) -> None:
        carried, sent = self.wait(Channel.OUTER_DKV)
        self.mine.add_(carried)
        self.riders.put(carried)
        self.riders.put(sent)

    def take_carried(self, event) -> None:
        self.mine, sent = self.wait(Channel.OUTER_DKV)
        self.riders.put(sent)

    def post_carried(self, event) -> None:
        self.post(Channel.OUTER_DKV, self.mine, self.riders)

    def post_final(self, event) -> None:
        self.post(Channel.FINAL_DKV, self.mine, None)

    def wait_final(self, event) -> None:
        self.last_hop, _ = self.wait(Channel.FINAL_DKV)

    def accumulate_home(self, event) -> None:
        self.home = home_gradient(self.whole, self.own_partials, self.last_hop, self.dkv_dtype)
        self.own_partials = self.last_hop = None


_ACTIONS = {kind: getattr(_RingLoop, kind.value) for kind in EventKind}  # every kind has its method
