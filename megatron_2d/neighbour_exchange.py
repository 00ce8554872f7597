"""The neighbour exchange: each K/V block goes straight to the context ranks that see it (sparse masks).

A ring relays every block through every rank. With Megatron's zigzag layout a sliding window needs the keys of
both neighbours (rank r-1 for the first chunk, r+1 for the second), so even a one-way ring truncated at the
window would carry each block most of the way round. When some context ranks see nothing of others' keys
(windows), this transport sends each rank only what its queries see, directly, one offset at a time.

Notation: cp context ranks, r this rank, offset o = 1..cp-1 (offsets no rank needs are skipped);
``keys[(dst, src)]`` = (k_lo, k_hi): the hull of src's local keys that dst's queries see (None: nothing).
    forward, offset o:  send my keys[(r+o, r)] slice to r+o, receive keys[(r, r-o)] of r-o's block;
                        the next offset's exchange is posted before computing on this one.
    backward, offset o: after computing on r-o's block, send its partial dK/dV (that slice, accumulator dtype)
                        back to r-o, and receive the partial of my own block from r+o; the partials of offset o
                        travel while offset o+1 computes.
Bytes per rank: the visible key slice of its block once per rank that sees it, and the same again for dK/dV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from .comm import post_direct
from .double_ring import ComputeFn, gather_partials, home_gradient

if TYPE_CHECKING:
    from .groups import Groups2D

KeyRange = Optional[Tuple[int, int]]


def _sliced(block: torch.Tensor, keys: Tuple[int, int]) -> list:
    """Shape of ``block`` [b, S, ...] cut to keys [lo, hi)."""
    shape = list(block.shape)
    shape[1] = keys[1] - keys[0]
    return shape


class NeighbourExchange:
    """Direct sparse K/V (and dK/dV) exchange over one context group."""

    def __init__(self, groups: "Groups2D", keys: Dict[Tuple[int, int], KeyRange]) -> None:
        """This rank's exchange from its place and groups, for the key hulls of a :class:`ContextPlan`."""
        place = groups.place
        cp = len(place.context_group)
        self.rank, self.ranks, self.cp = place.context_rank, list(place.context_group), cp
        self.kv_group, self.dkv_group, self.counter = groups.context_kv_group, groups.context_dkv_group, \
            groups.comm_bytes
        r = place.context_rank
        # (offset, the slice of my block r+o sees, the slice of (r-o)'s block I see)
        self.steps = [(o, keys[((r + o) % cp, r)], keys[(r, (r - o) % cp)]) for o in range(1, cp)
                      if any(keys[((s + o) % cp, s)] is not None for s in range(cp))]

    def _post(self, group, send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int):
        return post_direct(group, send, self.ranks[dst], recv, self.ranks[src], self.counter, "neighbour")

    def _exchange_kv(self, kv: torch.Tensor, step):
        """Post one offset's K/V exchange: (works, received slice buffer or None)."""
        o, give, take = step
        send = None if give is None else kv[:, give[0]:give[1]].contiguous()
        recv = None if take is None else torch.empty(_sliced(kv, take), dtype=kv.dtype, device=kv.device)
        return self._post(self.kv_group, send, (self.rank + o) % self.cp, recv, (self.rank - o) % self.cp), recv

    def run(self, kv: torch.Tensor, compute: ComputeFn,
            dkv_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """Same contract as :meth:`DoubleRing.run`: ``compute`` sees every block this rank's queries see."""
        pending = self._exchange_kv(kv, self.steps[0]) if self.steps else None
        partials = compute(kv, self.rank, 0)
        rider = None
        if dkv_dtype is not None:                # this rank's dK/dV, gathering the partials sent back to it
            rider = home_gradient(kv, partials, None, dkv_dtype)
        pending_grad = None
        for i, step in enumerate(self.steps):
            o, give, take = step
            works, received = pending
            for work in works:
                work.wait()
            partials = None
            pending = self._exchange_kv(kv, self.steps[i + 1]) if i + 1 < len(self.steps) else None
            if take is not None:                # received: the source's keys [take[0], take[1])
                partials = compute(received, (self.rank - o) % self.cp, take[0])
            if rider is not None:
                pending_grad = self._finish(pending_grad, rider)
                send = None
                if take is not None:
                    send = gather_partials(torch.empty(_sliced(rider, take), dtype=rider.dtype, device=rider.device),
                                           partials, first_key=take[0])
                recv = None
                if give is not None:
                    recv = torch.empty(_sliced(rider, give), dtype=rider.dtype, device=rider.device)
                works = self._post(self.dkv_group, send, (self.rank - o) % self.cp, recv, (self.rank + o) % self.cp)
                pending_grad = (works, recv, give)
        if rider is not None:
            self._finish(pending_grad, rider)
        return rider

    @staticmethod
    def _finish(pending_grad, rider: torch.Tensor) -> None:
        """Wait for one offset's dK/dV partials and add the one received for my block."""
        if pending_grad is None:
            return None
        works, recv, give = pending_grad
        for work in works:
            work.wait()
        if recv is not None:
            rider[:, give[0]:give[1]].add_(recv)
        return None
