"""Every context rank's ring view of a packed batch, as runs (numpy over all views at once, no per-rank loops).

A context rank's view is what it holds after the head all-to-all, in the order its ring uses (see
:mod:`megatron_2d.packing.sharding` for the layouts). Materialising every view costs CP * t_local slots (every
document padded to 2*CP in zigzag), so the layout describes them by their runs instead: stretches of consecutive
tokens of one document (:class:`megatron_2d.packing.calls.Runs`), computed here from the layout's arithmetic. A
piece is the part of one zigzag chunk (or one whole document) that holds real tokens; pieces are enumerated in
(document, position) order and joined into runs where a view holds them side by side.

    zigzag     views of hp = 1 are the rank's slots (padding in place); with hp > 1 the ring takes each view
               sorted by stream index (padding last), so a document's chunks from the hp head ranks lie together
    documents  [long chunks | whole documents | padding], built in ring order
    sequence   Megatron's per-sequence zigzag of the whole packed stream (chunks of T / 2CP tokens that cut
               through documents), each view in ascending chunk order

    >>> from megatron_2d.layout.topology import Layout2D
    >>> runs = zigzag_runs(np.array([0, 3, 7]), Layout2D(2, 1, 1))
    >>> materialise(runs, np.array([0, 3, 7]), 2, 4)      # = zigzag_slots(cu, 2)
    array([[ 0, -1,  3,  6],
           [ 1,  2,  4,  5]])
"""

from __future__ import annotations

import numpy as np

from ..layout.choices import Placement
from ..layout.topology import Layout2D
from .calls import Runs, ranges


def context_rank_of(layout: Layout2D, cp_index: np.ndarray) -> np.ndarray:
    """The context rank of each CP index (:meth:`Layout2D.coords_of` on arrays)."""
    if layout.placement == Placement.HEAD_FIRST:
        return cp_index // layout.head_parallel_size
    return cp_index % layout.context_size


def zigzag_chunk_holders(chunks: np.ndarray, ranks: int):
    """(rank, half) holding each zigzag chunk id of 2 * ``ranks``: chunk c < ranks is the first half of rank c,
    chunk c >= ranks the second half of rank 2*ranks-1-c."""
    second = chunks >= ranks
    return np.where(second, 2 * ranks - 1 - chunks, chunks), second.astype(np.int64)


class ChunkGroups:
    """The 2 * ranks zigzag chunks cut into groups of consecutive chunks held by one view (head_first head groups
    hold hp consecutive chunks per half; the middle pair of a ring view is adjacent): a document's part in a
    group is one run. Arrays [groups]: first chunk, chunks, view, half of the first chunk."""

    def __init__(self, view_of_chunk: np.ndarray, half_of_chunk: np.ndarray) -> None:
        new = np.concatenate(([True], view_of_chunk[1:] != view_of_chunk[:-1]))
        self.first = np.flatnonzero(new)
        self.count = np.diff(np.concatenate((self.first, [len(view_of_chunk)])))
        self.view, self.half = view_of_chunk[self.first], half_of_chunk[self.first]

    def pieces(self, lengths: np.ndarray, chunk: np.ndarray):
        """(doc, group, position, length) of every document's part in every group that holds real tokens, in
        (document, position) order; documents cut into chunks of ``chunk`` tokens."""
        used = np.searchsorted(self.first, -(-lengths // chunk), side="left")  # groups starting before the end
        doc = np.repeat(np.arange(len(lengths)), used)
        group = ranges(np.zeros(len(lengths), dtype=np.int64), used)
        pos = self.first[group] * chunk[doc]
        return doc, group, pos, np.minimum(self.count[group] * chunk[doc], lengths[doc] - pos)


def _zigzag_groups(layout: Layout2D) -> ChunkGroups:
    index, half = zigzag_chunk_holders(np.arange(2 * layout.cp_size), layout.cp_size)
    return ChunkGroups(context_rank_of(layout, index), half)


def _sorted_slots(view: np.ndarray, length: np.ndarray, views: int) -> np.ndarray:
    """Slot of each piece when every view lists its pieces in the given order, back to back from slot 0."""
    order = np.argsort(view.astype(np.int16 if views < 2**15 else np.int64), kind="stable")  # radix sort
    ends = np.cumsum(length[order])
    first = np.searchsorted(view[order], np.arange(views))
    starts_of_view = np.concatenate(([0], ends))[first]
    slots = np.empty(len(view), dtype=np.int64)
    slots[order] = ends - length[order] - starts_of_view[view[order]]
    return slots


def zigzag_runs(cu_seqlens: np.ndarray, layout: Layout2D, padded_lengths: np.ndarray | None = None) -> Runs:
    """Runs of the zigzag views: every document cut into 2*CP chunks (padded to a multiple of 2*CP)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    CP, hp = layout.cp_size, layout.head_parallel_size
    if CP == 1 and padded_lengths is None:  # one rank holds every document whole, unpadded (Megatron's CP=1)
        zeros = np.zeros(len(lengths), dtype=np.int64)
        return Runs(zeros, cu[:-1], lengths, np.arange(len(lengths)), zeros)
    padded = -(-lengths // (2 * CP)) * (2 * CP) if padded_lengths is None else np.asarray(padded_lengths, np.int64)
    chunk = padded // (2 * CP)
    groups = _zigzag_groups(layout)
    doc, group, pos, length = groups.pieces(lengths, chunk)
    view = groups.view[group]
    if hp == 1:  # the rank's slots: [chunk i | chunk 2CP-1-i] per document
        slot = (np.cumsum(2 * chunk) - 2 * chunk)[doc] + groups.half[group] * chunk[doc]
    else:  # sorted by stream index: (document, position) order
        slot = _sorted_slots(view, length, layout.context_size)
    return Runs(view, slot, length, doc, pos)


def zigzag_view_len(cu_seqlens: np.ndarray, layout: Layout2D, padded_lengths: np.ndarray | None = None) -> int:
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    CP = layout.cp_size
    if CP == 1 and padded_lengths is None:
        return int(lengths.sum())
    padded = -(-lengths // (2 * CP)) * (2 * CP) if padded_lengths is None else np.asarray(padded_lengths, np.int64)
    return int(padded.sum()) // CP * layout.head_parallel_size


def documents_runs(cu_seqlens: np.ndarray, long_docs: np.ndarray, owner: np.ndarray, cp: int) -> Runs:
    """Runs of the documents views: long documents zigzag over the cp context ranks (2*cp chunks) in the view's
    prefix, each whole document on its owner after the prefix (ascending document id)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    D = len(lengths)
    long_len = lengths[long_docs]
    chunk = -(-long_len // (2 * cp))  # padded / (2 cp)
    view_of_chunk, half_of_chunk = zigzag_chunk_holders(np.arange(2 * cp), cp)
    groups = ChunkGroups(view_of_chunk, half_of_chunk)
    j, group, pos_l, len_l = groups.pieces(long_len, chunk)
    slot_l = (np.cumsum(2 * chunk) - 2 * chunk)[j] + groups.half[group] * chunk[j]
    whole = np.flatnonzero(owner >= 0)
    prefix = int(2 * chunk.sum())
    slot_w = prefix + _sorted_slots(owner[whole], lengths[whole], cp)
    # interleave the two kinds in (document, position) order: a long document's pieces, or one whole piece
    count = np.ones(D, dtype=np.int64)
    count[long_docs] = np.bincount(j, minlength=len(long_docs))
    first = np.cumsum(count) - count
    n = int(count.sum())
    view, slot, length, doc, pos = (np.empty(n, dtype=np.int64) for _ in range(5))
    at_l = first[long_docs][j] + (np.arange(len(j)) - (np.cumsum(count[long_docs]) - count[long_docs])[j])
    view[at_l], slot[at_l], length[at_l], doc[at_l], pos[at_l] = groups.view[group], slot_l, len_l, long_docs[j], pos_l
    at_w = first[whole]
    view[at_w], slot[at_w], length[at_w], doc[at_w], pos[at_w] = owner[whole], slot_w, lengths[whole], whole, 0
    return Runs(view, slot, length, doc, pos)


def sequence_runs(cu_seqlens: np.ndarray, layout: Layout2D) -> Runs:
    """Runs of the per-sequence zigzag views: the stream of T tokens cut into 2*CP chunks of K = T / 2CP (T must
    be divisible by 2*CP), each view its 2*hp chunks in ascending order; documents cut the chunk groups into
    runs."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    T, CP = int(cu[-1]), layout.cp_size
    K = T // (2 * CP)
    groups = _zigzag_groups(layout)
    chunk_rank = sequence_chunk_ranks(layout)  # [2CP] place of each chunk in its view
    bounds = np.union1d(cu, groups.first * K)  # T is in cu
    start = bounds[:-1]
    doc = np.searchsorted(cu, start, side="right") - 1
    c = start // K
    return Runs(
        groups.view[np.searchsorted(groups.first, c, side="right") - 1],
        chunk_rank[c] * K + start - c * K,
        np.diff(bounds),
        doc,
        start - cu[doc],
    )


def sequence_chunk_ranks(layout: Layout2D) -> np.ndarray:
    """[2CP]: the place of each zigzag chunk among its context rank's 2*hp chunks in ascending order."""
    CP = layout.cp_size
    chunks = np.arange(2 * CP)
    index, _ = zigzag_chunk_holders(chunks, CP)
    view = context_rank_of(layout, index)
    order = np.lexsort((chunks, view))  # by view, then ascending chunk
    ranks = np.empty(2 * CP, dtype=np.int64)
    ranks[order] = np.arange(2 * CP) % (2 * layout.head_parallel_size)
    return ranks


def materialise(runs: Runs, cu_seqlens: np.ndarray, views: int, view_len: int) -> np.ndarray:
    """[views, view_len] slots from the runs (stream index; -1 where no run lies: padding)."""
    out = np.full((views, view_len), -1, dtype=np.int64)
    stream = np.asarray(cu_seqlens, dtype=np.int64)[runs.doc] + runs.pos
    out[np.repeat(runs.view, runs.length), ranges(runs.start, runs.length)] = ranges(stream, runs.length)
    return out
