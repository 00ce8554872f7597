"""One layout's estimate: the attention of one layer (forward + backward, its all-to-alls and ring or neighbour
exchange), the whole model's step with recompute, MFU and tokens per second, and the memory it needs; several
layer kinds combined into one estimate.

Notation: :mod:`.attention_time`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..layout.choices import MLA_RINGS, MlaRing, RecomputeMode, TransportKind
from .attention_time import (
    BF16,
    BWD_FACTOR,
    GB,
    MAX_LOGIT_REDUCTIONS,
    RIDER_BYTES,
    LayerWork,
    Traffic,
    head_exchange_time,
    layer_work,
    max_logit_pass_s,
    neighbour_times,
    ring_times,
    traffic,
)
from .candidates import kind_dkv_comm_dtype, kind_kv_heads
from .kernel_rates import LAUNCH_MAX_LOGIT, side_kernel
from .link_classes import LinkMap, link_map
from .memory import LAYER_RECOMPUTE_MODES, RECOMPUTE_MODES, MemoryBreakdown, memory_breakdown
from .windows import WindowWork, packed_window_work, window_work

if TYPE_CHECKING:
    from .candidates import Scheme
    from .job import Job
    from .model_states import ShardingCost
    from .packed import PackedWork


@dataclass(frozen=True)
class Estimate:
    """Predicted per-layer attention time (forward + backward, one rank) and its parts, in seconds and bytes."""

    time_s: float
    """a2a_fwd + ring_fwd + a2a_bwd + ring_bwd: the attention of one layer, forward and backward."""
    compute_s: float
    """Attention work that is not communication: cp * (Tc + Tcb), i.e. the kernels (3.5 * fwd_flops / (P*e_a))
    plus each ring step's merge/accumulate traffic and fixed latency."""
    kernel_s: float
    """The attention kernels alone: 3.5 * fwd_flops / (P * e_a)."""
    a2a_s: float
    """Both directions' all-to-alls (never overlapped), including their permutes and latency."""
    ring_exposed_s: float
    """Ring communication not hidden behind compute."""
    comm_total_s: float
    """All communication as if serialised (a2a + every ring transfer): the comm/compute ratio's numerator."""
    intra_bytes: float
    """Bytes this rank sends over NVLink per layer (forward + backward)."""
    inter_bytes: float
    """Bytes this rank sends over the network per layer (forward + backward)."""
    inter_bytes_nic: float
    """``inter_bytes`` scaled by max(flows, NICs)/NICs: bytes one NIC's worth of bandwidth must carry (calibration)."""
    memory_gb: float
    """Estimated peak memory per GPU under ``recompute`` (see :class:`.memory.MemoryBreakdown`)."""
    activation_gb: float
    """The activation part of ``memory_gb``."""
    step_s: float
    """Whole model, one micro-batch, as if one GPU did the work of its TP x CP group for all layers (bubbles, TP
    and PP communication not modelled): layers * (time_s + dense layer + recompute_s) + output layer."""
    tokens_per_gpu_s: float
    mfu: float
    work: LayerWork
    links: LinkMap
    recompute: str = RecomputeMode.NONE
    """The recompute mode this estimate's memory and step time assume (one of RECOMPUTE_MODES)."""
    recompute_s: float = 0.0
    """Seconds one layer's recompute adds to a step (see :func:`recompute_extra_s`)."""
    recompute_layers: int = 0
    """Layers recomputed (all of them for uniform recompute, fewer for block recompute; 0 for none)."""
    attn_fwd_s: float = 0.0
    """The attention's forward alone: one direction's all-to-alls + the forward ring (what recompute repeats)."""
    dense_layer_s: float = 0.0
    """One layer's non-attention GEMMs, forward + backward (6 * layer_params * tokens / (TP*CP) / dense rate)."""
    layers: int = 0
    memory: MemoryBreakdown | None = None
    """The parts ``memory_gb`` is made of, for every recompute mode."""
    max_logit_s: float = 0.0
    """What QK-clip's max attention logit adds to the layer's forward (``max_logit``): the op's separate pass in each
    ring step unless the kernel's launch gives it (:data:`.kernel_rates.LAUNCH_MAX_LOGIT`), and its two
    all-reduces' latency; the recompute modes that run the attention forward again pay it again."""
    neighbour_exchange: bool = False
    """A sliding window made the op exchange K/V with neighbours only (the inner ring size w then has no effect)."""
    states: ShardingCost | None = None
    """How the model states are held (a memory option, :mod:`.memory_options`) and what that sends; None: the
    distributed optimizer of ``memory``, its communication not modelled."""

    @property
    def comm_s(self) -> float:
        """Exposed communication: time_s - compute_s."""
        return self.time_s - self.compute_s


def recompute_extra_s(mode: str, attn_fwd_s: float, dense_fwd_s: float, a2a_fwd_s: float) -> float:
    """Seconds one layer's recompute adds to a step (one micro-batch), run again in backward:

        none          0
        selective     attn_fwd                the attention forward again, with its all-to-alls and ring
        full          attn_fwd + dense_fwd    the whole layer forward again
        ckpt++        dense_fwd + a2a_fwd     the layer forward again without the ring and kernels (their
                                              output and lse kept), with the head all-to-alls ("outputs")
        ckpt++inputs  dense_fwd               ... and without the all-to-alls (their outputs kept too)

    attn_fwd = one direction's all-to-alls + the forward ring (or neighbour exchange), as in ``Estimate``;
    a2a_fwd = those all-to-alls alone (``Estimate.a2a_s`` / 2; 0 at hp = 1); dense_fwd = 2 * layer_params *
    tokens / (TP*CP) / dense rate (a third of the dense 6*N*tokens).
    """
    if mode == RecomputeMode.NONE:
        return 0.0
    if mode == RecomputeMode.SELECTIVE:
        return attn_fwd_s
    if mode == RecomputeMode.FULL:
        return attn_fwd_s + dense_fwd_s
    if mode == RecomputeMode.CKPT_PLUS:
        return dense_fwd_s + a2a_fwd_s
    if mode == RecomputeMode.CKPT_PLUS_INPUTS:
        return dense_fwd_s
    raise ValueError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}")


_PER_LAYER_FIELDS = (
    "time_s",
    "compute_s",
    "kernel_s",
    "a2a_s",
    "ring_exposed_s",
    "comm_total_s",
    "intra_bytes",
    "inter_bytes",
    "inter_bytes_nic",
    "attn_fwd_s",
    "step_s",
    "max_logit_s",
)


def combine_layers(parts: Sequence[tuple[Estimate, int]]) -> Estimate:
    """One estimate for a model whose layers differ (e.g. per-layer sliding windows): ``parts`` are (estimate as
    if every layer were like this one, number of such layers), all with recompute "none". Per-layer times and
    bytes become the layer-weighted mean (so layers * time_s is the sum over layers), and so does the step (each
    part's step counts all layers as its kind: the weighted mean counts each layer once); MFU and tokens/s follow
    the combined step. Memory does not depend on the window: the first part's. ``neighbour_exchange`` only when
    every layer uses it. The hook for packed length distributions is the same: one part per document shape."""
    total = sum(n for _, n in parts)
    if len(parts) == 1:
        return parts[0][0]
    first = parts[0][0]
    mean = {f: sum(getattr(e, f) * n for e, n in parts) / total for f in _PER_LAYER_FIELDS}
    flops_share = sum(e.mfu * e.step_s * n for e, n in parts) / total  # model FLOPs / (group * peak)
    return dataclasses.replace(
        first,
        **mean,
        mfu=flops_share / mean["step_s"],
        tokens_per_gpu_s=first.tokens_per_gpu_s * first.step_s / mean["step_s"],
        neighbour_exchange=all(e.neighbour_exchange for e, _ in parts),
    )


def estimate(
    job: Job, layout: Scheme, *, packed: PackedWork | None = None, recompute: str = RecomputeMode.NONE
) -> Estimate:
    """Predict ``layout`` (a :class:`.candidates.Scheme`) for ``job``. Assumes the layout is valid (see
    candidates.check_scheme).

    From the job: ``window``, one causal sliding window of that many tokens back on every layer (None: none; a
    per-layer pattern is :func:`.planner.evaluate`'s, which estimates each window); its FLOPs are the visible pairs
    only, and its transport is the op's own choice (see :mod:`.windows`). ``dkv_comm_dtype``: the dK/dV partials
    on a 2D ring in the accumulator dtype ("accumulator": fp32, the op's default) or the input dtype ("input":
    bf16, as Transformer Engine's rings always send, :func:`.candidates.kind_dkv_comm_dtype`). ``kernel``: the
    attention kernel (its rate: ``cluster.kernel_efficiency``), as the layout's kind runs it
    (:func:`.kernel_rates.side_kernel`). ``qk_clip``: the layer's forward also computes the max attention logit
    (``Estimate.max_logit_s``). The kind fixes the K/V heads per TP rank after repetition
    (:func:`.candidates.kind_kv_heads`), and the layout's ``mla_ring`` "latent" an MLA model's 2D ring carrying the
    latent: smaller blocks, and every ring step up-projects the keys it reads (``LayerWork.expand_flops`` at the
    dense GEMM rate, 3x in backward) in place of the layer's own K/V up-projection.

    ``packed``: a packed batch of documents (:class:`megatron_2d.plan.packed.PackedWork` for the job's window,
    causal): the attention FLOPs become the busiest context rank's pairs (within documents and the window), the
    ring messages the mode's ring prefix (none at all: one local block) or, when some context ranks see nothing
    of others, the neighbour exchange of the keys the op's calls read; the linear layers, all-to-alls and
    activation memory scale with the slots per rank (padding included).
    ``recompute``: one of RECOMPUTE_MODES; it changes memory and the step time (``time_s``, the attention of one
    layer, never includes recompute)."""
    if job.window is not None and not isinstance(job.window, int):
        raise ValueError(f"estimate costs one window on every layer, got the pattern {job.window!r} (evaluate's)")
    return with_recompute(_estimate_none(_run(job, layout, packed)), recompute)


def _run(job: Job, layout: Scheme, packed: PackedWork | None = None) -> _Run:
    """``job`` and ``layout`` with what the layout's kind makes of the job's choices."""
    return _Run(
        job=job,
        layout=layout,
        dkv_comm_dtype=kind_dkv_comm_dtype(layout.kind, job.dkv_comm_dtype),
        kv_heads=kind_kv_heads(layout.kind, job.model, job.parallel),
        mla_ring=MlaRing.LATENT if layout.mla_ring == MlaRing.LATENT else None,
        packed=packed,
        kernel=side_kernel(layout.kind, job.cluster.arch, job.kernel, job.qk_clip),
    )


def with_recompute(e: Estimate, mode: str, layers: int | None = None) -> Estimate:
    """``e`` (any mode) re-derived for recompute ``mode`` on ``layers`` of the model's layers (None: all; only
    LAYER_RECOMPUTE_MODES can recompute some layers): memory from its breakdown, step time, MFU, tokens/s.

        step = layers_total * (time_s + dense_layer) + n * recompute_extra_s(mode) + output layer
    """
    n = e.layers if layers is None or mode not in LAYER_RECOMPUTE_MODES else layers
    n = 0 if mode == RecomputeMode.NONE else n
    extra = recompute_extra_s(mode, e.attn_fwd_s, e.dense_layer_s / 3.0, e.a2a_s / 2.0)
    step = e.step_s - e.recompute_layers * e.recompute_s + n * extra
    mem = e.memory
    return dataclasses.replace(
        e,
        recompute=mode,
        recompute_s=extra,
        recompute_layers=n,
        step_s=step,
        mfu=e.mfu * e.step_s / step,
        tokens_per_gpu_s=e.tokens_per_gpu_s * e.step_s / step,
        memory_gb=mem.total(mode, n) / GB,
        activation_gb=mem.activations(mode, n) / GB,
    )


@dataclass(frozen=True)
class _Run:
    """One estimate's job and layout, with what the layout's kind makes of the job's choices."""

    job: Job
    layout: Scheme
    dkv_comm_dtype: str
    kv_heads: int | None
    mla_ring: str | None
    packed: PackedWork | None
    kernel: str
    """The attention kernel (:mod:`.kernel_rates`), whose rate on the cluster the kernels' time takes."""

    model = property(lambda self: self.job.model)
    cluster = property(lambda self: self.job.cluster)
    parallel = property(lambda self: self.job.parallel)
    seq = property(lambda self: self.job.seq)
    causal = property(lambda self: self.job.causal)
    window = property(lambda self: self.job.window)
    max_logit = property(lambda self: self.job.qk_clip)
    hp = property(lambda self: self.layout.hp)
    cp = property(lambda self: self.layout.cp)
    w = property(lambda self: self.layout.w)
    placement = property(lambda self: self.layout.placement)


@dataclass(frozen=True)
class _AttentionTimes:
    """One layer's attention on one rank: seconds, and the bytes it sends."""

    a2a_one: float
    """One direction's all-to-alls (0 at hp = 1)."""
    fwd: float
    bwd: float
    ring_serial: float
    """Every transfer of the transport, serialised."""
    compute: float
    sent: Traffic
    links: LinkMap
    max_logit: float = 0.0
    """What the max logit adds to the forward (``Estimate.max_logit_s``)."""

    @property
    def time(self) -> float:
        return 2 * self.a2a_one + self.fwd + self.bwd


def _estimate_none(job: _Run) -> Estimate:
    _check_job(job)
    work, ww = _windowed_work(job)
    t = _attention_times(job, work, ww)
    j, model, cluster = job, job.model, job.cluster
    dkv_elem = RIDER_BYTES[j.dkv_comm_dtype]
    mem = memory_breakdown(model, j.parallel, j.hp, j.cp, j.w, j.seq, dkv_elem, j.kv_heads, j.mla_ring, j.packed)
    dense_layer, step, mfu, tokens_per_gpu_s = _whole_model(job, work, ww, t.time)
    attn_rate = cluster.peak_tflops * 1e12 * cluster.kernel_efficiency(j.kernel)
    return Estimate(
        time_s=t.time,
        compute_s=t.compute,
        kernel_s=(1.0 + BWD_FACTOR) * work.fwd_flops / attn_rate,
        a2a_s=2 * t.a2a_one,
        ring_exposed_s=t.fwd + t.bwd - t.compute,
        comm_total_s=2 * t.a2a_one + t.ring_serial,
        intra_bytes=t.sent.intra,
        inter_bytes=t.sent.inter,
        inter_bytes_nic=t.sent.nic,
        memory_gb=mem.total(RecomputeMode.NONE) / GB,
        activation_gb=mem.activations(RecomputeMode.NONE) / GB,
        step_s=step,
        tokens_per_gpu_s=tokens_per_gpu_s,
        mfu=mfu,
        work=work,
        links=t.links,
        recompute=RecomputeMode.NONE,
        recompute_s=0.0,
        attn_fwd_s=t.a2a_one + t.fwd,
        dense_layer_s=dense_layer,
        layers=model.layers,
        memory=mem,
        neighbour_exchange=ww.transport == TransportKind.NEIGHBOUR,
        max_logit_s=t.max_logit,
    )


def _check_job(job: _Run) -> None:
    if job.dkv_comm_dtype not in RIDER_BYTES:
        raise ValueError(f"dkv_comm_dtype {job.dkv_comm_dtype!r} is not one of {list(RIDER_BYTES)}")
    if job.mla_ring is not None and (job.mla_ring not in MLA_RINGS or job.model.mla is None):
        raise ValueError(f"mla_ring {job.mla_ring!r} needs an MLA model and one of {MLA_RINGS}")
    packed, window = job.packed, job.window
    if packed is not None and (
        not job.causal or packed.window != (window if window is not None and window < job.seq - 1 else None)
    ):
        raise ValueError(
            f"packed work for window {packed.window} does not match the estimate's causal window "
            f"{window} (packed documents are modelled for causal attention)"
        )


def _windowed_work(job: _Run) -> tuple[LayerWork, WindowWork]:
    """One layer's work on one rank with what the window or the packed batch leaves of it, and its transport."""
    j = job
    work = layer_work(
        j.model,
        j.parallel,
        j.hp,
        j.cp,
        j.seq,
        j.causal,
        dkv_bytes_per_elem=RIDER_BYTES[j.dkv_comm_dtype],
        kv_heads=j.kv_heads,
        mla_ring=j.mla_ring,
    )
    packed = j.packed
    if packed is None:
        ww = window_work(j.hp, j.cp, j.placement, j.seq, j.window if j.causal else None)
        return dataclasses.replace(work, fwd_flops=work.fwd_flops * ww.fraction), ww
    # the packed work's own transport: its flops already count the window, the neighbour exchange its keys
    ww = packed_window_work(packed, j.cp)
    tf, rf = packed.token_fraction, packed.ring_fraction if packed.dense else 1.0
    work = dataclasses.replace(
        work,
        fwd_flops=work.fwd_flops * packed.flops_fraction,
        kv_bytes=work.kv_bytes * rf,
        dkv_bytes=work.dkv_bytes * rf,
        s_ctx_tokens=work.s_ctx_tokens * rf,
        a2a_peer_bytes=work.a2a_peer_bytes * tf,
        a2a_local_bytes=work.a2a_local_bytes * tf,
        merge_fwd_bytes=work.merge_fwd_bytes * tf,
        merge_bwd_bytes=work.merge_bwd_bytes * tf,
    )
    return work, ww


@dataclass(frozen=True)
class _StepTimes:
    """One ring step's seconds on one rank: forward Tc and backward Tcb (kernel, merge traffic, latency, the latent
    ring's up-projection, the max-logit pass), the forward kernel and max-logit pass alone, and the step latency."""

    tc: float
    tcb: float
    kernel: float
    max_pass: float
    lat: float


@dataclass(frozen=True)
class _TransportTimes:
    """What moving K/V one way costs one layer: forward and backward seconds, every transfer serialised, the
    compute they overlap, the bytes sent, and what the max-logit pass adds."""

    fwd: float
    bwd: float
    serial: float
    compute: float
    sent: Traffic
    max_pass: float


def _double_ring_cost(run: _Run, work: LayerWork, ww: WindowWork, links: LinkMap, step: _StepTimes) -> _TransportTimes:
    """The (double) ring: cp steps, each overlapping its transfers (:func:`.attention_time.ring_times`)."""
    fwd, bwd, serial = ring_times(work, links, run.cluster, run.cp, run.w, step.tc, step.tcb)
    sent = traffic(work, links, run.cluster, run.hp, run.cp, run.w)
    return _TransportTimes(fwd, bwd, serial, run.cp * (step.tc + step.tcb), sent, run.cp * step.max_pass)


def _local_cost(run: _Run, work: LayerWork, ww: WindowWork, links: LinkMap, step: _StepTimes) -> _TransportTimes:
    """One local block of cp steps' work (one context rank: the schedule's replay of its own block, the same cost
    with the latent ring's up-projection of it); at cp = 1 the one-step ring."""
    cp = run.cp
    if cp == 1:
        return _double_ring_cost(run, work, ww, links, step)
    tc, tcb = cp * (step.kernel + step.max_pass) + step.lat, cp * BWD_FACTOR * step.kernel + step.lat
    sent = traffic(work, links, run.cluster, run.hp, cp, run.w)
    return _TransportTimes(tc, tcb, 0.0, tc + tcb, sent, step.max_pass)


def _neighbour_cost(run: _Run, work: LayerWork, ww: WindowWork, links: LinkMap, step: _StepTimes) -> _TransportTimes:
    """The neighbour exchange: its messages on the context group's links (K/V forward and backward, the dK/dV
    partials in the rider dtype) instead of the ring's."""
    j, cluster = run, run.cluster
    ring_links = link_map(j.hp, j.cp, j.cp, j.placement, j.parallel.tp, cluster.gpus_per_node, j.parallel.gpus)
    fwd, bwd, serial, msg = neighbour_times(work, ww, ring_links, cluster, j.cp, step.tc, step.tcb)
    sent = traffic(dataclasses.replace(work, kv_bytes=0.0, dkv_bytes=0.0), links, cluster, j.hp, j.cp, j.w)
    sent.add(ring_links.inner, msg, 2 * ww.messages)  # K/V, forward and backward
    sent.add(ring_links.inner, msg * RIDER_BYTES[j.dkv_comm_dtype] / BF16, ww.messages)  # dK/dV partials
    return _TransportTimes(fwd, bwd, serial, j.cp * (step.tc + step.tcb), sent, j.cp * step.max_pass)


TRANSPORT_COSTS: dict[TransportKind, Callable[..., _TransportTimes]] = {
    TransportKind.LOCAL: _local_cost,
    TransportKind.NEIGHBOUR: _neighbour_cost,
    TransportKind.DOUBLE_RING: _double_ring_cost,
}
"""The planner's cost of each transport kind (:class:`megatron_2d.layout.choices.TransportKind`): a function of
(run, layer work, window work, links, one step's times); a kind without one is refused."""


def _attention_times(job: _Run, work: LayerWork, ww: WindowWork) -> _AttentionTimes:
    """The all-to-alls and the transport of ``ww`` (:data:`TRANSPORT_COSTS`: ring, neighbour exchange or one local
    block) around the kernels: one ring step's work Tc (Tcb backward) is its kernel, merge traffic, latency and the
    latent ring's up-projection."""
    j, cluster, parallel = job, job.cluster, job.parallel
    hp, cp, w = j.hp, j.cp, j.w
    cost = TRANSPORT_COSTS.get(ww.transport)
    if cost is None:
        raise ValueError(f"the planner has no cost model for transport kind {ww.transport!r}")
    links = link_map(hp, cp, w, j.placement, parallel.tp, cluster.gpus_per_node, parallel.gpus)
    attn_rate = cluster.peak_tflops * 1e12 * cluster.kernel_efficiency(j.kernel)
    hbm, lat = cluster.hbm_gbps * GB, cluster.step_latency_us * 1e-6
    kernel = work.fwd_flops / cp / attn_rate  # one step's forward kernel (zigzag: equal)
    merge = cp > 1  # a single block needs no merge
    dense_rate = cluster.peak_tflops * 1e12 * cluster.dense_efficiency
    expand = work.expand_flops * ww.fraction / dense_rate  # the latent ring's up-projection per step
    # QK-clip: the max logit pass of each step (unless the kernel's launch gives it), and its reductions
    passes = j.max_logit and j.kernel not in LAUNCH_MAX_LOGIT
    max_pass = max_logit_pass_s(work.fwd_flops / cp, j.model.qk_dim, j.model.v_dim, cluster) if passes else 0.0
    reductions = MAX_LOGIT_REDUCTIONS * lat if j.max_logit else 0.0
    tc = kernel + lat + (work.merge_fwd_bytes / hbm if merge else 0.0) + expand + max_pass
    tcb = BWD_FACTOR * kernel + lat + (work.merge_bwd_bytes / hbm if merge else 0.0) + 3 * expand
    # one direction's all-to-alls (nothing when hp == 1)
    a2a_one = head_exchange_time(work, links, cluster) if hp > 1 else 0.0
    t = cost(job, work, ww, links, _StepTimes(tc, tcb, kernel, max_pass, lat))
    return _AttentionTimes(
        a2a_one, t.fwd + reductions, t.bwd, t.serial, t.compute, t.sent, links, t.max_pass + reductions
    )


def _whole_model(job: _Run, work: LayerWork, ww: WindowWork, time: float) -> tuple[float, float, float, float]:
    """(dense layer seconds, step seconds, MFU, tokens per GPU per second) of the whole model around attention
    layers of ``time``: 6*N*tokens for the matmuls; attention as model FLOPs, forward + 2x backward, causal
    halved."""
    model, cluster, parallel, packed = job.model, job.cluster, job.parallel, job.packed
    B, S, CP, tp = parallel.micro_batch, job.seq, job.hp * job.cp, parallel.tp
    group = tp * CP  # GPUs sharing one micro-batch's layer work
    dense_rate = cluster.peak_tflops * 1e12 * cluster.dense_efficiency
    slots = 1.0 if packed is None else packed.token_fraction  # padding slots run the linear layers too
    # (the latent ring up-projects K/V inside attention, in the ring steps, instead of in the layer)
    dense_layer = (6.0 * model.layer_params() * B * S / group - 3.0 * work.kv_up_flops) / dense_rate * slots
    logits = 6.0 * model.vocab * model.hidden * B * S / group / dense_rate * slots
    step = model.layers * (time + dense_layer) + logits
    attn_model_flops = (
        3.0 * 2.0 * B * S * S * model.heads * (model.qk_dim + model.v_dim) * (0.5 if job.causal else 1.0) * ww.fraction
    )
    if packed is not None:
        attn_model_flops *= packed.useful_fraction  # only pairs within a document count
    model_flops = 6.0 * model.matmul_params() * B * S + model.layers * attn_model_flops
    mfu = model_flops / group / step / (cluster.peak_tflops * 1e12)
    return dense_layer, step, mfu, B * S / group / step
