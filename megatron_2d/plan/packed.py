"""Packed documents (THD) in the planner: what a length distribution does to one layout's attention.

For a packed batch of documents with lengths L_j (sum = S, the job's sequence length) the op computes attention
within each document only (and within a causal sliding window of ``left`` tokens, if any). Per layout (hp, cp)
and packed mode the planner takes, from the op's own document sharding and views (:mod:`megatron_2d.packing.sharding`,
:mod:`megatron_2d.packing.views`, numpy only):

    flops_fraction   max over context ranks of the (query, key) pairs its view computes (within documents and
                     the window), divided by pairs(S) / cp (what each rank computes for one unmasked causal
                     sequence); scales the attention FLOPs. One document, no window: exactly 1 (zigzag is
                     balanced). Short documents: far below 1.
    ring_fraction    the ring prefix a context rank sends per step, in tokens, divided by S / cp: zigzag sends its
                     whole view (every document padded to 2*CP), the documents mode only the long documents'
                     chunks (0: no ring at all, the op runs one local block)
    dense            whether every context rank sees keys of every other; if not, the op uses the neighbour
                     exchange (:meth:`megatron_2d.PackedSharding.neighbour_keys`): ``messages`` and ``key_tokens``
                     are the busiest rank's K/V messages and key tokens per pass, exactly the keys the calls read
    token_fraction   slots per rank (real + padding) / (S / CP): the linear layers, the all-to-all and the
                     activation memory scale with it
    useful_fraction  sum_j visible pairs(L_j) / (S^2 / 2): the model FLOPs that count for MFU

Modes (:mod:`megatron_2d.packing.modes`, those ``planned``): "zigzag" (Megatron / Transformer Engine THD: what every
stock kind runs, the ``stock`` mode, and our zigzag mode) and "documents" (ours only: short documents whole on one
context rank; which ones is chosen by predicted step time with the job's own figures, :func:`packing_cost`). Each
mode lays the batch out as the op does, and the work is read off its runs. Stock Transformer Engine p2p and a2a+p2p are
modelled as THD zigzag with every document padded to a multiple of 2*CP (a2a+p2p with THD is not in a TE
release: a row says so); a2a and DeepSpeed-Ulysses have no ring (their fraction is the padded pairs over hp = CP).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ..layout.band import Band
from ..layout.choices import Placement, PlanKind
from ..layout.topology import Layout2D
from ..packing.calls import Runs, key_intervals
from ..packing.modes import mode_class, mode_names
from ..packing.sharding import PackingCost, pairs
from .kernel_rates import SELECTED_KERNEL


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
    window: int | None = None
    """The causal sliding window (tokens back) this work is for; None: none."""
    dense: bool = True
    """Every context rank sees keys of every other (the op runs the ring); else the neighbour exchange."""
    messages: int = 0
    """Neighbour exchange: K/V messages the busiest rank sends per pass (0 when dense)."""
    key_tokens: int = 0
    """Neighbour exchange: key tokens the busiest rank sends per pass, over its messages (per sequence)."""


def modes_for(kind: str) -> tuple[str, ...]:
    """The packed modes the planner models for a kind: 2D every ``planned`` mode (zigzag and documents), stock
    kinds the ``stock`` one (Megatron's THD zigzag)."""
    stock = kind != PlanKind.TWO_D
    return tuple(name for name in mode_names() if (mode_class(name).stock if stock else mode_class(name).planned))


def window_pairs(position: np.ndarray, left: int | None) -> np.ndarray:
    """Visible pairs of the first ``position`` tokens of a document (each query t sees min(t, left) + 1 keys)."""
    t = np.asarray(position, dtype=np.int64)
    if left is None:
        return t * (t + 1) // 2
    head = np.minimum(t, left + 1)
    return head * (head + 1) // 2 + np.maximum(t - left - 1, 0) * (left + 1)


def _run_pairs(runs: Runs, views: int, left: int | None) -> np.ndarray:
    """[views] visible pairs each view computes: a run of tokens pos .. pos + n - 1 holds f(pos + n) - f(pos)."""
    pairs_ = window_pairs(runs.pos + runs.length, left) - window_pairs(runs.pos, left)
    return np.bincount(runs.view, weights=pairs_, minlength=views)


def _exchange(runs: Runs, cp: int, left: int | None) -> tuple[bool, int, int]:
    """(dense, messages, key tokens) of the op's choice: the ring unless some pair of context ranks sees nothing
    of each other (the same rule and budget as PackedSharding.neighbour_keys); then the busiest sender's messages."""
    if cp == 1:
        return True, 0, 0
    found = key_intervals(runs, Band(None if left is None else -left, 0))
    if found is None:
        return True, 0, 0
    cross = found[found[:, 0] != found[:, 1]]
    if len(np.unique(cross[:, 0] * cp + cross[:, 1])) == cp * (cp - 1):
        return True, 0, 0
    sent = np.bincount(cross[:, 1], weights=cross[:, 3] - cross[:, 2], minlength=cp)
    busiest = int(sent.argmax())
    return False, len(np.unique(cross[cross[:, 1] == busiest, 0])), int(sent[busiest])


def packing_cost(model, cluster, tp: int, hp: int, cp: int, placement: str, kernel: str | None = None) -> PackingCost:
    """The documents mode's cost model for this job and layout from the planner's figures: attention at
    ``kernel``'s efficiency (None: 2D's selection on the cluster) on a context rank's heads, the ring on NVLink
    when the context group fits in a node (head_first spreads it over hp * cp * TP consecutive GPUs, context_first
    over cp * TP), else on one NIC, its step latency, transfers overlapped; a token costs the layer's linear
    layers on it (6 * layer weights / TP FLOPs at the dense efficiency), so padding and token imbalance are priced
    too."""
    span = (hp * cp if placement == Placement.HEAD_FIRST else cp) * tp
    link = cluster.nvlink_gbps if span <= cluster.gpus_per_node else cluster.nic_gbps
    heads, kv_heads = max(model.heads // tp // hp, 1), max(model.kv_heads // tp // hp, 1)
    cost = PackingCost.from_hardware(
        cluster.peak_tflops * cluster.kernel_efficiency(SELECTED_KERNEL[cluster.arch] if kernel is None else kernel),
        link,
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=model.head_dim,
        step_us=cluster.step_latency_us,
    )
    # a view of hp * t_local slots is t_local tokens on each of its hp ranks: per view slot, 1 / hp of a token
    token_s = 6.0 * model.layer_params() / tp / hp / (cluster.peak_tflops * 1e12 * cluster.dense_efficiency)
    return dataclasses.replace(cost, token_s=token_s)


@functools.lru_cache(maxsize=256)
def _packed_work(
    lengths: tuple[int, ...], hp: int, cp: int, placement: str, mode: str, left: int | None, cost: PackingCost | None
) -> PackedWork:
    cu = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    S = int(cu[-1])
    CP = hp * cp
    layout = Layout2D(CP, hp, 1, placement)
    if left is not None and left >= S - 1:
        left = None
    if mode not in modes_for(PlanKind.TWO_D):
        raise ValueError(f"packed mode {mode!r} is not one of {modes_for(PlanKind.TWO_D)}")
    batch = mode_class(mode)(cu, layout, cost=cost)
    runs, ring_tokens, t_local = batch.runs, batch.ring_tokens, batch.view_len // hp
    padding = t_local * CP - S
    p = _run_pairs(runs, cp, left)
    base = float(pairs([S])[0]) / cp
    dense, messages, key_tokens = _exchange(runs, cp, left) if ring_tokens else (True, 0, 0)
    return PackedWork(
        mode=mode,
        flops_fraction=float(p.max()) / base,
        ring_fraction=(ring_tokens / (S / cp)) if cp > 1 else 0.0,
        token_fraction=t_local / (S / CP),
        useful_fraction=float(window_pairs(np.diff(cu), left).sum()) / (S * S / 2.0),
        ring_tokens=ring_tokens if cp > 1 else 0,
        padding_tokens=padding,
        pair_imbalance=float(p.max() / p.mean() - 1.0) if p.mean() > 0 else 0.0,
        long_documents=batch.long_documents,
        window=left,
        dense=dense,
        messages=messages,
        key_tokens=key_tokens,
    )


def packed_work(
    lengths, hp: int, cp: int, placement: str, mode: str, window: int | None = None, cost: PackingCost | None = None
) -> PackedWork:
    """The :class:`PackedWork` of documents of ``lengths`` for the 2D layout (hp, cp) in ``mode`` under a causal
    sliding window of ``window`` tokens back (None: none), the documents mode placed by ``cost`` (see
    :func:`packing_cost`; None: the op's default), cached."""
    return _packed_work(
        tuple(int(x) for x in lengths),
        int(hp),
        int(cp),
        str(placement),
        str(mode),
        None if window is None else int(window),
        cost,
    )
