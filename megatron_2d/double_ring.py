"""The Double-Ring loop: it executes :func:`megatron_2d.ring_schedule.double_ring_events`, the one description
of the schedule (the planner replays the same events), for every ring variant, forward and backward.

Notation: a context group of cp ranks is cut into W = cp / w windows of w ranks. A rank is (window, slot),
context rank cr = window * w + slot. At round o, step t it holds the block of (window - o, slot - t).
    w = cp: one window, a plain ring on the inner links;  w = 1: a plain ring on the outer links.
K/V blocks move on the inner and outer rings, each transfer posted before the compute it overlaps. Backward sends
dK/dV "riders" with the blocks (see ring_schedule for when each is posted and awaited); a rider's last hop, from
(window, slot) to its block's owner (window + 1, slot + 1), is a direct send over the context group, its receive
expected from the start. The own block's dK/dV stays home; K/V and riders move cp-1 times per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from .comm import BufferPool, DirectExchange, PendingExchange, RingExchange
from .ring_schedule import double_ring_events, final_hop_link
from .transport import ComputeFn, add_partials, gather_partials, home_gradient

if TYPE_CHECKING:
    from .groups import Groups2D

class DoubleRing:
    """The rings of one rank: inner (w ranks) and outer (cp / w ranks), each with K/V and dK/dV exchanges, and the
    last dK/dV hop (a :class:`~megatron_2d.transport.Transport`)."""

    def __init__(self, groups: "Groups2D", ring_keys: Optional[int] = None) -> None:
        """The rings of this rank, from its place in the layout and its groups (see :mod:`megatron_2d.groups`).

        ring_keys: only the first ``ring_keys`` keys of each block travel (packed documents: the long-document
        prefix that other context ranks see); the own block is still computed whole. None: all keys travel."""
        layout, place, counter = groups.layout, groups.place, groups.comm_bytes
        self.ring_keys = ring_keys
        self.cp, self.w, self.num_windows = layout.context_size, layout.window_size, layout.num_windows
        self.window, self.slot = divmod(place.context_rank, self.w)

        def exchange(group, ranks, position, kind):
            return None if group is None else RingExchange(group, ranks, position, counter, kind)

        self.inner_kv = exchange(groups.inner_kv_group, place.intra_window_group, self.slot, "inner_ring")
        self.inner_dkv = exchange(groups.inner_dkv_group, place.intra_window_group, self.slot, "inner_ring")
        self.outer_kv = exchange(groups.outer_kv_group, place.inter_window_group, self.window, "outer_ring")
        self.outer_dkv = exchange(groups.outer_dkv_group, place.inter_window_group, self.window, "outer_ring")
        self.final_dkv = None
        if self.cp > 1:
            ranks, nw, w = place.context_group, self.num_windows, self.w
            dst = ((self.window + 1) % nw) * w + (self.slot + 1) % w
            src = ((self.window - 1) % nw) * w + (self.slot - 1) % w
            self.final_dkv = DirectExchange(groups.context_dkv_group, ranks[dst], ranks[src], counter,
                                            f"{final_hop_link(self.cp, self.w)}_ring")

    def source(self, outer_step: int, inner_step: int) -> int:
        """Context rank whose K/V this rank holds at (outer_step, inner_step)."""
        window = (self.window - outer_step) % self.num_windows
        slot = (self.slot - inner_step) % self.w
        return window * self.w + slot

    def run(self, kv: torch.Tensor, compute: ComputeFn,
            dkv_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """:meth:`~megatron_2d.transport.Transport.run`: visit every context rank's K/V block with ``compute``,
        following the schedule's events. With ``ring_keys`` the travelling blocks and riders hold the first
        ``ring_keys`` keys (a copy of this rank's, [b, ring_keys, ...]); the own block is computed whole."""
        backward = dkv_dtype is not None
        whole = own = kv
        if self.ring_keys is not None and self.ring_keys < kv.shape[1]:
            kv = kv[:, :self.ring_keys].contiguous()       # [b, ring_keys, ...]: the prefix other ranks see
        else:
            own = None
        home = None
        kv_pool = BufferPool(kv.shape, kv.dtype, kv.device)
        riders = BufferPool(kv.shape, dkv_dtype, kv.device) if backward else None
        exchanges = {"inner_kv": self.inner_kv, "outer_kv": self.outer_kv, "inner_dkv": self.inner_dkv,
                     "outer_dkv": self.outer_dkv, "final_dkv": self.final_dkv}
        pending: Dict[str, PendingExchange] = {}

        def post(channel: str, send: torch.Tensor, pool: Optional[BufferPool]) -> None:
            """Post a transfer (into a buffer of ``pool``; None: into the buffer it expects)."""
            pending[channel] = exchanges[channel].start(send, None if pool is None else pool.get())

        def wait(channel: str) -> Tuple[torch.Tensor, torch.Tensor]:
            """(received, sent) of the channel's transfer in flight, once both have completed."""
            transfer = pending.pop(channel)
            return transfer.wait(), transfer.sent

        anchor = block = kv
        partials = own_partials = mine = last_hop = None      # mine: the rider this rank holds (None: a new one)
        for event in double_ring_events(self.cp, self.w, backward):
            kind = event.kind
            if kind == "expect_final":
                self.final_dkv.expect(riders.get)
            elif kind == "post_outer_kv":
                post("outer_kv", anchor, kv_pool)
            elif kind == "post_inner_kv":
                post("inner_kv", block, kv_pool)
            elif kind == "compute":
                offset = event.source_offset
                partials = compute(own if own is not None and offset == (0, 0) else block, self.source(*offset), 0)
                if offset == (0, 0):
                    own_partials = partials
            elif kind == "accumulate_home":
                home = home_gradient(whole, own_partials, last_hop, dkv_dtype)
                own_partials = last_hop = None
            elif kind == "wait_inner_kv":
                nxt, _ = wait("inner_kv")
                if block is not anchor:
                    kv_pool.put(block)
                block = nxt
            elif kind == "wait_outer_kv":
                nxt, _ = wait("outer_kv")
                if block is not anchor:
                    kv_pool.put(block)
                if anchor is not kv:                          # the caller's block is never overwritten
                    kv_pool.put(anchor)
                anchor = block = nxt
            elif kind == "start_rider":
                mine = None
            elif kind == "wait_rider":
                mine, sent = wait("inner_dkv")
                riders.put(sent)
            elif kind == "accumulate":
                if mine is None:
                    mine = gather_partials(riders.get(), partials)
                else:
                    add_partials(mine, partials)
            elif kind == "post_rider":
                post("inner_dkv", mine, riders)
            elif kind == "wait_carried":
                carried, sent = wait("outer_dkv")
                mine.add_(carried)
                riders.put(carried)
                riders.put(sent)
            elif kind == "take_carried":
                mine, sent = wait("outer_dkv")
                riders.put(sent)
            elif kind == "post_carried":
                post("outer_dkv", mine, riders)
            elif kind == "post_final":
                post("final_dkv", mine, None)
            elif kind == "wait_final":
                last_hop, _ = wait("final_dkv")
            else:
                raise AssertionError(f"unknown schedule event {kind!r}")
        return home

