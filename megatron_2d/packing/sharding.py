"""Document sharding: where each token of a packed batch goes, Megatron's per-document or per-sequence zigzag, or
whole short documents. (Placement, head_first or context_first, is the rank order of
:mod:`megatron_2d.layout.topology`.)

Pure numpy, no torch: the op's :class:`megatron_2d.PackedSharding` and the planner use the same sharding.

Notation
    D documents of lengths L_j (``cu_seqlens``: cumulative, from 0), T = sum L_j real tokens
    CP = hp * cp ranks; a CP rank's "slots" are the t_local tokens it holds; a context rank's "view" is what it
    holds after the head all-to-all: the slots of its hp head ranks, concatenated by head rank (hp * t_local)
    slot value: the token's index in the packed stream (0 .. T-1), or -1 for padding
    pairs(L) = L (L + 1) / 2, the (query, key) pairs of causal attention over L tokens (the FLOP unit)

Zigzag (Megatron / Transformer Engine THD): every document is padded to a multiple of 2*CP and cut into 2*CP
chunks; CP rank i holds chunks i and 2*CP-1-i of every document, document by document (what megatron-core's
``get_batch_on_this_cp_rank`` gets from TE's ``thd_get_partitioned_indices``).

    >>> zigzag_slots(np.array([0, 3, 7]), cp_size=2)   # lengths 3 and 4: chunks of 1 token, -1 pads doc 0
    array([[ 0, -1,  3,  6],
           [ 1,  2,  4,  5]])

Documents (:func:`shard_documents`): long documents are zigzag-sharded over the cp context ranks (2*cp chunks;
the hp ranks of a head group split heads, not documents); every other document stays whole on one context rank,
so its attention is local and the ring carries only long-document K/V. Each view is [long chunks | whole
documents | padding] and is cut into hp equal slices, one per head rank, so after the all-to-all the long tokens
are a prefix of the view: the ring sends that prefix only.

Sequence (Megatron's ``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``, what
``--dataloader-inter-document-masking`` runs): the whole packed stream of T tokens (T divisible by 2*CP) is cut into
2*CP chunks regardless of documents; CP rank i holds chunks i and 2*CP-1-i; documents are only masked.

    >>> sequence_rows(8, cp_size=2, ranks=[0, 1])
    array([[0, 1, 6, 7],
           [2, 3, 4, 5]])
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..layout.costs import H100

if TYPE_CHECKING:
    from .calls import Runs


def pairs(lengths) -> np.ndarray:
    """Causal (query, key) pairs of documents of these lengths: L (L + 1) / 2 each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths * (lengths + 1) // 2


def row_pairs(rows: np.ndarray, cu_seqlens) -> np.ndarray:
    """[n] causal (query, key) pairs of each row of slots (views or a rank's slots): a real token at position p of
    its document sees p + 1 keys."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.int64))
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    real = rows >= 0
    seen = rows - cu[np.searchsorted(cu, np.maximum(rows, 0), side="right") - 1] + 1
    return np.where(real, seen, 0).sum(axis=1)


def zigzag_rows(cu_seqlens, cp_size: int, ranks, padded_lengths: np.ndarray | None = None) -> np.ndarray:
    """[len(ranks), t_local] slots of CP ranks ``ranks`` under Megatron's THD zigzag (see :func:`zigzag_slots`),
    computed for those ranks only: column j is the same (document, chunk half, offset) on every rank, only the
    chunk differs, so a row is one affine map of the columns."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    ranks = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
    padded = round_up(lengths, 2 * cp_size) if padded_lengths is None else np.asarray(padded_lengths, np.int64)
    chunk = padded // (2 * cp_size)
    doc = np.repeat(np.arange(len(lengths)), 2 * chunk)  # [t_local] document of column j
    offset = np.arange(len(doc)) - np.repeat(np.cumsum(2 * chunk) - 2 * chunk, 2 * chunk)
    c = chunk[doc]
    first = offset < c
    # position in the document on rank i: first half (chunk i) = i*c + o; second (chunk 2CP-1-i) = (2CP-1-i)*c + o-c
    base = np.where(first, offset, (2 * cp_size - 1) * c + offset - c)
    step = np.where(first, c, -c)
    pos = base[None, :] + ranks[:, None] * step[None, :]
    return np.where(pos < lengths[doc][None, :], cu[:-1][doc][None, :] + pos, -1)


def zigzag_slots(cu_seqlens: np.ndarray, cp_size: int, padded_lengths: np.ndarray | None = None) -> np.ndarray:
    """[CP, t_local] slots of Megatron's THD zigzag: CP rank i holds chunks i and 2*CP-1-i of every document.

    ``padded_lengths`` (Megatron's ``cu_seqlens_padded`` differences): each a multiple of 2*CP and at least the
    real length; default: each real length rounded up to a multiple of 2*CP (no padding at all when CP = 1: the
    one rank holds every document whole, as Megatron's CP=1 batches are)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cp_size == 1 and padded_lengths is None:
        return np.arange(cu[-1], dtype=np.int64)[None]
    return zigzag_rows(cu, cp_size, np.arange(cp_size), padded_lengths)


def sequence_rows(total_tokens: int, cp_size: int, ranks) -> np.ndarray:
    """[len(ranks), T / CP] slots of CP ranks ``ranks`` under the per-sequence zigzag (no padding)."""
    K = total_tokens // (2 * cp_size)
    idx = np.atleast_1d(np.asarray(ranks, dtype=np.int64))[:, None]
    return np.concatenate([idx * K + np.arange(K), (2 * cp_size - 1 - idx) * K + np.arange(K)], axis=1)


def round_up(x, multiple: int):
    return -(-np.asarray(x, dtype=np.int64) // multiple) * multiple


@dataclass(frozen=True)
class DocumentSharding:
    """The documents layout of one batch over the cp context ranks (see the module docstring)."""

    cu_seqlens: np.ndarray  # [D + 1] the batch's cumulative lengths
    cp: int  # context ranks
    long_docs: np.ndarray  # ids of the zigzag-sharded documents, ascending
    owner: np.ndarray  # [D] context rank holding each whole document, -1 for long ones
    long_prefix: int  # view slots [0, long_prefix) hold long-document chunks (identical on all)
    view_len: int  # slots of every view (the longest, rounded up to a multiple of 2*hp)
    threshold: int  # the longest whole document (longer ones are sharded)
    pair_imbalance: float  # max / mean - 1 of attention pairs per context rank
    token_imbalance: float  # max / mean - 1 of real tokens per context rank
    predicted_s: float = 0.0  # the step the cost model predicts for this sharding

    @functools.cached_property
    def runs(self) -> Runs:
        """The runs of every view (:mod:`megatron_2d.packing.views`)."""
        from .views import documents_runs

        return documents_runs(self.cu_seqlens, self.long_docs, self.owner, self.cp)

    @functools.cached_property
    def views(self) -> np.ndarray:
        """[cp, view_len] slots of each context rank's view (materialised on first use)."""
        from .views import materialise

        return materialise(self.runs, self.cu_seqlens, self.cp, self.view_len)

    @property
    def padding_fraction(self) -> float:
        slots = self.cp * self.view_len
        return 1.0 - float(self.cu_seqlens[-1]) / slots if slots else 0.0


def _greedy(lengths: np.ndarray, short: np.ndarray, cp: int, base_pairs: float, base_tokens: float):
    """Assign whole documents (ids ``short``) to cp context ranks: largest first, each on the rank where the
    larger of its normalised loads (pairs / mean pairs, tokens / mean tokens) ends lowest; ties to the lowest
    rank. Beyond 32 ranks, for speed, on the rank whose larger normalised load is lowest before it (a heap).
    Returns (ids in assignment order, owner of each, pairs per rank, tokens per rank)."""
    order = short[np.lexsort((short, -lengths[short]))]  # longest first, then by id
    p = pairs(lengths[order]).astype(np.float64)
    n = lengths[order].astype(np.float64)
    mean_p = (cp * base_pairs + p.sum()) / cp or 1.0
    mean_t = (cp * base_tokens + n.sum()) / cp or 1.0
    owner = np.empty(len(order), dtype=np.int64)
    if cp <= 32:  # plain Python beats numpy's per-call overhead on a few ranks
        load_p, load_t = [base_pairs / mean_p] * cp, [base_tokens / mean_t] * cp
        ranks = range(cp)
        for i, (x, y) in enumerate(zip((p / mean_p).tolist(), (n / mean_t).tolist())):
            rank = min(ranks, key=lambda r: max(load_p[r] + x, load_t[r] + y))
            owner[i] = rank
            load_p[rank] += x
            load_t[rank] += y
        return order, owner, np.array(load_p) * mean_p, np.array(load_t) * mean_t
    # many ranks: a heap on each rank's larger normalised load (the least loaded rank takes the document)
    load_p, load_t = [base_pairs / mean_p] * cp, [base_tokens / mean_t] * cp
    heap = [(max(load_p[r], load_t[r]), r) for r in range(cp)]
    heapq.heapify(heap)
    for i, (x, y) in enumerate(zip((p / mean_p).tolist(), (n / mean_t).tolist())):
        _, rank = heapq.heappop(heap)
        owner[i] = rank
        load_p[rank] += x
        load_t[rank] += y
        heapq.heappush(heap, (max(load_p[rank], load_t[rank]), rank))
    return order, owner, np.array(load_p) * mean_p, np.array(load_t) * mean_t


def _imbalance(load: np.ndarray) -> float:
    mean = load.mean()
    return float(load.max() / mean - 1.0) if mean > 0 else 0.0


@dataclass(frozen=True)
class PackingCost:
    """Seconds one forward + backward of a documents layout takes, term by term, per unit (the model that chooses
    which documents to shard, :func:`shard_documents`):

        step = pair_s * (pairs of the busiest context rank) + call_s * (its kernel calls) + token_s * (slots per
               view: padding and token imbalance) + ring,
        ring = (cp - 1) * max(0, ring_step_s + ring_token_s * prefix - overlap * pair_s * long pairs / cp)

    where prefix is the ring prefix (the long documents' tokens per context rank) and a ring step's transfer hides
    behind that step's compute on the long documents when ``overlap`` is 1 (a GPU ring), not at all when 0 (gloo
    on CPU, whose copies take the same cores). :meth:`from_hardware` derives it from a device's attention rate and
    link bandwidth (the planner's figures by default); a benchmark can measure it (tools/bench_packed.py)."""

    pair_s: float
    """Forward + backward of one visible (query, key) pair (all heads of a context rank)."""
    ring_token_s: float
    """One ring step's share of one prefix token: its K/V forward, its K/V and dK/dV backward."""
    call_s: float = 0.0
    """Fixed cost of one kernel call, forward + backward (launch, slicing, the merge of its output)."""
    ring_step_s: float = 0.0
    """Fixed cost of one ring step, forward + backward (latency)."""
    token_s: float = 0.0
    """Everything per slot of a view (hp * t_local slots) beyond attention (linear layers, all-to-all), forward +
    backward: what padding and token imbalance cost. 0 by default (the op alone does not know the model)."""
    overlap: float = 1.0

    def predict(self, max_pairs, calls, slots, cp: int, prefix, long_pairs):
        """The step time (arrays broadcast: one estimate per candidate)."""
        compute = self.pair_s * max_pairs + self.call_s * calls + self.token_s * slots
        if cp == 1:
            return compute
        per_step = self.ring_step_s + self.ring_token_s * prefix - self.overlap * self.pair_s * long_pairs / cp
        return compute + np.where(np.asarray(prefix) > 0, (cp - 1) * np.maximum(per_step, 0.0), 0.0)

    @classmethod
    def from_hardware(
        cls,
        attention_tflops: float,
        link_gbps: float,
        q_heads: int = 1,
        kv_heads: int = 1,
        head_dim: int = 128,
        elt: int = 2,
        dkv_elt: int = 4,
        call_us: float = 5.0,
        step_us: float = 10.0,
        overlap: float = 1.0,
    ) -> PackingCost:
        """From an attention rate (TFLOP/s reached) and the ring's link bandwidth (GB/s per direction): a pair is
        4 * d FLOPs per query head forward and 2.5 times that backward; a prefix token moves K and V (``elt``
        bytes) forward, again backward with its dK/dV (``dkv_elt``, fp32 riders by default)."""
        return cls(
            pair_s=3.5 * 4 * q_heads * head_dim / (attention_tflops * 1e12),
            ring_token_s=2 * kv_heads * head_dim * (2 * elt + dkv_elt) / (link_gbps * 1e9),
            call_s=call_us * 1e-6,
            ring_step_s=step_us * 1e-6,
            overlap=overlap,
        )


def default_cost() -> PackingCost:
    """The H100 figures of :mod:`megatron_2d.layout.costs` (the planner's 8xH100 preset: attention at its
    modelled efficiency, the ring on NVLink), MHA bf16, head dim 128: what :func:`shard_documents` assumes without a
    cost (pass ``PackedSharding(..., cost=)`` for a cluster's own, e.g. its inter-node links, or a measured one)."""
    return PackingCost.from_hardware(H100.peak_tflops * H100.attn_efficiency, H100.nvlink_gbps)


def _screen(lengths: np.ndarray, by_length: np.ndarray, cp: int, cost: PackingCost) -> np.ndarray:
    """[D + 1] the predicted step with the k longest documents sharded, k = 0..D, without assigning anything: the
    busiest rank holds its share of the sharded pairs plus at least the longest whole document (the greedy
    assignment comes close to that bound or to the mean), its slots the prefix and that document or the mean."""
    desc = lengths[by_length].astype(np.float64)
    D, total = len(desc), float(desc.sum())
    cum = np.concatenate(([0.0], np.cumsum(desc)))
    cum_p = np.concatenate(([0.0], np.cumsum(pairs(desc.astype(np.int64)).astype(np.float64))))
    cum_pad = np.concatenate(([0.0], np.cumsum(round_up(desc.astype(np.int64), 2 * cp).astype(np.float64))))
    longest_whole = np.concatenate((desc, [0.0]))  # the (k+1)-th longest stays whole
    k = np.arange(D + 1)
    long_pairs, prefix = cum_p / cp, cum_pad / cp
    max_pairs = np.maximum(cum_p[-1] / cp, long_pairs + pairs(longest_whole.astype(np.int64)))
    slots = prefix + np.maximum((total - cum) / cp, longest_whole)
    calls = (D - k) / cp + 2.0 * k * cp
    return cost.predict(max_pairs, calls, slots, cp, prefix, long_pairs)


def shard_documents(
    cu_seqlens, cp: int, hp: int, long_threshold: int | None = None, cost: PackingCost | None = None
) -> DocumentSharding:
    """The documents layout: whole short documents balanced over cp context ranks, long ones zigzag-sharded.

    Which documents to shard is chosen by predicted step time (:class:`PackingCost`, :func:`default_cost` when
    None): a whole document's K/V never travel and it needs no padding, but it lands on one context rank, which may
    then compute more than the others; a sharded one is balanced exactly (zigzag over 2*cp chunks) but rides the
    ring with its padding. The k longest documents are sharded (those longer than T / cp always: whole, one would
    give its rank more slots than every rank's fair share, and all ranks hold as many slots as the fullest, which
    the attention's cost alone does not see), k the one whose sharding predicts the shortest step: every k is
    screened with a bound on the busiest rank (O(D)), then the best few are assigned (:func:`_greedy`, balancing
    pairs and tokens) and predicted from their real loads. Balance
    is a consequence, not the rule. ``long_threshold`` overrides the choice: documents longer than it are sharded.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    D = len(lengths)
    by_length = np.lexsort((np.arange(D), -lengths))  # longest first
    cost = default_cost() if cost is None else cost

    def attempt(k: int):
        long_ids, short_ids = np.sort(by_length[:k]), by_length[k:]
        padded = round_up(lengths[long_ids], 2 * cp)
        base_p = pairs(lengths[long_ids]).sum() / cp
        base_t = padded.sum() / cp
        order, owner, load_p, load_t = _greedy(lengths, short_ids, cp, base_p, base_t)
        whole_tokens = load_t - base_t
        slots = base_t + whole_tokens.max(initial=0.0)
        step = float(cost.predict(load_p.max(initial=0.0), (D - k) / cp + 2.0 * k * cp, slots, cp, base_t, base_p))
        return long_ids, order, owner, _imbalance(load_p), _imbalance(load_t), step

    if long_threshold is not None:
        chosen = attempt(int((lengths > long_threshold).sum()))
    elif cp == 1:
        chosen = attempt(0)
    else:
        lo = int((lengths > cu[-1] / cp).sum())  # these can never stay whole
        screened = _screen(lengths, by_length, cp, cost)
        best = lo + int(np.argmin(screened[lo:]))
        trials = [attempt(k) for k in sorted({max(lo, best - 1), best, min(D, best + 1)})]
        chosen = min(trials, key=lambda trial: trial[5])
    long_ids, order, owner_of_order, pair_imb, tok_imb, predicted = chosen
    k = long_ids.size
    threshold = int(lengths[by_length[k]]) if k < D else 0  # the longest whole document

    owner = np.full(D, -1, dtype=np.int64)
    owner[order] = owner_of_order
    long_prefix = int(round_up(lengths[long_ids], 2 * cp).sum() // cp)
    whole = np.bincount(owner[owner >= 0], weights=lengths[owner >= 0], minlength=cp)
    view_len = int(round_up(long_prefix + int(whole.max(initial=0)), 2 * hp))  # even t_local (see RoPE)
    return DocumentSharding(
        cu_seqlens=cu,
        cp=cp,
        long_docs=long_ids,
        owner=owner,
        long_prefix=long_prefix,
        view_len=view_len,
        threshold=threshold,
        pair_imbalance=pair_imb,
        token_imbalance=tok_imb,
        predicted_s=predicted,
    )


def documents_slots(sharding: DocumentSharding, layout) -> np.ndarray:
    """[CP, t_local] slots of each CP rank: head rank hr of context rank cr holds slice hr of cr's view
    (``layout``: a :class:`megatron_2d.layout.topology.Layout2D`)."""
    hp, cp = layout.head_parallel_size, layout.context_size
    views = sharding.views
    slots = np.empty((layout.cp_size, views.shape[1] // hp), dtype=np.int64)
    slots[_index_grid(layout)] = views.reshape(cp, hp, -1)
    return slots


def _index_grid(layout) -> np.ndarray:
    """[cp, hp]: the CP index of (context rank, head rank)."""
    cr, hr = np.meshgrid(np.arange(layout.context_size), np.arange(layout.head_parallel_size), indexing="ij")
    return layout.index_of(hr, cr)
