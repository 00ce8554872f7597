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
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .band import Band
from .block_plan import BlockCall, merge_calls


@dataclass(frozen=True)
class Run:
    """View slots [start, start + length) hold tokens pos .. pos + length - 1 of document ``doc``."""

    start: int
    length: int
    doc: int
    pos: int


def document_runs(view: np.ndarray, cu_seqlens: np.ndarray) -> Tuple[Run, ...]:
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
    pos = view[starts] - cu[docs]
    return tuple(Run(int(s), int(e - s), int(d), int(p)) for s, e, d, p in zip(starts, ends, docs, pos))


def plan_runs(q_runs: Sequence[Run], k_runs: Sequence[Run], band: Optional[Band]) -> Tuple[BlockCall, ...]:
    """Kernel calls of queries in ``q_runs`` against keys in ``k_runs`` under the global ``band``
    (None: every key of the same document is visible)."""
    by_doc: Dict[int, List[Run]] = defaultdict(list)
    for run in k_runs:
        by_doc[run.doc].append(run)
    calls: List[BlockCall] = []
    for qr in q_runs:
        row: List[BlockCall] = []
        for kr in by_doc.get(qr.doc, ()):
            if band is None:
                row.append(BlockCall(qr.start, qr.start + qr.length, kr.start, kr.start + kr.length, None))
                continue
            box = band.shifted(0, kr.pos - qr.pos).trim(qr.length, kr.length)
            if box is not None:
                row.append(BlockCall(qr.start + box.q_start, qr.start + box.q_end,
                                     kr.start + box.k_start, kr.start + box.k_end, box.band))
        calls.extend(merge_calls(row, along_keys=True))
    return tuple(merge_calls(calls, along_keys=False))
