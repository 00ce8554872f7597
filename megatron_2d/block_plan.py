"""Which kernel calls one ring step needs, from the global chunk ids each rank holds.

After the head all-to-all a context rank holds 2*hp chunks (of c tokens) of the 2*CP-chunk zigzag sequence,
stored in ascending global order. For a query set Q and a key/value set K (both ascending):
    - same set (the rank's own K/V): one causal call over the whole block;
    - disjoint sets: query chunk x sees exactly the keys before it, which form a PREFIX of K of
      n(x) = #{y in K : y < x} chunks. n(x) grows with x, so runs of query chunks sharing n(x) are
      contiguous rows: one non-causal call each, skipping n(x) = 0.
With head_first placement this reduces to zigzag's half blocks (all of Q against the first half of K, or the
second half of Q against all of K); context_first gives the same FLOPs in more, smaller calls.

    >>> plan_block([1, 6], [0, 7], chunk_len=4, causal=True)   # K from an earlier rank: Q vs first half of K
    [BlockCall(q_start=0, q_end=8, kv_len=4, causal=False)]
    >>> plan_block([1, 6], [2, 5], chunk_len=4, causal=True)   # K from a later rank: second half of Q vs all K
    [BlockCall(q_start=4, q_end=8, kv_len=8, causal=False)]
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Sequence


@dataclass(frozen=True)
class BlockCall:
    """Rows [q_start, q_end) of the local queries attend to the first kv_len local keys."""

    q_start: int
    q_end: int
    kv_len: int
    causal: bool


def plan_block(q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, causal: bool) -> List[BlockCall]:
    """The kernel calls for queries holding ``q_chunks`` against keys holding ``kv_chunks`` (both ascending)."""
    nq, nk = len(q_chunks), len(kv_chunks)
    if not causal:
        return [BlockCall(0, nq * chunk_len, nk * chunk_len, False)]
    if list(q_chunks) == list(kv_chunks):
        return [BlockCall(0, nq * chunk_len, nk * chunk_len, True)]
    if set(q_chunks) & set(kv_chunks):
        raise ValueError(f"query chunks {list(q_chunks)} and key chunks {list(kv_chunks)} overlap without being equal")
    calls: List[BlockCall] = []
    start = 0
    while start < nq:
        visible = bisect.bisect_left(kv_chunks, q_chunks[start])
        end = start + 1
        while end < nq and bisect.bisect_left(kv_chunks, q_chunks[end]) == visible:
            end += 1
        if visible > 0:
            calls.append(BlockCall(start * chunk_len, end * chunk_len, visible * chunk_len, False))
        start = end
    return calls
