"""Kernel calls for packed documents: one call per pair of same-document runs, none across documents.

Notation
    view    a context rank's slots after the head all-to-all (see :mod:`megatron_2d.document_placement`):
            each the token's index in the packed stream, or -1 for padding
    run     a maximal stretch of view slots holding consecutive tokens of one document: (start, length, doc, pos),
            pos = position in the document of its first token
A query run at document position pq against a key run at pk sees key j from query i iff the mask's band holds
the offset (pk + j) - (pq + i): the global band (causal, sliding window) shifted by pk - pq, then trimmed to the
run pair's box (:meth:`megatron_2d.band.Band.trim`). Padding is in no run: it never attends and is never seen.

    >>> view_q = np.array([0, 1, 2, -1]); view_k = np.array([0, 1, 2, 5])
    >>> cu = np.array([0, 3, 6])
    >>> plan_runs(document_runs(view_q, cu), document_runs(view_k, cu), Band(None, 0))   # doc 0 only
    (BlockCall(q_start=0, q_end=3, k_start=0, k_end=3, band=Band(lo=None, hi=0)),)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .band import Band
from .block_plan import BlockCall, merge_calls
from .document_placement import _ranges


@dataclass(frozen=True)
class Run:
    """View slots [start, start + length) hold tokens pos .. pos + length - 1 of document ``doc``."""

    start: int
    length: int
    doc: int
    pos: int


@dataclass(frozen=True, eq=False)
class Runs:
    """The runs of one view, in slot order, as arrays (start, length, doc, pos: int64 [n])."""

    start: np.ndarray
    length: np.ndarray
    doc: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.start)

    def __iter__(self) -> Iterator[Run]:
        return (Run(*map(int, r)) for r in zip(self.start, self.length, self.doc, self.pos))


def document_runs(view: np.ndarray, cu_seqlens: np.ndarray) -> Runs:
    """The runs of one view, in slot order."""
    view = np.asarray(view, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    real = view >= 0
    doc = np.where(real, np.searchsorted(cu, view, side="right") - 1, -1)
    prev_view = np.concatenate(([-2], view[:-1]))
    prev_doc = np.concatenate(([-1], doc[:-1]))
    starts_mask = real & ((view != prev_view + 1) | (doc != prev_doc))
    starts = np.flatnonzero(starts_mask)
    ends = np.empty_like(starts)
    if len(starts):
        # a run ends at the next start or at the first padding slot after it
        boundary = np.flatnonzero(starts_mask | ~real)
        nxt = np.searchsorted(boundary, starts, side="right")
        ends = np.where(nxt < len(boundary), boundary[np.minimum(nxt, len(boundary) - 1)], len(view))
    docs = doc[starts]
    return Runs(starts, ends - starts, docs, view[starts] - cu[docs])


def _same_document_pairs(q_runs: Runs, k_runs: Runs) -> Tuple[np.ndarray, np.ndarray]:
    """(q run index, k run index) of every pair of runs of one document, by q run then k run (slot order)."""
    by_doc = np.argsort(k_runs.doc, kind="stable")
    docs = k_runs.doc[by_doc]
    lo = np.searchsorted(docs, q_runs.doc, side="left")
    counts = np.searchsorted(docs, q_runs.doc, side="right") - lo
    q_idx = np.repeat(np.arange(len(q_runs)), counts)
    return q_idx, by_doc[_ranges(lo, counts)]


def _plan_unbounded_left(q_runs: Runs, k_runs: Runs, hi: Optional[int]) -> List[BlockCall]:
    """The calls of run pairs under Band(None, hi) (causal: hi = 0; None: every key), vectorised: the same
    boxes as :meth:`Band.trim` (a band without a lower bound keeps rows from max(0, -hi') and keys up to
    rows + hi', hi' = hi - (pk - pq))."""
    qi, ki = _same_document_pairs(q_runs, k_runs)
    nq, nk = q_runs.length[qi], k_runs.length[ki]
    if hi is None:
        q0, k1, tight = np.zeros_like(nq), nk, np.full(len(qi), -1)
        keep = np.ones(len(qi), dtype=bool)
    else:
        shifted = hi - (k_runs.pos[ki] - q_runs.pos[qi])                # hi' from the pair's origin
        q0 = np.maximum(0, -shifted)
        k1 = np.minimum(nk, nq + shifted)
        keep = (q0 < nq) & (k1 > 0)
        band_hi = shifted + q0                                          # hi'' from the box's origin
        tight = np.where(band_hi >= k1 - 1, -1, band_hi)                # -1: every key of the box visible
    qs, ks = q_runs.start[qi], k_runs.start[ki]
    bands: Dict[int, Band] = {}
    calls = []
    for a, b, c, d, t in zip((qs + q0)[keep].tolist(), (qs + nq)[keep].tolist(), ks[keep].tolist(),
                             (ks + k1)[keep].tolist(), tight[keep].tolist()):
        band = None if t < 0 else bands.setdefault(t, Band(None, t))
        calls.append(BlockCall(a, b, c, d, band))
    return calls


def plan_runs(q_runs: Runs, k_runs: Runs, band: Optional[Band]) -> Tuple[BlockCall, ...]:
    """Kernel calls of queries in ``q_runs`` against keys in ``k_runs`` under the global ``band``
    (None: every key of the same document is visible)."""
    if band is None or band.lo is None:
        calls = _plan_unbounded_left(q_runs, k_runs, None if band is None else band.hi)
    else:                                               # sliding windows: per pair, through Band.trim
        calls = []
        by_doc: Dict[int, List[Run]] = defaultdict(list)
        for run in k_runs:
            by_doc[run.doc].append(run)
        for qr in q_runs:
            for kr in by_doc.get(qr.doc, ()):
                box = band.shifted(0, kr.pos - qr.pos).trim(qr.length, kr.length)
                if box is not None:
                    calls.append(BlockCall(qr.start + box.q_start, qr.start + box.q_end,
                                           kr.start + box.k_start, kr.start + box.k_end, box.band))
    rows: List[BlockCall] = []
    first = 0
    for i in range(1, len(calls) + 1):                  # merge along keys within each query run's calls
        if i == len(calls) or calls[i].q_start != calls[first].q_start or calls[i].q_end != calls[first].q_end:
            rows.extend(merge_calls(calls[first:i], along_keys=True))
            first = i
    return tuple(merge_calls(rows, along_keys=False))
