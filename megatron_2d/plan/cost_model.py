"""Per-layer time, traffic and memory of one context-parallel attention layout, plus whole-model MFU.

Notation (per TP rank; every quantity is for one transformer layer and one rank unless it says otherwise)
    B        micro-batch size (sequences)
    S        sequence length (tokens of one sequence, the whole CP group together)
    H, Hkv   query / key-value heads of the model;  Ht = H/TP, Hkvt = Hkv/TP on one TP rank
    d        head dimension = D/H;  D = hidden size;  F = MLP size;  V = vocabulary
    CP       context-parallel size = hp * cp
    hp       head-parallel size (all-to-all group);  cp  context size (ring length);  w  window (inner ring)
    nw       windows = cp / w (outer ring length)
    L        K/V heads after replication = lcm(Hkvt, hp);  a rank holds L/hp of them after the all-to-all
    s_loc    S/CP tokens per rank before the all-to-all;  s_ctx = S/cp tokens per rank inside the ring
    P        peak bf16 FLOP/s per GPU;  e_a, e_g  attention-kernel / dense-GEMM efficiency
    M        HBM bandwidth;  lat  fixed cost of one ring step or all-to-all (launches, waits)
    Tc, Tcb  forward / backward attention work of one ring step: kernel + merge/accumulate + lat
    beta     bandwidth of a path (NVLink per GPU per direction, or one NIC's share of the node's network)

Sources: "paper" is LoongTrain (arXiv 2406.18485) section on 2D-Attention and Double-Ring-Attention; hardware
figures are in hardware.py. Assumptions are marked as such.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .placement import LinkClass, LinkMap, link_map
from .windows import WindowWork, window_work

BF16 = 2      # bytes per element of activations, K/V and the all-to-all tensors
FP32 = 4      # bytes per element of the dK/dV accumulators that travel the ring in backward
BWD_FACTOR = 2.5
"""Backward attention time / forward (FlashAttention recomputes P in backward: 2.5x the forward FLOPs executed)."""
GB = 1e9


# -- shapes and work --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerWork:
    """Per-rank work of one attention layer: FLOPs, message sizes and memory-bound traffic (counts of messages
    are in ``ring_times`` and ``traffic``)."""

    fwd_flops: float
    """Forward attention FLOPs on this rank: 4*B*S^2*Ht*d / CP, halved for causal (zigzag balances it exactly)."""
    a2a_peer_bytes: float
    """Bytes one rank sends to each head-group peer in ONE direction's all-to-alls (q, k, v, out or their grads)."""
    kv_bytes: float
    """One K/V block in bf16: 2 * B * s_ctx * (L/hp) * d * 2 bytes (paper: max(Hkv,hp)/H * 4*S*D/CP for B=1)."""
    dkv_bytes: float
    """One dK/dV block in fp32: twice ``kv_bytes``."""
    kv_heads_per_rank: int
    """L/hp."""
    a2a_local_bytes: float
    """Bytes of q, k, v and out on one rank before/after the all-to-all (one direction): each is permuted once
    into and once out of the send/receive buffers."""
    merge_fwd_bytes: float
    """HBM traffic of one forward ring step's merge: read and write the fp32 output accumulator and read the
    step's output, 3 * 4 * s_ctx * (Ht/hp) * d (a fused out/lse merge; lse is negligible)."""
    merge_bwd_bytes: float
    """HBM traffic of one backward ring step: the same for the fp32 dQ accumulator, plus the fp32 dK/dV block:
    3 * 4 * s_ctx * (Ht/hp + 2*L/hp) * d."""
    s_ctx_tokens: float = 0.0
    """s_ctx = S/cp: tokens of one sequence in a context rank's K/V block."""


def replicated_kv_heads(kv_heads_tp: int, hp: int) -> int:
    """L = lcm(Hkvt, hp): K/V heads after replication (factor L/Hkvt), so hp ranks each get whole heads.

    Equals max(Hkvt, hp) whenever one divides the other (the paper's max(H_kv, d_hp)).
    """
    return math.lcm(kv_heads_tp, hp)


def layer_work(model: ModelSpec, parallel: ParallelSpec, hp: int, cp: int, seq: int, causal: bool = True) -> LayerWork:
    """Work and message sizes of one layer on one rank for head-parallel size ``hp`` and context size ``cp``."""
    B, S, tp, d = parallel.micro_batch, seq, parallel.tp, model.head_dim
    CP = hp * cp
    Ht, Hkvt = model.heads // tp, model.kv_heads // tp
    L = replicated_kv_heads(Hkvt, hp)
    # Attention FLOPs, forward: QK^T and PV are 2*S*S*d each per head -> 4*B*S^2*H*d (field-and-peers.md);
    # causal keeps half. Zigzag: every rank holds chunks i and 2cp-1-i, so every one of its cp ring steps costs
    # exactly half a (S/cp)^2 block (paper). With chunk c = S/(2cp): an off-diagonal step is two full c x c
    # chunk pairs, the diagonal step one full pair plus two causal (half) pairs; both are 2c^2 = (S/cp)^2 / 2.
    fwd = 4.0 * B * S * S * Ht * d / CP * (0.5 if causal else 1.0)
    s_loc = S / CP
    # All-to-all, forward: q (Ht heads), k and v (L heads, after replication), and the output (Ht heads), each
    # s_loc tokens; a rank keeps 1/hp of each and sends 1/hp to each of its hp-1 peers. Backward: dout, dq, dk, dv.
    a2a_peer = BF16 * B * s_loc * d * (2 * Ht + 2 * L) / hp
    s_ctx = S / cp
    kv = BF16 * 2 * B * s_ctx * (L // hp) * d
    q_heads = Ht // hp if Ht % hp == 0 else Ht / hp
    merge_f = 3 * FP32 * B * s_ctx * q_heads * d
    merge_b = 3 * FP32 * B * s_ctx * (q_heads + 2 * (L // hp)) * d
    return LayerWork(fwd_flops=fwd, a2a_peer_bytes=a2a_peer, kv_bytes=kv, dkv_bytes=kv * FP32 / BF16,
                     kv_heads_per_rank=L // hp, a2a_local_bytes=a2a_peer * hp, merge_fwd_bytes=merge_f,
                     merge_bwd_bytes=merge_b, s_ctx_tokens=s_ctx)


# -- links ------------------------------------------------------------------------------------------------------

def flow_gbps(cluster: ClusterSpec, node_flows: int) -> float:
    """Network bandwidth of one off-node flow: the node's bandwidth / max(flows, NICs).

    Assumption: one P2P flow uses one NIC (rail-local), so fewer flows than NICs leave NICs idle (why a single
    ring crossing nodes is slow and why Double-Ring's concurrent outer rings help: paper), and more flows than
    NICs share them evenly.
    """
    return cluster.net_gbps_per_node / max(node_flows, cluster.nics_per_node)


def class_time(c: LinkClass, peer_bytes: float, cluster: ClusterSpec) -> float:
    """Seconds for one rank of class ``c`` to send ``peer_bytes`` to each of its peers.

    NVLink and the NICs are separate paths, so the two parts overlap: max(intra/beta_nvl, inter/beta_flow).
    """
    intra = c.intra_peers * peer_bytes / (cluster.nvlink_gbps * GB)
    inter = c.inter_peers * peer_bytes / (flow_gbps(cluster, c.node_flows) * GB) if c.inter_peers else 0.0
    return max(intra, inter)


def path_time(classes: Tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec) -> float:
    """The slowest rank's time on a path: collectives and ring steps wait for the slowest member."""
    return max((class_time(c, peer_bytes, cluster) for c in classes), default=0.0)


def worst_class(classes: Tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec) -> LinkClass:
    """The class that sets ``path_time`` (an all-zero class when the path is unused)."""
    return max(classes, key=lambda c: class_time(c, peer_bytes, cluster), default=LinkClass(0, 0, 0))


# -- the estimate -----------------------------------------------------------------------------------------------

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
    """Estimated peak memory per GPU (see ``memory_bytes``)."""
    activation_gb: float
    """The activation part of ``memory_gb``."""
    step_s: float
    """Whole model, one micro-batch, as if one GPU did the work of its TP x CP group for all layers (bubbles, TP
    and PP communication not modelled): layers * (time_s + dense layer) + output layer."""
    tokens_per_gpu_s: float
    mfu: float
    work: LayerWork
    links: LinkMap

    @property
    def comm_s(self) -> float:
        """Exposed communication: time_s - compute_s."""
        return self.time_s - self.compute_s


def _relu(x: float) -> float:
    return x if x > 0.0 else 0.0


def ring_times(work: LayerWork, links: LinkMap, cluster: ClusterSpec, cp: int, w: int, tc: float, tcb: float):
    """(forward, backward, serialised comm) seconds of the (double) ring; ``tc``/``tcb`` are one step's work.

    Paper, Double-Ring-Attention: nw = cp/w rounds of w inner steps. An inner transfer overlaps one step's
    compute (exposed: max(0, T_in - Tc)); the outer ring moves the next window's K/V during a whole round and is
    hidden when Size(kv)/beta_inter <= w*Tc (the paper's condition; here the round's actual length R, which is
    longer than w*Tc when the inner ring is itself exposed), else the remainder is exposed:
        R   = w*Tc + (w-1)*relu(T_in(kv) - Tc)
        fwd = nw*R + (nw-1)*relu(T_out(kv) - R)
    Backward: K/V travel the same path and the dK/dV accumulators (fp32) travel with them; the last dK/dV hop on
    each ring cannot overlap anything (the last inner hop of earlier rounds overlaps the next round):
        Rb  = w*Tcb + (w-1)*relu(T_in(kv+dkv) - Tcb)
        bwd = nw*Rb + (nw-1)*relu(T_out(kv+dkv) - Rb) + [w>1]*T_in(dkv) + [nw>1]*T_out(dkv)
    With w = cp this is the plain ring, Tc + (cp-1)*max(Tc, T) in forward (Megatron/TE p2p).
    """
    nw = cp // w
    kv, dkv = work.kv_bytes, work.dkv_bytes
    t_in = lambda b: path_time(links.inner, b, cluster)      # noqa: E731
    t_out = lambda b: path_time(links.outer, b, cluster)     # noqa: E731
    r_f = w * tc + (w - 1) * _relu(t_in(kv) - tc)
    fwd = nw * r_f + (nw - 1) * _relu(t_out(kv) - r_f)
    r_b = w * tcb + (w - 1) * _relu(t_in(kv + dkv) - tcb)
    bwd = (nw * r_b + (nw - 1) * _relu(t_out(kv + dkv) - r_b)
           + (t_in(dkv) if w > 1 else 0.0) + (t_out(dkv) if nw > 1 else 0.0))
    serial = (2 * nw * (w - 1) * t_in(kv) + (nw * w * t_in(dkv) if w > 1 else 0.0)
              + 2 * (nw - 1) * t_out(kv) + (nw * t_out(dkv) if nw > 1 else 0.0))
    return fwd, bwd, serial


def traffic(work: LayerWork, links: LinkMap, cluster: ClusterSpec, hp: int, cp: int, w: int):
    """(NVLink bytes, network bytes, NIC-normalised network bytes) one rank sends per layer, forward + backward.

    Message counts (our implementation): all-to-all 2 x (hp-1) per-peer chunks; K/V nw*(w-1) inner and nw-1 outer
    sends in each direction; dK/dV nw*w inner sends when w > 1 and nw outer sends when nw > 1.
    """
    nw = cp // w
    intra = inter = nic = 0.0

    def add(classes, peer_bytes, times):
        nonlocal intra, inter, nic
        c = worst_class(classes, peer_bytes, cluster)
        intra += times * c.intra_peers * peer_bytes
        inter += times * c.inter_peers * peer_bytes
        nic += times * c.inter_peers * peer_bytes * max(c.node_flows, cluster.nics_per_node) / cluster.nics_per_node

    add(links.a2a, work.a2a_peer_bytes, 2)
    add(links.inner, work.kv_bytes, 2 * nw * (w - 1))
    add(links.outer, work.kv_bytes, 2 * (nw - 1))
    if w > 1:
        add(links.inner, work.dkv_bytes, nw * w)
    if nw > 1:
        add(links.outer, work.dkv_bytes, nw)
    return intra, inter, nic


def neighbour_times(work: LayerWork, ww: WindowWork, ring_links: LinkMap, cluster: ClusterSpec, cp: int,
                    tc: float, tcb: float):
    """(forward, backward, serialised comm, K/V bytes of one message) of the neighbour exchange (sparse windows).

    The rank's visible work (cp steps' worth of ``tc`` already scaled by the window) is spread over its own block
    and its ``ww.messages`` neighbours; each neighbour's message (K/V slice, then K/V + fp32 dK/dV partial in
    backward) overlaps one such step, the last dK/dV partial overlaps nothing:
        fwd = t + m * max(t, T(kv)),  bwd = tb + m * max(tb, T(kv + dkv)) + T(dkv),   t = cp * tc / (m + 1)
    """
    m = ww.messages
    per_token = work.kv_bytes / work.s_ctx_tokens
    kv = per_token * ww.key_tokens / m
    dkv = kv * FP32 / BF16
    t_msg = lambda b: path_time(ring_links.inner, b, cluster)  # noqa: E731
    t, tb = cp * tc / (m + 1), cp * tcb / (m + 1)
    fwd = t + m * max(t, t_msg(kv))
    bwd = tb + m * max(tb, t_msg(kv + dkv)) + t_msg(dkv)
    return fwd, bwd, m * (2 * t_msg(kv) + t_msg(dkv)), kv


def memory_bytes(model: ModelSpec, parallel: ParallelSpec, hp: int, cp: int, w: int, seq: int) -> Tuple[float, float]:
    """(total, activations) bytes per GPU. A rough estimate; what it counts:

    * activations kept for backward, bf16, per local token (s_loc = S/CP) per layer, TP-sharded with sequence
      parallelism: norm inputs 2*D, QKV and fc1 inputs 2*D, q Ht*d, k and v 2*L*d (after replication), attention
      output twice (ring layout and o-proj input) 2*Ht*d, fc1 output 2F (F if not gated), fc2 input F; the
      softmax log-sum-exp Ht floats. All layers' worth: 1F1B keeps PP micro-batches of L/PP layers on stage 0
      (no recomputation; Megatron's 34*s*b*h per layer, Korthikanti et al. 2022, with flash attention);
    * fp32 logits of the local tokens (s_loc * V/TP * 4);
    * one layer's transient attention buffers: two K/V blocks and two fp32 dK/dV blocks in flight, plus one of
      each for the outer ring when nw > 1, and one all-to-all staging copy of q, k, v, out;
    * model states: bf16 weights and fp32 gradients of N/(TP*PP) parameters, fp32 master weights and Adam moments
      (12 bytes/param) sharded over DP x CP (Megatron's distributed optimizer).
    """
    B, tp, d, D = parallel.micro_batch, parallel.tp, model.head_dim, model.hidden
    CP = hp * cp
    Ht, Hkvt = model.heads // tp, model.kv_heads // tp
    L = replicated_kv_heads(Hkvt, hp)
    s_loc = B * seq / CP
    fc1_out = (2 if model.gated_mlp else 1) * model.ffn_hidden
    per_token = BF16 * ((4 * D + fc1_out + model.ffn_hidden) / tp + (Ht + 2 * L + 2 * Ht) * d) + FP32 * Ht
    activations = per_token * s_loc * model.layers
    logits = FP32 * s_loc * model.vocab / tp
    work = layer_work(model, parallel, hp, cp, seq)
    nw = cp // w
    blocks = (2 + (1 if nw > 1 else 0)) * (work.kv_bytes + work.dkv_bytes) if cp > 1 else 0.0
    staging = BF16 * s_loc * d * (2 * Ht + 2 * L) if hp > 1 else 0.0
    params = model.total_params() / (tp * parallel.pp)
    states = params * (BF16 + FP32) + params * 12 / (parallel.dp_size * CP)
    return activations + logits + blocks + staging + states, activations


def estimate(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, hp: int, cp: int, w: int,
             placement: str, seq: int, causal: bool = True, window: Optional[int] = None) -> Estimate:
    """Predict one layout. Assumes the layout is valid (see candidates.check_layout).

    ``window``: a causal sliding window of that many tokens back on every layer (None: none); its FLOPs are the
    visible pairs only, and its transport is the op's own choice (see :mod:`.windows`)."""
    work = layer_work(model, parallel, hp, cp, seq, causal)
    ww = window_work(hp, cp, placement, seq, window if causal else None)
    work = dataclasses.replace(work, fwd_flops=work.fwd_flops * ww.fraction)
    links = link_map(hp, cp, w, placement, parallel.tp, cluster.gpus_per_node, parallel.gpus)
    attn_rate = cluster.peak_tflops * 1e12 * cluster.attn_efficiency
    hbm, lat = cluster.hbm_gbps * GB, cluster.step_latency_us * 1e-6
    kernel = work.fwd_flops / cp / attn_rate                          # one step's forward kernel (zigzag: equal)
    merge = cp > 1                                                    # a single block needs no merge
    tc = kernel + lat + (work.merge_fwd_bytes / hbm if merge else 0.0)
    tcb = BWD_FACTOR * kernel + lat + (work.merge_bwd_bytes / hbm if merge else 0.0)
    # One direction's all-to-alls: the transfer, plus permuting the tensors into and out of the buffers
    # (read + write each, twice) and the fixed latency; nothing when hp == 1.
    a2a_one = 0.0
    if hp > 1:
        a2a_one = path_time(links.a2a, work.a2a_peer_bytes, cluster) + 4 * work.a2a_local_bytes / hbm + lat
    if ww.dense:
        fwd, bwd, ring_serial = ring_times(work, links, cluster, cp, w, tc, tcb)
        intra, inter, nic = traffic(work, links, cluster, hp, cp, w)
    else:
        ring_links = link_map(hp, cp, cp, placement, parallel.tp, cluster.gpus_per_node, parallel.gpus)
        fwd, bwd, ring_serial, msg = neighbour_times(work, ww, ring_links, cluster, cp, tc, tcb)
        intra, inter, nic = traffic(dataclasses.replace(work, kv_bytes=0.0, dkv_bytes=0.0), links, cluster, hp, cp, w)
        c = worst_class(ring_links.inner, msg, cluster)
        for peer_bytes, times in ((msg, 2 * ww.messages), (msg * FP32 / BF16, ww.messages)):
            intra += times * c.intra_peers * peer_bytes
            inter += times * c.inter_peers * peer_bytes
            nic += times * c.inter_peers * peer_bytes * max(c.node_flows, cluster.nics_per_node) / cluster.nics_per_node
    compute = cp * (tc + tcb)
    time = 2 * a2a_one + fwd + bwd
    mem, act = memory_bytes(model, parallel, hp, cp, w, seq)

    # Whole model (6*N*tokens for the matmuls; attention as model FLOPs, forward + 2x backward, causal halved).
    B, S, CP, tp = parallel.micro_batch, seq, hp * cp, parallel.tp
    group = tp * CP                                          # GPUs sharing one micro-batch's layer work
    dense_rate = cluster.peak_tflops * 1e12 * cluster.dense_efficiency
    dense_layer = 6.0 * model.layer_params() * B * S / group / dense_rate
    logits = 6.0 * model.vocab * model.hidden * B * S / group / dense_rate
    step = model.layers * (time + dense_layer) + logits
    attn_model_flops = 3.0 * 4.0 * B * S * S * model.heads * model.head_dim * (0.5 if causal else 1.0) * ww.fraction
    model_flops = 6.0 * model.matmul_params() * B * S + model.layers * attn_model_flops
    mfu = model_flops / group / step / (cluster.peak_tflops * 1e12)
    return Estimate(time_s=time, compute_s=compute, kernel_s=(1.0 + BWD_FACTOR) * work.fwd_flops / attn_rate,
                    a2a_s=2 * a2a_one, ring_exposed_s=fwd + bwd - compute,
                    comm_total_s=2 * a2a_one + ring_serial, intra_bytes=intra, inter_bytes=inter,
                    inter_bytes_nic=nic, memory_gb=mem / GB, activation_gb=act / GB, step_s=step,
                    tokens_per_gpu_s=B * S / group / step, mfu=mfu, work=work, links=links)
