"""Kernel calls for packed documents: one call per pair of same-document runs, none across documents.

Notation
    view    a context rank's slots after the head all-to-all (see :mod:`megatron_2d.packing.sharding`):
            each the token's index in the packed stream, or -1 for padding
    run     a maximal stretch of view slots holding consecutive tokens of one document: (view, start, length,
            doc, pos), pos = position in the document of its first token
A query run at document position pq against a key run at pk sees key j from query i iff the mask's band holds
the offset (pk + j) - (pq + i): the global band (causal, sliding window) shifted by pk - pq, then trimmed to the
run pair's box (the arithmetic of :meth:`megatron_2d.layout.band.Band.trim`, here on arrays). Padding is in no run: it
never attends and is never seen.

Everything is numpy over all runs of all views at once (no per-rank or per-run Python loops); only the final
calls become :class:`BlockCall` objects.

    >>> cu = np.array([0, 3, 7])                                   # documents of 3 and 4 tokens, zigzag on 2 ranks
    >>> runs = runs_of_views(np.array([[0, -1, 3, 6], [1, 2, 4, 5]]), cu)
    >>> view_calls(runs, 0, Band(None, 0))[1]      # view 0's queries on view 1's keys: token 6 sees 4 and 5
    (BlockCall(q_start=3, q_end=4, k_start=2, k_end=4, band=None),)
    >>> view_calls(runs, 1, Band(None, 0))[1]      # its own keys: one causal call per document
    (BlockCall(q_start=0, q_end=2, k_start=0, k_end=2, band=Band(lo=None, hi=0)), \
BlockCall(q_start=2, q_end=4, k_start=2, k_end=4, band=Band(lo=None, hi=0)))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout.band import Band
from ..layout.block_calls import BlockCall

# stand-ins for an unbounded band side in integer arithmetic (far beyond any position)
_NEG, _POS = -(1 << 60), 1 << 60


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Runs:
    """The runs of every view of a layout, sorted by (doc, pos) (int64 arrays [n])."""

    view: np.ndarray
    start: np.ndarray
    length: np.ndarray
    doc: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.start)

    def select(self, mask: np.ndarray) -> Runs:
        return Runs(self.view[mask], self.start[mask], self.length[mask], self.doc[mask], self.pos[mask])

    def pairs_per_view(self, views: int) -> np.ndarray:
        """[views] causal (query, key) pairs of each view: a token at document position p sees p + 1 keys."""
        n, p = self.length, self.pos
        return np.bincount(self.view, weights=n * p + n * (n + 1) // 2, minlength=views).astype(np.int64)

    def tokens_per_view(self, views: int) -> np.ndarray:
        return np.bincount(self.view, weights=self.length, minlength=views).astype(np.int64)


def merge_pieces(view, start, length, doc, pos) -> Runs:
    """Runs from pieces given in (doc, pos) order: empty pieces dropped, a piece joined to the one before it when
    both are in the same view, slots and positions continuing."""
    view, start, length, doc, pos = (np.asarray(x, dtype=np.int64) for x in (view, start, length, doc, pos))
    keep = length > 0
    view, start, length, doc, pos = view[keep], start[keep], length[keep], doc[keep], pos[keep]
    if len(start) == 0:
        return Runs(view, start, length, doc, pos)
    joins = np.zeros(len(start), dtype=bool)
    joins[1:] = (
        (doc[1:] == doc[:-1])
        & (view[1:] == view[:-1])
        & (start[1:] == start[:-1] + length[:-1])
        & (pos[1:] == pos[:-1] + length[:-1])
    )
    first = np.flatnonzero(~joins)
    return Runs(view[first], start[first], np.add.reduceat(length, first), doc[first], pos[first])


def runs_of_views(views: np.ndarray, cu_seqlens: np.ndarray) -> Runs:
    """The runs of materialised views [n, m] (stream indices, -1 padding), row = view id."""
    views = np.atleast_2d(np.asarray(views, dtype=np.int64))
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    row, col = np.nonzero(views >= 0)
    value = views[row, col]
    doc = np.searchsorted(cu, value, side="right") - 1
    order = np.lexsort((value, doc))  # (doc, pos): pos order is stream order
    return merge_pieces(row[order], col[order], np.ones(len(order)), doc[order], value[order] - cu[doc[order]])


def _visible_ranges(q: Runs, k: Runs, band: Band | None) -> tuple[np.ndarray, np.ndarray]:
    """(first k run index, count) per q run of the same-document k runs with some visible (query, key) pair: per q
    run, the k runs of its document form a contiguous range (sorted by pos, disjoint), cut by the band's two
    sides."""
    lo = _NEG if band is None or band.lo is None else band.lo
    hi = _POS if band is None or band.hi is None else band.hi
    span = int(max(k.pos.max() + k.length.max(), q.pos.max() + q.length.max())) + 2
    k_first = k.doc * span + k.pos  # sorted (doc, pos)
    k_last = k_first + k.length - 1
    base = q.doc * span
    # key j sees query i iff lo <= j - i <= hi: some key of the run at most q_last + hi, some at least q_pos + lo
    low = np.searchsorted(k_last, base + np.clip(q.pos + lo, 0, span - 1), side="left")
    high = np.searchsorted(k_first, base + np.clip(q.pos + q.length - 1 + hi, -1, span - 1), side="right")
    return low, np.maximum(high - low, 0)


def _visible_pairs(q: Runs, k: Runs, band: Band | None) -> tuple[np.ndarray, np.ndarray]:
    """(q run index, k run index) of every same-document pair with some visible (query, key) pair."""
    low, counts = _visible_ranges(q, k, band)
    return np.repeat(np.arange(len(q)), counts), ranges(low, counts)


def _trim(q: Runs, k: Runs, qi: np.ndarray, ki: np.ndarray, band: Band | None):
    """:meth:`Band.trim` of every pair's box on arrays: (keep, q0, q1, k0, k1, lo, hi) with lo / hi the band from
    the box's origin, _NEG / _POS where that side cuts nothing."""
    nq, nk = q.length[qi], k.length[ki]
    shift = k.pos[ki] - q.pos[qi]  # the global band seen from the pair's origin
    lo = np.full(len(qi), _NEG) if band is None or band.lo is None else band.lo - shift
    hi = np.full(len(qi), _POS) if band is None or band.hi is None else band.hi - shift
    q0 = np.maximum(0, -hi)
    q1 = np.minimum(nq, nk - lo)
    k0 = np.maximum(0, q0 + lo)
    k1 = np.minimum(nk, q1 + hi)
    keep = (lo <= hi) & (q0 < q1) & (k0 < k1)
    lo, hi = lo - (k0 - q0), hi - (k0 - q0)  # from the box's origin
    lo = np.where(lo <= -(q1 - q0 - 1), _NEG, lo)
    hi = np.where(hi >= k1 - k0 - 1, _POS, hi)
    return keep, q0, q1, k0, k1, lo, hi


def _merge(calls: np.ndarray, along_keys: bool) -> np.ndarray:
    """Merge neighbouring full calls (band unbounded on both sides) that share their rows (``along_keys``) or their
    keys and continue each other. ``calls`` [n, 7]: src, q_start, q_end, k_start, k_end, lo, hi."""
    if len(calls) < 2:
        return calls
    src, q0, q1, k0, k1, lo, hi = calls.T
    order = np.lexsort((k0, q1, q0, src) if along_keys else (q0, k1, k0, src))
    c = calls[order]
    src, q0, q1, k0, k1, lo, hi = c.T
    full = (lo == _NEG) & (hi == _POS)
    same = (src[1:] == src[:-1]) & full[1:] & full[:-1]
    if along_keys:
        same &= (q0[1:] == q0[:-1]) & (q1[1:] == q1[:-1]) & (k0[1:] == k1[:-1])
    else:
        same &= (k0[1:] == k0[:-1]) & (k1[1:] == k1[:-1]) & (q0[1:] == q1[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~same)))
    last = np.concatenate((first[1:], [len(c)])) - 1
    out = c[first].copy()
    if along_keys:
        out[:, 4] = c[last, 4]
    else:
        out[:, 2] = c[last, 2]
    return out


def view_calls(
    runs: Runs, me: int, band: Band | None, ring_keys: int | None = None
) -> dict[int, tuple[BlockCall, ...]]:
    """Kernel calls of view ``me``'s queries against every view's keys under the global ``band`` (None: every key
    of the same document): {source view: calls}, views without a call left out. ``ring_keys``: the keys of other
    views that travel (a prefix); a call reading beyond it would be a layout bug (AssertionError)."""
    mine = runs.select(runs.view == me)
    if len(mine) == 0 or len(runs) == 0:
        return {}
    qi, ki = _visible_pairs(mine, runs, band)
    keep, q0, q1, k0, k1, lo, hi = _trim(mine, runs, qi, ki, band)
    qs, ks = mine.start[qi], runs.start[ki]
    calls = np.stack([runs.view[ki], qs + q0, qs + q1, ks + k0, ks + k1, lo, hi], axis=1)[keep]
    calls = _merge(_merge(calls, along_keys=True), along_keys=False)
    calls = calls[np.lexsort((calls[:, 3], calls[:, 1], calls[:, 0]))]
    if ring_keys is not None and (calls[calls[:, 0] != me, 4] > ring_keys).any():
        raise AssertionError(f"packed calls read keys beyond the ring prefix {ring_keys}")
    # one Band object per distinct band; calls as named tuples, one slice of the sorted calls per source
    kinds, kind_of = np.unique(calls[:, 5:7], axis=0, return_inverse=True)
    bands = [
        None if (l, h) == (_NEG, _POS) else Band(None if l == _NEG else l, None if h == _POS else h)
        for l, h in kinds.tolist()
    ]
    rows = [
        BlockCall(a, b, c, d, bands[k]) for (a, b, c, d), k in zip(calls[:, 1:5].tolist(), kind_of.reshape(-1).tolist())
    ]
    srcs, first = np.unique(calls[:, 0], return_index=True)
    ends = np.concatenate((first[1:], [len(rows)]))
    return {src: tuple(rows[a:b]) for src, a, b in zip(srcs.tolist(), first.tolist(), ends.tolist())}


def key_intervals(runs: Runs, band: Band | None, budget: int = 1 << 21) -> np.ndarray | None:
    """Which keys of which view every view's queries see: [n, 4] rows (dst view, src view, first slot, end slot) of
    disjoint slot intervals, sorted, neighbouring ones joined (a dst's calls on src's block read exactly these
    keys). None when finding them would look at more than ``budget`` run pairs (callers then assume every view
    sees every other)."""
    if len(runs) == 0:
        return np.zeros((0, 4), dtype=np.int64)
    low, counts = _visible_ranges(runs, runs, band)
    if int(counts.sum()) > budget:
        return None
    qi, ki = np.repeat(np.arange(len(runs)), counts), ranges(low, counts)
    keep, _, _, k0, k1, _, _ = _trim(runs, runs, qi, ki, band)
    qi, ki, k0, k1 = qi[keep], ki[keep], k0[keep], k1[keep]
    dst, src, lo, hi = runs.view[qi], runs.view[ki], runs.start[ki] + k0, runs.start[ki] + k1
    order = np.lexsort((lo, src, dst))
    dst, src, lo, hi = dst[order], src[order], lo[order], hi[order]
    # a new interval where the pair changes or the keys leave a gap after every earlier interval of the pair
    pair = np.concatenate(([True], (dst[1:] != dst[:-1]) | (src[1:] != src[:-1])))
    group = np.cumsum(pair) - 1
    offset = np.int64(hi.max(initial=0) + 1)  # keeps each pair's running max its own
    reach = np.maximum.accumulate(hi + group * offset) - group * offset
    new = pair.copy()
    new[1:] |= lo[1:] > reach[:-1]
    first = np.flatnonzero(new)
    ends = np.maximum.reduceat(hi, first) if len(first) else hi[:0]
    return np.stack([dst[first], src[first], lo[first], ends], axis=1)
