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
    backward, offset o: after computing on r-o's block, send its partial dK/dV (that slice, in the rider dtype)
                        back to r-o, and receive the partial of my own block from r+o; the partials of offset o
                        travel while offset o+1 computes.
Bytes per rank: the visible key slice of its block once per rank that sees it, and the same again for dK/dV.
The receiver computes on the keys as they arrive: block position p holds the p-th selected key, so its calls
against that source are planned in those packed coordinates (:meth:`KeyIntervals.packed`), ``first_key`` the first
interval's start (a hull's calls need no change). Slices are sent and received in buffers of one
:class:`~megatron_2d.transport.comm.BufferPool` per run (as large as the largest slice), reused from offset to
offset; a slice that is contiguous in the block is sent as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..layout.choices import TransportKind
from .base import TRANSPORTS, ComputeFn, KeyRoutes, gather_partials, home_gradient
from .comm import BufferPool, CommKind, PendingTransfer, post_direct

if TYPE_CHECKING:
    from ..groups import Groups2D

KeyRange = tuple[int, int] | None


@dataclass(frozen=True)
class KeyIntervals:
    """Disjoint, ascending local key intervals [lo, hi) of a block that one rank sends to another, packed back to
    back in that order (so block position p of what arrives is the p-th selected key)."""

    intervals: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    @property
    def first_key(self) -> int:
        """The local slot of the first key sent: calls in packed coordinates count from it."""
        return self.intervals[0][0]

    def gather(self, block: torch.Tensor, pool: BufferPool) -> torch.Tensor:
        """[b, size, ...]: the selected keys of ``block`` [b, S, ...], back to back: a view of ``block`` when they
        are contiguous there (nothing copied), else copied into a buffer of ``pool``."""
        parts = [block[:, lo:hi] for lo, hi in self.intervals]
        if len(parts) == 1 and parts[0].is_contiguous():
            return parts[0]
        return torch.cat(parts, dim=1, out=pool.get(self.size))

    def add_into(self, rider: torch.Tensor, packed: torch.Tensor) -> None:
        """Add ``packed`` [b, size, ...] (gradients of the selected keys) into ``rider`` at their slots."""
        at = 0
        for lo, hi in self.intervals:
            rider[:, lo:hi].add_(packed[:, at : at + hi - lo])
            at += hi - lo

    def packed(self, slots: np.ndarray) -> np.ndarray:
        """Packed coordinates of local slots (each inside an interval): first_key + its place among the keys."""
        lo = np.array([a for a, _ in self.intervals])
        before = np.cumsum([0] + [b - a for a, b in self.intervals])[:-1]
        j = np.searchsorted(lo, slots, side="right") - 1
        return self.first_key + before[j] + slots - lo[j]


def _selection(keys) -> KeyIntervals | None:
    """A hull (lo, hi), KeyIntervals or None as KeyIntervals or None."""
    if keys is None or isinstance(keys, KeyIntervals):
        return keys
    return KeyIntervals((tuple(keys),))


@TRANSPORTS.register
class NeighbourExchange:
    """Direct sparse K/V (and dK/dV) exchange over one context group (a
    :class:`~megatron_2d.transport.base.Transport`)."""

    kind: ClassVar[TransportKind] = TransportKind.NEIGHBOUR
    traffic_kinds: ClassVar[tuple[CommKind, ...]] = (CommKind.NEIGHBOUR,)

    def __init__(
        self, groups: Groups2D, keys: dict[tuple[int, int], KeyRange], offsets: Sequence[int] | None = None
    ) -> None:
        """This rank's exchange from its place and groups, for the keys each context rank sees of each other's
        block (the hulls of a :class:`ContextCalls`, or :class:`KeyIntervals`). ``offsets``: the offsets some
        rank needs, when the caller knows them (else found from ``keys``, which must then hold every pair)."""
        place = groups.place
        cp = len(place.context_group)
        self.rank, self.ranks, self.cp = place.context_rank, list(place.context_group), cp
        self.kv_group, self.dkv_group, self.counter = (
            groups.context_kv_group,
            groups.context_dkv_group,
            groups.comm_bytes,
        )
        r = place.context_rank
        # (offset, the keys of my block r+o sees, the keys of (r-o)'s block I see)
        if offsets is None:
            offsets = [o for o in range(1, cp) if any(keys[((s + o) % cp, s)] is not None for s in range(cp))]
        self.steps = [
            (o, _selection(keys.get(((r + o) % cp, r))), _selection(keys.get((r, (r - o) % cp)))) for o in offsets
        ]
        # the most keys one transfer carries: every buffer of a run holds that many
        self.buffer_keys = max(
            (sel.size for _, give, take in self.steps for sel in (give, take) if sel is not None), default=0
        )

    @classmethod
    def for_routes(cls, groups: Groups2D, routes: KeyRoutes) -> NeighbourExchange:
        return cls(groups, routes.keys, routes.offsets)

    def _post(self, group, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> PendingTransfer:
        """Send ``send`` to context rank ``dst`` and receive into ``recv`` from ``src`` (either may be None)."""
        works = post_direct(group, send, self.ranks[dst], recv, self.ranks[src], self.counter, CommKind.NEIGHBOUR)
        return PendingTransfer(works, recv, send)

    def _post_kv(self, kv: torch.Tensor, step, pool: BufferPool) -> PendingTransfer:
        """Post one offset's K/V exchange: my keys that rank r+o sees, and the keys of r-o's block that I see."""
        o, give, take = step
        send = None if give is None else give.gather(kv, pool)
        recv = None if take is None else pool.get(take.size)
        return self._post(self.kv_group, send, (self.rank + o) % self.cp, recv, (self.rank - o) % self.cp)

    def run(self, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """:meth:`~megatron_2d.transport.base.Transport.run`: ``compute`` sees every block this rank's queries see."""
        buffers = (kv.shape[0], self.buffer_keys, *kv.shape[2:])  # [b, most keys sent at once, ...]
        kv_pool = BufferPool(buffers, kv.dtype, kv.device)
        pending = self._post_kv(kv, self.steps[0], kv_pool) if self.steps else None
        partials = compute(kv, self.rank, 0)
        home = riders = pending_grad = None
        if dkv_dtype is not None:  # this rank's dK/dV, gathering the partials sent back to it
            home = home_gradient(kv, partials, None, dkv_dtype)
            riders = BufferPool(buffers, dkv_dtype, kv.device)
        for i, step in enumerate(self.steps):
            o, give, take = step
            received = pending.wait()
            _recycle(kv_pool, pending.sent, kv)
            pending = self._post_kv(kv, self.steps[i + 1], kv_pool) if i + 1 < len(self.steps) else None
            partials = None
            if take is not None:  # received: the source's selected keys, from take.first_key
                partials = compute(received, (self.rank - o) % self.cp, take.first_key)
                kv_pool.put(received)
            if home is not None:
                self._finish(pending_grad, home, riders)
                send = None if take is None else gather_partials(riders.get(take.size), partials, take.first_key)
                recv = None if give is None else riders.get(give.size)
                pending_grad = (
                    self._post(self.dkv_group, send, (self.rank - o) % self.cp, recv, (self.rank + o) % self.cp),
                    give,
                )
        if home is not None:
            self._finish(pending_grad, home, riders)
        return home

    @staticmethod
    def _finish(pending_grad, home: torch.Tensor, riders: BufferPool) -> None:
        """Wait for one offset's dK/dV partials and add the one received for my block."""
        if pending_grad is None:
            return
        transfer, give = pending_grad
        received = transfer.wait()
        if received is not None:
            give.add_into(home, received)
            riders.put(received)
        if transfer.sent is not None:
            riders.put(transfer.sent)


def _recycle(pool: BufferPool, sent: torch.Tensor | None, block: torch.Tensor) -> None:
    """Give a sent K/V slice's buffer back to ``pool``, unless it was a view of the caller's ``block`` (sent as is,
    :meth:`KeyIntervals.gather`)."""
    if sent is not None and sent.untyped_storage().data_ptr() != block.untyped_storage().data_ptr():
        pool.put(sent)
