"""Which kernel calls one ring step needs, from the global chunk ids each rank holds.

After the head all-to-all a context rank holds 2*hp chunks (of c tokens) of the 2*CP-chunk zigzag sequence,
stored in ascending global order. Query chunk x against key chunk y sees the keys allowed by the global band
(causality and the sliding window, see :mod:`megatron_2d.layout.band`) shifted by (y - x) * c; each chunk pair is
trimmed to the box that holds its visible keys (pairs that see nothing cost no call), then calls that see every
key of their box are merged, first along keys, then along queries, into as few calls as possible.

Without a window this gives zigzag's half blocks: the own block is one causal call; a block from an earlier rank
is all queries against the first half of its keys, a block from a later rank the second half of the queries
against all keys. context_first gives the same FLOPs in more, smaller calls.

    >>> block_pair_calls([1, 6], [0, 7], chunk_len=4, causal=True)   # K from an earlier rank: Q vs first half of K
    [BlockCall(q_start=0, q_end=8, k_start=0, k_end=4, band=None)]
    >>> block_pair_calls([1, 6], [2, 5], chunk_len=4, causal=True)   # K from a later rank: second half of Q vs all K
    [BlockCall(q_start=4, q_end=8, k_start=0, k_end=8, band=None)]
    >>> block_pair_calls([1, 6], [0, 7], chunk_len=4, causal=True, window=SlidingWindow(2, 0))  # only chunk 0's tail
    [BlockCall(q_start=0, q_end=2, k_start=2, k_end=4, band=Band(lo=0, hi=None))]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .band import Band, SlidingWindow
from .topology import Layout2D, zigzag_chunks


class BlockCall(NamedTuple):
    """Local query rows [q_start, q_end) attend to local keys [k_start, k_end) under ``band`` (None = all).
    (A named tuple: packed calls make thousands per batch.)"""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    band: Band | None

    @property
    def flops_units(self) -> int:
        """Visible (query, key) pairs, the unit of attention FLOPs."""
        nq, nk = self.q_end - self.q_start, self.k_end - self.k_start
        if self.band is None:
            return nq * nk
        return sum(_visible_keys(self.band, i, nk) for i in range(nq))


def _visible_keys(band: Band, row: int, keys: int) -> int:
    """How many of ``keys`` local keys query row ``row`` sees under ``band``."""
    first = 0 if band.lo is None else max(0, row + band.lo)
    last = keys - 1 if band.hi is None else min(keys - 1, row + band.hi)
    return max(0, last - first + 1)


def merge_calls(calls: list[BlockCall], along_keys: bool) -> list[BlockCall]:
    """Merge neighbouring full calls (band None) that share their rows (along_keys) or their keys."""
    merged: list[BlockCall] = []
    for call in calls:
        last = merged[-1] if merged else None
        if last is not None and last.band is None and call.band is None:
            if along_keys and (last.q_start, last.q_end) == (call.q_start, call.q_end) and last.k_end == call.k_start:
                merged[-1] = BlockCall(last.q_start, last.q_end, last.k_start, call.k_end, None)
                continue
            if (
                not along_keys
                and (last.k_start, last.k_end) == (call.k_start, call.k_end)
                and last.q_end == call.q_start
            ):
                merged[-1] = BlockCall(last.q_start, call.q_end, last.k_start, last.k_end, None)
                continue
        merged.append(call)
    return merged


def block_pair_calls(
    q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, causal: bool, window: SlidingWindow | None = None
) -> list[BlockCall]:
    """The kernel calls for queries holding ``q_chunks`` against keys holding ``kv_chunks`` (both ascending).

    ``window`` is the normalised sliding window (:meth:`SlidingWindow.of`); None or unbounded = none."""
    window = window or SlidingWindow()
    band = window.band(causal)
    c = chunk_len
    if band is None:
        return [BlockCall(0, len(q_chunks) * c, 0, len(kv_chunks) * c, None)]
    if list(q_chunks) == list(kv_chunks) and band == Band(None, 0):
        n = len(q_chunks) * c  # ascending chunks: local order is global order, one causal call
        return [BlockCall(0, n, 0, n, Band(None, 0))]
    calls: list[BlockCall] = []
    for qi, x in enumerate(q_chunks):
        row: list[BlockCall] = []
        for ki, y in enumerate(kv_chunks):
            box = band.shifted(0, (y - x) * c).trim(c, c)
            if box is not None:
                row.append(
                    BlockCall(
                        qi * c + box.q_start, qi * c + box.q_end, ki * c + box.k_start, ki * c + box.k_end, box.band
                    )
                )
        calls.extend(merge_calls(row, along_keys=True))
    return merge_calls(calls, along_keys=False)


def received_chunks(layout: Layout2D, context_rank: int) -> tuple[int, ...]:
    """Chunk ids in the order the head all-to-all delivers them to a context rank: by head rank, then zigzag half."""
    return tuple(
        c
        for hr in range(layout.head_parallel_size)
        for c in zigzag_chunks(layout.index_of(hr, context_rank), layout.cp_size)
    )


def context_chunks(layout: Layout2D, context_rank: int) -> tuple[int, ...]:
    """Global chunk ids (of 2*CP) a context rank holds after the head all-to-all, ascending."""
    return tuple(sorted(received_chunks(layout, context_rank)))


@dataclass(frozen=True)
class ContextCalls:
    """Every context rank's kernel calls against every context rank's K/V block, for one mask.

    calls[(dst, src)]: dst's calls on src's block; keys[(dst, src)]: the hull (k_lo, k_hi) of src's local keys
    they read, None when dst sees nothing of src."""

    calls: dict[tuple[int, int], tuple[BlockCall, ...]]
    keys: dict[tuple[int, int], tuple[int, int] | None]

    @property
    def dense(self) -> bool:
        """Whether every context rank sees some key of every other (a ring then carries nothing unseen)."""
        return all(hull is not None for hull in self.keys.values())


@functools.lru_cache(maxsize=256)
def context_calls(layout: Layout2D, chunk_len: int, causal: bool, window: SlidingWindow | None = None) -> ContextCalls:
    """The :class:`ContextCalls` of one context group (pure and cached: the same for every call of a layer)."""
    cp = layout.context_size
    chunks = [context_chunks(layout, cr) for cr in range(cp)]
    calls, keys = {}, {}
    for dst in range(cp):
        for src in range(cp):
            pair = tuple(block_pair_calls(chunks[dst], chunks[src], chunk_len, causal, window))
            calls[(dst, src)] = pair
            keys[(dst, src)] = (min(c.k_start for c in pair), max(c.k_end for c in pair)) if pair else None
    return ContextCalls(calls, keys)
