"""Packed documents (THD) in the planner: what a length distribution does to one layout's attention.

For a packed batch of documents with lengths L_j (sum = S, the job's sequence length) the op computes attention
within each document only. Per layout (hp, cp) and packed mode the planner takes, from the op's own placement
(:mod:`megatron_2d.document_placement`, numpy only):

    flops_fraction   max over context ranks of the causal (query, key) pairs its view holds, divided by
                     pairs(S) / cp (what each rank computes for one unmasked causal sequence); scales the attention
                     FLOPs. One document: exactly 1 (zigzag is balanced). Short documents: far below 1.
    ring_fraction    the ring prefix a context rank sends per step, in tokens, divided by S / cp: zigzag sends its
                     whole view (every document padded to 2*CP), the documents mode only the long documents'
                     chunks (0: no ring at all, the op runs one local block)
    token_fraction   slots per rank (real + padding) / (S / CP): the linear layers and the all-to-all scale with it
    useful_fraction  sum_j pairs(L_j) / (S^2 / 2): the model FLOPs that count for MFU

Modes: "zigzag" (Megatron / Transformer Engine THD: what every stock kind runs, and our zigzag mode) and
"documents" (ours only: short documents whole on one context rank). Stock Transformer Engine p2p and a2a+p2p are
modelled as THD zigzag with every document padded to a multiple of 2*CP (a2a+p2p with THD is not in a TE
release: a row says so); a2a and DeepSpeed-Ulysses have no ring (their fraction is the padded pairs over hp = CP).
Memory is modelled as for one unpacked sequence of S tokens (padding adds at most token_fraction - 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..document_placement import pairs, place_documents
from ..packed_views import zigzag_runs, zigzag_view_len
from ..topology import Layout2D

PACKED_MODES = ("zigzag", "documents")


@dataclass(frozen=True)
class PackedWork:
    """What a packed batch does to one layout's attention (see the module docstring)."""

    mode: str
    flops_fraction: float
    ring_fraction: float
    token_fraction: float
    useful_fraction: float
    ring_tokens: int
    """Tokens of the ring prefix a context rank sends per step (per sequence)."""
    padding_tokens: int
    """Padding slots over the whole CP group."""
    pair_imbalance: float
    """max / mean - 1 of attention pairs over the context ranks."""
    long_documents: int
    """Documents sharded over the context ranks (all of them in zigzag)."""


def modes_for(kind: str) -> Tuple[str, ...]:
    """The packed modes a kind can run: ours both, stock kinds Megatron's THD zigzag."""
    return PACKED_MODES if kind == "2d" else ("zigzag",)


@functools.lru_cache(maxsize=256)
def _packed_work(lengths: Tuple[int, ...], hp: int, cp: int, placement: str, mode: str) -> PackedWork:
    cu = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    S = int(cu[-1])
    CP = hp * cp
    layout = Layout2D(CP, hp, 1, placement)
    if mode == "zigzag":
        runs = zigzag_runs(cu, layout)
        ring_tokens = zigzag_view_len(cu, layout)
        t_local = ring_tokens // hp
        long_docs = len(lengths)
    elif mode == "documents":
        placement_ = place_documents(cu, cp, hp)
        runs = placement_.runs
        ring_tokens = int(placement_.long_prefix) if cp > 1 else 0
        t_local = placement_.view_len // hp
        long_docs = int(len(placement_.long_docs))
    else:
        raise ValueError(f"packed mode {mode!r} is not one of {PACKED_MODES}")
    padding = t_local * CP - S
    p = runs.pairs_per_view(cp).astype(np.float64)
    base = float(pairs([S])[0]) / cp
    return PackedWork(mode=mode, flops_fraction=float(p.max()) / base,
                      ring_fraction=(ring_tokens / (S / cp)) if cp > 1 else 0.0,
                      token_fraction=t_local / (S / CP),
                      useful_fraction=float(pairs(np.asarray(lengths)).sum()) / (S * S / 2.0),
                      ring_tokens=ring_tokens if cp > 1 else 0, padding_tokens=padding,
                      pair_imbalance=float(p.max() / p.mean() - 1.0) if p.mean() > 0 else 0.0,
                      long_documents=long_docs)


def packed_work(lengths, hp: int, cp: int, placement: str, mode: str) -> PackedWork:
    """The :class:`PackedWork` of documents of ``lengths`` for the 2D layout (hp, cp) in ``mode`` (cached)."""
    return _packed_work(tuple(int(x) for x in lengths), int(hp), int(cp), str(placement), str(mode))
