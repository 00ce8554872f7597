"""The neighbour exchange: each K/V block goes straight to the context ranks that see it (sparse masks).

A ring relays every block through every rank. With Megatron's zigzag layout a sliding window needs the keys of
both neighbours (rank r-1 for the first chunk, r+1 for the second), so even a one-way ring truncated at the
window would carry each block most of the way round. When some context ranks see nothing of others' keys
(windows), this transport sends each rank only what its queries see, directly, one offset at a time.

Notation: cp context ranks, r this rank, offset o = 1..cp-1 (offsets no rank needs are skipped);
``keys[(dst, src)]``: src's local keys that dst's queries see, a hull (k_lo, k_hi) or :class:`KeyIntervals`
(several disjoint stretches, sent packed together: packed documents), None for nothing.
    forward, offset o:  send my keys[(r+o, r)] slice to r+o, receive keys[(r, r-o)] of r-o's block;
                        the next offset's exchange is posted before computing on this one.
    backward, offset o: after computing on r-o's block, send its partial dK/dV (that slice, accumulator dtype)
                        back to r-o, and receive the partial of my own block from r+o; the partials of offset o
                        travel while offset o+1 computes.
Bytes per rank: the visible key slice of its block once per rank that sees it, and the same again for dK/dV.
The receiver computes on the keys as they arrive: block position p holds the key at local slot
``KeyIntervals.slot_of(p)``, so its calls against that source are planned in those packed coordinates
(:meth:`KeyIntervals.packed`), ``first_key`` the first interval's start (a hull's calls need no change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from .comm import post_direct
from .double_ring import ComputeFn, gather_partials, home_gradient

if TYPE_CHECKING:
    from .groups import Groups2D

KeyRange = Optional[Tuple[int, int]]


@dataclass(frozen=True)
class KeyIntervals:
    """Disjoint, ascending local key intervals [lo, hi) of a block that one rank sends to another, packed back to
    back in that order (so block position p of what arrives is the p-th selected key)."""

    intervals: Tuple[Tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    @property
    def first_key(self) -> int:
        """The local slot of the first key sent: calls in packed coordinates count from it."""
        return self.intervals[0][0]

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """[b, size, ...]: the selected keys of ``block`` [b, S, ...], back to back."""
        parts = [block[:, lo:hi] for lo, hi in self.intervals]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)

    def add_into(self, rider: torch.Tensor, packed: torch.Tensor) -> None:
        """Add ``packed`` [b, size, ...] (gradients of the selected keys) into ``rider`` at their slots."""
        at = 0
        for lo, hi in self.intervals:
            rider[:, lo:hi].add_(packed[:, at:at + hi - lo])
            at += hi - lo

    def packed(self, slots: np.ndarray) -> np.ndarray:
        """Packed coordinates of local slots (each inside an interval): first_key + its place among the keys."""
        lo = np.array([a for a, _ in self.intervals])
        before = np.cumsum([0] + [b - a for a, b in self.intervals])[:-1]
        j = np.searchsorted(lo, slots, side="right") - 1
        return self.first_key + before[j] + slots - lo[j]


def _selection(keys) -> Optional[KeyIntervals]:
    """A hull (lo, hi), KeyIntervals or None as KeyIntervals or None."""
    if keys is None or isinstance(keys, KeyIntervals):
        return keys
    return KeyIntervals((tuple(keys),))


def _sliced(block: torch.Tensor, keys: KeyIntervals) -> list:
    """Shape of ``block`` [b, S, ...] cut to the selected keys."""
    shape = list(block.shape)
    shape[1] = keys.size
    return shape


class NeighbourExchange:
    """Direct sparse K/V (and dK/dV) exchange over one context group."""

    def __init__(self, groups: "Groups2D", keys: Dict[Tuple[int, int], KeyRange],
                 offsets: Optional[Sequence[int]] = None) -> None:
        """This rank's exchange from its place and groups, for the keys each context rank sees of each other's
        block (the hulls of a :class:`ContextPlan`, or :class:`KeyIntervals`). ``offsets``: the offsets some
        rank needs, when the caller knows them (else found from ``keys``, which must then hold every pair)."""
        place = groups.place
        cp = len(place.context_group)
        self.rank, self.ranks, self.cp = place.context_rank, list(place.context_group), cp
        self.kv_group, self.dkv_group, self.counter = groups.context_kv_group, groups.context_dkv_group, \
            groups.comm_bytes
        r = place.context_rank
        # (offset, the keys of my block r+o sees, the keys of (r-o)'s block I see)
        if offsets is None:
            offsets = [o for o in range(1, cp) if any(keys[((s + o) % cp, s)] is not None for s in range(cp))]
        self.steps = [(o, _selection(keys.get(((r + o) % cp, r))), _selection(keys.get((r, (r - o) % cp))))
                      for o in offsets]

    def _post(self, group, send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int):
        return post_direct(group, send, self.ranks[dst], recv, self.ranks[src], self.counter, "neighbour")

    def _exchange_kv(self, kv: torch.Tensor, step):
        """Post one offset's K/V exchange: (works, received slice buffer or None)."""
        o, give, take = step
        send = None if give is None else give.gather(kv)
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
            if take is not None:                # received: the source's selected keys, from take.first_key
                partials = compute(received, (self.rank - o) % self.cp, take.first_key)
            if rider is not None:
                pending_grad = self._finish(pending_grad, rider)
                send = None
                if take is not None:
                    send = gather_partials(torch.empty(_sliced(rider, take), dtype=rider.dtype, device=rider.device),
                                           partials, first_key=take.first_key)
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
            give.add_into(rider, recv)
        return None
