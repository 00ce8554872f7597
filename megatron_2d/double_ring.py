"""The Double-Ring loop: one loop moves K/V blocks (and, in backward, their dK/dV) for every ring variant.

Notation: a context group of cp ranks is cut into W = cp / w windows of w ranks. A rank is (window, slot),
context rank cr = window * w + slot.

Outer step o = 0..W-1: the rank starts with the "anchor" block of context rank (window - o, slot). It posts the
outer send of the anchor to (window + 1, slot), receiving the next anchor from (window - 1, slot), then runs the
inner ring: at inner step t = 0..w-1 it holds the block of (window - o, slot - t), always posting the next inner
transfer before computing on the current block, so both rings overlap compute.
    w = cp: one window, a plain ring on the inner links;  w = 1: a plain ring on the outer links.

Backward sends a gradient "rider" with each block: after computing on a block the rank adds its dK/dV and
passes the rider on along the block's own path. After the last inner step one more inner pass puts each
rider on the rank whose slot matches its block, the outer ring then hands it to the next window (which holds
that block as its next anchor); after the last outer step it reaches the block's owner.
K/V moves cp-1 times per rank; riders move cp times (w = 1 or w = cp) or cp + cp/w times.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .comm import BufferPool, CommCounter, PendingExchange, RingExchange

# compute(block, source_context_rank) -> None (forward) or a list of (k_start, k_end, dk, dv) partial gradients
# of the block's keys [k_start, k_end)
Partials = List[Tuple[int, int, torch.Tensor, torch.Tensor]]
ComputeFn = Callable[[torch.Tensor, int], Optional[Partials]]


def add_partials(rider: torch.Tensor, partials: Partials, first_key: int = 0) -> None:
    """Add a block's partial dK/dV (keys [k_start, k_end)) into its rider [2, b, keys from first_key, g, d]."""
    for k_start, k_end, dk, dv in partials:
        rider[0, :, k_start - first_key:k_end - first_key].add_(dk)
        rider[1, :, k_start - first_key:k_end - first_key].add_(dv)


class DoubleRing:
    """The rings of one rank: inner (w ranks) and outer (cp / w ranks), each with K/V and dK/dV exchanges."""

    def __init__(self, context_rank: int, window_size: int, context_size: int, intra_window_group_ranks,
                 inter_window_group_ranks, groups, counter: CommCounter) -> None:
        self.w, self.num_windows = window_size, context_size // window_size
        self.window, self.slot = divmod(context_rank, window_size)

        def exchange(group, ranks, position, kind):
            return None if group is None else RingExchange(group, ranks, position, counter, kind)

        self.inner_kv = exchange(groups.inner_kv_group, intra_window_group_ranks, self.slot, "inner_ring")
        self.inner_dkv = exchange(groups.inner_dkv_group, intra_window_group_ranks, self.slot, "inner_ring")
        self.outer_kv = exchange(groups.outer_kv_group, inter_window_group_ranks, self.window, "outer_ring")
        self.outer_dkv = exchange(groups.outer_dkv_group, inter_window_group_ranks, self.window, "outer_ring")

    def source(self, outer_step: int, inner_step: int) -> int:
        """Context rank whose K/V this rank holds at (outer_step, inner_step)."""
        window = (self.window - outer_step) % self.num_windows
        slot = (self.slot - inner_step) % self.w
        return window * self.w + slot

    def run(self, kv: torch.Tensor, compute: ComputeFn, rider: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Visit every context rank's K/V block with ``compute``.

        kv: this rank's packed [2, ...] K/V block (reused as a buffer: pass a tensor the caller owns).
        rider: None in forward; in backward a zeroed accumulator-dtype tensor shaped like ``kv`` that accumulates the partial
        dK/dV of each visited block. Returns the rider holding the full dK/dV of this rank's own block.
        """
        kv_pool = BufferPool(kv)
        rider_pool = BufferPool(rider) if rider is not None else None
        pending_rider: Optional[PendingExchange] = None
        anchor = kv
        for o in range(self.num_windows):
            outer = self.outer_kv.start(anchor, kv_pool.get()) if o < self.num_windows - 1 else None
            block = anchor
            for t in range(self.w):
                inner = self.inner_kv.start(block, kv_pool.get()) if t < self.w - 1 else None
                partials = compute(block, self.source(o, t))
                if rider is not None:
                    if pending_rider is not None:
                        rider_pool.put(rider)
                        rider = pending_rider.wait()
                    add_partials(rider, partials)
                    # pass the rider on with its block (for t = w-1 this is the aligning pass)
                    pending_rider = self.inner_dkv.start(rider, rider_pool.get()) if self.w > 1 else None
                if inner is not None:
                    nxt = inner.wait()
                    if block is not anchor:
                        kv_pool.put(block)
                    block = nxt
            if block is not anchor:
                kv_pool.put(block)
            if outer is not None:
                nxt = outer.wait()
                kv_pool.put(anchor)
                anchor = nxt
            if rider is not None and self.num_windows > 1:
                if pending_rider is not None:
                    rider_pool.put(rider)
                    rider = pending_rider.wait()
                pending_rider = self.outer_dkv.start(rider, rider_pool.get())
        if rider is not None and pending_rider is not None:
            rider = pending_rider.wait()
        return rider
