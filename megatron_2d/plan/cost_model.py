"""Per-layer time, traffic and memory of one context-parallel attention layout, plus whole-model MFU.

Notation (per TP rank; every quantity is for one transformer layer and one rank unless it says otherwise)
    B        micro-batch size (sequences)
    S        sequence length (tokens of one sequence, the whole CP group together)
    H, Hkv   query / key-value heads of the model;  Ht = H/TP, Hkvt = Hkv/TP on one TP rank
    d        head dimension = D/H;  D = hidden size;  F = MLP size;  V = vocabulary
    dk, dv   query/key and value head dims (d and d; MLA: dn + dr and dv, e.g. 192 and 128)
    r, dr    MLA's kv_lora_rank and rope dim: the latent ring carries r + dr values per token
    CP       context-parallel size = hp * cp
    hp       head-parallel size (all-to-all group);  cp  context size (ring length);  w  window (inner ring)
    nw       windows = cp / w (outer ring length)
    L        K/V heads after replication = lcm(Hkvt, hp) (DeepSpeed-Ulysses repeats them to Ht);  a rank holds
             L/hp of them after the all-to-all
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
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from ..ring_schedule import double_ring_events, final_hop_link, replay
from ..zero_sharding import HybridZeRO, state_bytes_per_rank
from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .links import overlapped
from .link_classes import LinkClass, LinkMap, link_map
from .windows import WindowWork, window_work

if TYPE_CHECKING:
    from .memory_options import ShardingCost
    from .packed import PackedWork

BF16 = 2      # bytes per element of activations, K/V and the all-to-all tensors
FP32 = 4      # bytes per element of fp32 tensors (our ring's dK/dV accumulators, softmax lse, logits)
DTYPE_BYTES = {"fp32": FP32, "bf16": BF16, "fp16": BF16}
"""Bytes per element of the dK/dV partials that travel a ring in backward, by name. Transformer Engine's p2p
backward sends them in the input dtype (bf16); this project's 2D ring accumulates and sends them in fp32."""
RECOMPUTE_MODES = ("none", "selective", "full", "ckpt++")
"""Activation recomputation: none; Megatron's selective recompute of core attention (--recompute-activations);
Megatron's full-layer recompute (uniform, every layer); Selective Checkpoint++ (full recompute that keeps each
layer's attention output + lse: 2D only). See :func:`recompute_extra_s` and :class:`MemoryBreakdown`."""
BWD_FACTOR = 2.5
"""Backward attention time / forward (FlashAttention recomputes P in backward: 2.5x the forward FLOPs executed)."""
GB = 1e9


# -- shapes and work --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerWork:
    """Per-rank work of one attention layer: FLOPs, message sizes and memory-bound traffic (counts of messages
    are in ``ring_times`` and ``traffic``)."""

    fwd_flops: float
    """Forward attention FLOPs on this rank: 2*B*S^2*Ht*(dk + dv) / CP, halved for causal (zigzag balances it
    exactly); 4*B*S^2*Ht*d when dk = dv = d."""
    a2a_peer_bytes: float
    """Bytes one rank sends to each head-group peer in ONE direction's all-to-alls (q, k, v, out or their grads;
    the latent ring: q, out and the rank's whole latent, all-gathered)."""
    kv_bytes: float
    """One K/V block in bf16: B * s_ctx * (L/hp) * (dk + dv) * 2 bytes (paper: max(Hkv,hp)/H * 4*S*D/CP for B=1);
    the latent ring: B * s_ctx * (r + dr) * 2."""
    dkv_bytes: float
    """One dK/dV block as it travels the ring: ``kv_bytes`` * dkv_bytes_per_elem / 2 (fp32: twice ``kv_bytes``,
    Transformer Engine's bf16: equal)."""
    kv_heads_per_rank: int
    """L/hp (the latent ring: the query heads of the rank, which it up-projects K/V for)."""
    a2a_local_bytes: float
    """Bytes of q, k, v and out on one rank before/after the all-to-all (one direction): each is permuted once
    into and once out of the send/receive buffers."""
    merge_fwd_bytes: float
    """HBM traffic of one forward ring step's merge: read and write the fp32 output accumulator and read the
    step's output, 3 * 4 * s_ctx * (Ht/hp) * dv (a fused out/lse merge; lse is negligible)."""
    merge_bwd_bytes: float
    """HBM traffic of one backward ring step: the same for the fp32 dQ accumulator, plus the fp32 gradient of
    the block: 3 * 4 * s_ctx * ((Ht/hp) * dk + (L/hp) * (dk + dv)) (the latent ring: its per-head dK/dV partials
    and the latent's gradient, 3 * 4 * s_ctx * ((Ht/hp) * (2 dk + dv) + r + dr))."""
    s_ctx_tokens: float = 0.0
    """s_ctx = S/cp: tokens of one sequence in a context rank's K/V block."""
    expand_flops: float = 0.0
    """The latent ring only: forward FLOPs of up-projecting the keys one ring step reads, for this rank's heads,
    2 * B * s_ctx * f * r * (Ht/hp) * (dn + dv) (f: the share of a block's keys its calls read; causal zigzag
    3/4 on average over steps); backward runs it again and twice more for the latent's and the weight's
    gradients (3x)."""
    kv_up_flops: float = 0.0
    """The latent ring only: the forward FLOPs of MLA's K/V up-projection of the rank's own tokens, 2 * B * s_loc
    * r * Ht * (dn + dv), which the layer no longer runs outside attention."""


MLA_RINGS = ("expanded", "latent")
"""What a 2D MLA layer's ring carries: per-head K/V ("expanded", as every CP backend) or the latent ("latent")."""


def replicated_kv_heads(kv_heads_tp: int, hp: int) -> int:
    """L = lcm(Hkvt, hp): K/V heads after replication (factor L/Hkvt), so hp ranks each get whole heads.

    Equals max(Hkvt, hp) whenever one divides the other (the paper's max(H_kv, d_hp)).
    """
    return math.lcm(kv_heads_tp, hp)


def layer_work(model: ModelSpec, parallel: ParallelSpec, hp: int, cp: int, seq: int, causal: bool = True,
               dkv_bytes_per_elem: int = FP32, kv_heads: Optional[int] = None,
               mla_ring: Optional[str] = None) -> LayerWork:
    """Work and message sizes of one layer on one rank for head-parallel size ``hp`` and context size ``cp``.

    ``dkv_bytes_per_elem``: bytes per element of the dK/dV partials on the ring (4: ours, fp32; 2: Transformer
    Engine, input dtype). ``kv_heads``: K/V heads per TP rank after repetition (None: L = lcm(Hkvt, hp), our
    replication; DeepSpeed-Ulysses repeats them to all Ht query heads). ``mla_ring``: "latent" for an MLA model
    whose 2D ring carries the latent (None / "expanded": per-head K/V)."""
    B, S, tp = parallel.micro_batch, seq, parallel.tp
    dk, dv = model.qk_dim, model.v_dim
    CP = hp * cp
    Ht, Hkvt = model.heads // tp, model.kv_heads // tp
    L = replicated_kv_heads(Hkvt, hp) if kv_heads is None else kv_heads
    # Attention FLOPs, forward: QK^T is 2*S*S*dk and PV 2*S*S*dv per head -> 2*B*S^2*H*(dk + dv) (4*B*S^2*H*d,
    # field-and-peers.md); causal keeps half. Zigzag: every rank holds chunks i and 2cp-1-i, so every one of its cp
    # ring steps costs exactly half a (S/cp)^2 block (paper). With chunk c = S/(2cp): an off-diagonal step is two
    # full c x c chunk pairs, the diagonal step one full pair plus two causal (half) pairs; both are 2c^2.
    fwd = 2.0 * B * S * S * Ht * (dk + dv) / CP * (0.5 if causal else 1.0)
    s_loc = S / CP
    s_ctx = S / cp
    q_heads = Ht // hp if Ht % hp == 0 else Ht / hp
    if mla_ring == "latent":
        m = model.mla
        # all-to-all of q and out (1/hp of each to each peer), all-gather of the whole latent to each peer
        a2a_peer = BF16 * B * s_loc * (Ht * (dk + dv) / hp + m.latent_width)
        kv = BF16 * B * s_ctx * m.latent_width
        keys = 1.0 if not causal or cp == 1 else (1 + 0.75 * (cp - 1)) / cp
        expand = 2.0 * B * s_ctx * keys * m.kv_lora_rank * q_heads * (m.qk_head_dim + m.v_head_dim)
        kv_up = 2.0 * B * s_loc * m.kv_lora_rank * Ht * (m.qk_head_dim + m.v_head_dim)
        return LayerWork(fwd_flops=fwd, a2a_peer_bytes=a2a_peer, kv_bytes=kv,
                         dkv_bytes=kv * dkv_bytes_per_elem / BF16, kv_heads_per_rank=int(q_heads),
                         a2a_local_bytes=a2a_peer * hp, merge_fwd_bytes=3 * FP32 * B * s_ctx * q_heads * dv,
                         # dQ, the block's per-head dK/dV partials (gathered before the up-projection's backward)
                         # and its latent gradient
                         merge_bwd_bytes=3 * FP32 * B * s_ctx * (q_heads * (2 * dk + dv) + m.latent_width),
                         s_ctx_tokens=s_ctx, expand_flops=expand, kv_up_flops=kv_up)
    # All-to-all, forward: q (Ht heads), k and v (L heads, after replication), and the output (Ht heads), each
    # s_loc tokens; a rank keeps 1/hp of each and sends 1/hp to each of its hp-1 peers. Backward: dout, dq, dk, dv.
    a2a_peer = BF16 * B * s_loc * (Ht + L) * (dk + dv) / hp
    kv = BF16 * B * s_ctx * (L // hp) * (dk + dv)
    merge_f = 3 * FP32 * B * s_ctx * q_heads * dv
    merge_b = 3 * FP32 * B * s_ctx * (q_heads * dk + (L // hp) * (dk + dv))
    return LayerWork(fwd_flops=fwd, a2a_peer_bytes=a2a_peer, kv_bytes=kv, dkv_bytes=kv * dkv_bytes_per_elem / BF16,
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


def class_time(c: LinkClass, peer_bytes: float, cluster: ClusterSpec, kind: str = "p2p") -> float:
    """Seconds for one rank of class ``c`` to send ``peer_bytes`` to each of its peers.

    NVLink and the NICs are separate paths, so the two parts overlap: max(intra/beta_nvl, inter/beta_flow), each
    beta scaled by the link efficiency of its class for ``kind`` ("p2p": ring sends, "a2a": collectives;
    :mod:`.links`).
    """
    eff = cluster.links
    intra = c.intra_peers * peer_bytes / (cluster.nvlink_gbps * eff.factor("nvlink", kind) * GB)
    inter = (c.inter_peers * peer_bytes / (flow_gbps(cluster, c.node_flows) * eff.factor("network", kind) * GB)
             if c.inter_peers else 0.0)
    return max(intra, inter)


def path_time(classes: Tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec, kind: str = "p2p") -> float:
    """The slowest rank's time on a path: collectives and ring steps wait for the slowest member."""
    return max((class_time(c, peer_bytes, cluster, kind) for c in classes), default=0.0)


def worst_class(classes: Tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec,
                kind: str = "p2p") -> LinkClass:
    """The class that sets ``path_time`` (an all-zero class when the path is unused)."""
    return max(classes, key=lambda c: class_time(c, peer_bytes, cluster, kind), default=LinkClass(0, 0, 0))


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
    """Estimated peak memory per GPU under ``recompute`` (see :class:`MemoryBreakdown`)."""
    activation_gb: float
    """The activation part of ``memory_gb``."""
    step_s: float
    """Whole model, one micro-batch, as if one GPU did the work of its TP x CP group for all layers (bubbles, TP
    and PP communication not modelled): layers * (time_s + dense layer + recompute_s) + output layer."""
    tokens_per_gpu_s: float
    mfu: float
    work: LayerWork
    links: LinkMap
    recompute: str = "none"
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
    memory: Optional["MemoryBreakdown"] = None
    """The parts ``memory_gb`` is made of, for every recompute mode."""
    neighbour_exchange: bool = False
    """A sliding window made the op exchange K/V with neighbours only (the window size w then has no effect)."""
    states: Optional["ShardingCost"] = None
    """How the model states are held (a memory option, :mod:`.memory_options`) and what that sends; None: the
    distributed optimizer of ``memory``, its communication not modelled."""

    @property
    def comm_s(self) -> float:
        """Exposed communication: time_s - compute_s."""
        return self.time_s - self.compute_s


def _relu(x: float) -> float:
    return x if x > 0.0 else 0.0


def ring_times(work: LayerWork, links: LinkMap, cluster: ClusterSpec, cp: int, w: int, tc: float, tcb: float):
    """(forward, backward, serialised comm) seconds of the (double) ring; ``tc``/``tcb`` are one step's work.

    Not a closed form: the op's own schedule (:func:`megatron_2d.ring_schedule.double_ring_events`, the events the
    ring loop executes) is replayed with modelled times: a compute takes ``tc`` (``tcb``), a K/V (dK/dV) transfer
    takes its path time on the inner or outer links, transfers on one link go one after another, and a wait
    blocks until its transfer is done. Forward reduces to the paper's Double-Ring formula
        R = w*Tc + (w-1)*relu(T_in(kv) - Tc),   fwd = nw*R + (nw-1)*relu(T_out(kv) - R);
    backward follows whatever the loop does (riders posted after each step, each round's rider added to the one
    carried over the outer ring a round earlier, the last hop to the owner exposed); dK/dV riders are
    ``work.dkv_bytes`` (fp32 for ours, bf16 for Transformer Engine).
    """
    kv, dkv = work.kv_bytes, work.dkv_bytes
    last = final_hop_link(cp, w)                 # the last hop (window, slot) -> (window + 1, slot + 1)
    transfer = {"inner_kv": path_time(links.inner, kv, cluster), "outer_kv": path_time(links.outer, kv, cluster),
                "inner_dkv": path_time(links.inner, dkv, cluster), "outer_dkv": path_time(links.outer, dkv, cluster),
                "final_dkv": path_time(getattr(links, last), dkv, cluster)}
    link_of = {"inner_kv": "inner", "inner_dkv": "inner", "outer_kv": "outer", "outer_dkv": "outer",
               "final_dkv": last}
    forward, backward = double_ring_events(cp, w, False), double_ring_events(cp, w, True)
    fwd = replay(forward, tc, transfer, link_of, cluster.links.interference)
    bwd = replay(backward, tcb, transfer, link_of, cluster.links.interference)
    serial = sum(transfer[e.channel] for e in forward + backward if e.kind.startswith("post_"))
    return fwd, bwd, serial


def traffic(work: LayerWork, links: LinkMap, cluster: ClusterSpec, hp: int, cp: int, w: int):
    """(NVLink bytes, network bytes, NIC-normalised network bytes) one rank sends per layer, forward + backward.

    Message counts: all-to-all 2 x (hp-1) per-peer chunks; the ring's K/V and dK/dV sends are counted off the
    schedule the loop runs (:func:`megatron_2d.ring_schedule.double_ring_events`, forward and backward): K/V
    nw*(w-1) inner and nw-1 outer sends in each direction, dK/dV cp-1 sends (the last hop on the outer links
    unless w = cp).
    """
    intra = inter = nic = 0.0

    def add(classes, peer_bytes, times, kind="p2p"):
        nonlocal intra, inter, nic
        c = worst_class(classes, peer_bytes, cluster, kind)
        intra += times * c.intra_peers * peer_bytes
        inter += times * c.inter_peers * peer_bytes
        nic += times * c.inter_peers * peer_bytes * max(c.node_flows, cluster.nics_per_node) / cluster.nics_per_node

    sends = Counter(e.channel for e in double_ring_events(cp, w, False) + double_ring_events(cp, w, True)
                    if e.kind.startswith("post_"))
    add(links.a2a, work.a2a_peer_bytes, 2, "a2a")
    add(links.inner, work.kv_bytes, sends["inner_kv"])
    add(links.outer, work.kv_bytes, sends["outer_kv"])
    add(links.inner, work.dkv_bytes, sends["inner_dkv"])
    add(links.outer, work.dkv_bytes, sends["outer_dkv"])
    add(getattr(links, final_hop_link(cp, w)), work.dkv_bytes, sends["final_dkv"])
    return intra, inter, nic


def neighbour_times(work: LayerWork, ww: WindowWork, ring_links: LinkMap, cluster: ClusterSpec, cp: int,
                    tc: float, tcb: float):
    """(forward, backward, serialised comm, K/V bytes of one message) of the neighbour exchange (sparse windows).

    The rank's visible work (cp steps' worth of ``tc`` already scaled by the window) is spread over its own block
    and its ``ww.messages`` neighbours; each neighbour's message (K/V slice, then K/V + the dK/dV partial in
    backward, in the dtype of ``work.dkv_bytes``) overlaps one such step, the last dK/dV partial overlaps nothing:
        fwd = t + m * max(t, T(kv)),  bwd = tb + m * max(tb, T(kv + dkv)) + T(dkv),   t = cp * tc / (m + 1)
    (each max(compute, transfer) slowed by the links' interference: :func:`.links.overlapped`)
    """
    m = ww.messages
    per_token = work.kv_bytes / work.s_ctx_tokens
    kv = per_token * ww.key_tokens / m
    dkv = kv * (work.dkv_bytes / work.kv_bytes if work.kv_bytes else FP32 / BF16)
    t_msg = lambda b: path_time(ring_links.inner, b, cluster)  # noqa: E731
    t, tb = cp * tc / (m + 1), cp * tcb / (m + 1)
    x = cluster.links.interference
    fwd = t + m * overlapped(t, t_msg(kv), x)
    bwd = tb + m * overlapped(tb, t_msg(kv + dkv), x) + t_msg(dkv)
    return fwd, bwd, m * (2 * t_msg(kv) + t_msg(dkv)), kv


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory per GPU, in parts, from which every recompute mode's peak is derived (bytes).

    Activations are counted per local token (``tokens`` = B * S / CP) per layer, bf16, TP-sharded with sequence
    parallelism. Parts of one layer (Korthikanti et al. 2022's 34*s*b*h per layer, with flash attention):

        layer_input  = 2 * D/TP                 the layer's input (first norm's input)
        dense_rest   = 2 * (3D + F' + F)/TP     QKV-GEMM input, pre-MLP norm input, fc1 input, fc1 output
                                                (F' = 2F gated, else F), fc2 input
        qkv          = 2 * (Ht*dk + L*(dk+dv))  q, k, v in the attention's layout (K/V after replication to L;
                                                the latent ring: Ht*dk + hp*(r + dr), the all-gathered latent)
        attn_out     = 2 * Ht * dv              the attention output as the kernel/ring keeps it
        o_proj_in    = 2 * Ht * dv              the output after the inverse all-to-all (o-proj input)
        lse          = 4 * Ht                   the softmax log-sum-exp (fp32)
        A_none       = the sum of all six

    1F1B keeps PP micro-batches of layers/PP layers on stage 0: ``layers`` layers' worth in all. Kept per token
    per layer, by recompute mode:

        none       A_none
        selective  A_none - attn_out - lse       Megatron's core-attention checkpoint re-saves q, k, v; flash
                                                 attention stores nothing quadratic, so only its output and lse
                                                 go (an upper bound on the saving: tools/memory_report.py
                                                 measures none on our op)
        full       layer_input                   only the checkpointed layer inputs
        ckpt++     layer_input + qkv + attn_out + lse   the inputs plus the kept attention graph
                                                 (megatron_2d/megatron/checkpoint_plus.py; measured within 1% of
                                                 full + these parts by tools/memory_report.py)

    and full / ckpt++ also hold one rebuilt layer (A_none) during its backward. With n of the layers recomputed
    (Megatron's --recompute-method block; n = layers for uniform) and the others kept whole:

        activations(mode, n) = tokens * (n * kept(mode) + (layers - n) * A_none + [n > 0, full/ckpt++] * A_none)
        total(mode, n)       = activations(mode, n) + logits + comm_buffers + model_states
    """

    tokens: float
    layers: int
    layer_input: float
    dense_rest: float
    qkv: float
    attn_out: float
    o_proj_in: float
    lse: float
    logits: float
    """fp32 logits of the local tokens: 4 * tokens * V/TP."""
    comm_buffers: float
    """One layer's transient attention buffers: two K/V and two dK/dV blocks in flight (plus one of each for the
    outer ring when there are both an inner and an outer ring, 1 < w < cp) and one all-to-all staging copy of q,
    k, v, out."""
    model_states: float
    """bf16 weights + fp32 gradients of N/(TP*PP) parameters, and fp32 master weights + Adam moments (12 bytes
    per parameter) sharded over DP x CP (Megatron's distributed optimizer: megatron_2d.zero_sharding's
    state_bytes_per_rank, the library's own count); a memory option (:mod:`.memory_options`) replaces it."""
    sharded_states: float = 0.0
    """The part of ``model_states`` sharded over DP x CP (the optimizer's 12 bytes per parameter)."""

    @property
    def per_token_none(self) -> float:
        """A_none: every part of one layer, bytes per token."""
        return self.layer_input + self.dense_rest + self.qkv + self.attn_out + self.o_proj_in + self.lse

    def kept_per_token(self, mode: str) -> float:
        """Bytes per token per layer kept for backward under recompute ``mode``."""
        if mode == "none":
            return self.per_token_none
        if mode == "selective":
            return self.per_token_none - self.attn_out - self.lse
        if mode == "full":
            return self.layer_input
        if mode == "ckpt++":
            return self.layer_input + self.qkv + self.attn_out + self.lse
        raise ValueError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}")

    def activations(self, mode: str = "none", n: Optional[int] = None) -> float:
        """Activation bytes with ``n`` layers recomputed under ``mode`` (None: all of them)."""
        n = self.layers if n is None or mode == "none" else n
        rebuilt = self.per_token_none if mode in ("full", "ckpt++") and n > 0 else 0.0
        return self.tokens * (n * self.kept_per_token(mode) + (self.layers - n) * self.per_token_none + rebuilt)

    def total(self, mode: str = "none", n: Optional[int] = None) -> float:
        return self.activations(mode, n) + self.logits + self.comm_buffers + self.model_states

    def layers_to_fit(self, mode: str, budget_bytes: float, step: int = 1) -> Optional[int]:
        """The fewest recomputed layers (a multiple of ``step``, e.g. PP for per-stage block recompute) with which
        ``total(mode, n)`` fits ``budget_bytes``; None when even all layers do not fit."""
        # total(mode, n) for n >= 1 is linear in n: total(mode, 1) - (n - 1) * tokens * (A_none - kept)
        first = self.total(mode, step)
        if first <= budget_bytes:
            return step
        saved = self.tokens * (self.per_token_none - self.kept_per_token(mode))
        if saved <= 0:
            return None
        n = step + step * math.ceil((first - budget_bytes) / (saved * step) - 1e-12)
        while n - step >= step and self.total(mode, n - step) <= budget_bytes:     # guard rounding
            n -= step
        while n <= self.layers and self.total(mode, n) > budget_bytes:
            n += step
        return n if n <= self.layers else None


def memory_breakdown(model: ModelSpec, parallel: ParallelSpec, hp: int, cp: int, w: int, seq: int,
                     dkv_bytes_per_elem: int = FP32, kv_heads: Optional[int] = None,
                     mla_ring: Optional[str] = None, packed: Optional["PackedWork"] = None) -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of one layout (``kv_heads``, ``dkv_bytes_per_elem``, ``mla_ring``: as
    :func:`layer_work`; the latent ring keeps the all-gathered latent, hp * (r + dr) per local token, for K/V).

    ``packed``: a packed batch; every per-token part counts the slots a rank really holds (its real tokens and its
    padding: ``token_fraction`` * S / CP), and the ring's blocks in flight hold the ring prefix (or, with the
    neighbour exchange, the busiest rank's messages)."""
    B, tp, D, F = parallel.micro_batch, parallel.tp, model.hidden, model.ffn_hidden
    dk, dv = model.qk_dim, model.v_dim
    CP = hp * cp
    Ht, Hkvt = model.heads // tp, model.kv_heads // tp
    L = replicated_kv_heads(Hkvt, hp) if kv_heads is None else kv_heads
    kv_per_token = hp * model.mla.latent_width if mla_ring == "latent" else L * (dk + dv)
    tokens = B * seq / CP * (1.0 if packed is None else packed.token_fraction)
    fc1_out = (2 if model.gated_mlp else 1) * F
    work = layer_work(model, parallel, hp, cp, seq, dkv_bytes_per_elem=dkv_bytes_per_elem, kv_heads=kv_heads,
                      mla_ring=mla_ring)
    nw = cp // w
    blocks = (2 + (1 if nw > 1 and w > 1 else 0)) * (work.kv_bytes + work.dkv_bytes) if cp > 1 else 0.0
    if packed is not None:                  # the ring prefix, or two neighbour messages (K/V + dK/dV) in flight
        prefix = packed.ring_fraction if packed.dense else packed.key_tokens / max(packed.messages, 1) / (seq / cp)
        blocks *= prefix if packed.ring_tokens else 0.0
    staging = BF16 * tokens * (Ht * (dk + dv) + kv_per_token) if hp > 1 else 0.0
    states = state_bytes_per_rank(-(-model.total_params() // (tp * parallel.pp)), HybridZeRO("optimizer"),
                                  parallel.dp_size, CP, param_bytes=BF16, grad_bytes=FP32)
    return MemoryBreakdown(
        tokens=tokens, layers=model.layers, layer_input=BF16 * D / tp,
        dense_rest=BF16 * (3 * D + fc1_out + F) / tp, qkv=BF16 * (Ht * dk + kv_per_token), attn_out=BF16 * Ht * dv,
        o_proj_in=BF16 * Ht * dv, lse=FP32 * Ht, logits=FP32 * tokens * model.vocab / tp,
        comm_buffers=blocks + staging,
        model_states=float(sum(states.values())), sharded_states=float(states["optimizer"]))


def memory_bytes(model: ModelSpec, parallel: ParallelSpec, hp: int, cp: int, w: int, seq: int,
                 recompute: str = "none", dkv_bytes_per_elem: int = FP32,
                 kv_heads: Optional[int] = None, mla_ring: Optional[str] = None) -> Tuple[float, float]:
    """(total, activations) bytes per GPU under ``recompute`` (see :class:`MemoryBreakdown` for what is counted)."""
    mb = memory_breakdown(model, parallel, hp, cp, w, seq, dkv_bytes_per_elem, kv_heads, mla_ring)
    return mb.total(recompute), mb.activations(recompute)


def recompute_extra_s(mode: str, attn_fwd_s: float, dense_fwd_s: float) -> float:
    """Seconds one layer's recompute adds to a step (one micro-batch), run again in backward:

        none       0
        selective  attn_fwd                the attention forward again, with its all-to-alls and ring
        full       attn_fwd + dense_fwd    the whole layer forward again
        ckpt++     dense_fwd               the layer forward again without attention (kept, not recomputed)

    attn_fwd = one direction's all-to-alls + the forward ring (or neighbour exchange), as in ``Estimate``;
    dense_fwd = 2 * layer_params * tokens / (TP*CP) / dense rate (a third of the dense 6*N*tokens).
    """
    if mode == "none":
        return 0.0
    if mode == "selective":
        return attn_fwd_s
    if mode == "full":
        return attn_fwd_s + dense_fwd_s
    if mode == "ckpt++":
        return dense_fwd_s
    raise ValueError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}")


_PER_LAYER_FIELDS = ("time_s", "compute_s", "kernel_s", "a2a_s", "ring_exposed_s", "comm_total_s", "intra_bytes",
                     "inter_bytes", "inter_bytes_nic", "attn_fwd_s", "step_s")


def combine_layers(parts: Sequence[Tuple["Estimate", int]]) -> "Estimate":
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
    flops_share = sum(e.mfu * e.step_s * n for e, n in parts) / total        # model FLOPs / (group * peak)
    return dataclasses.replace(first, **mean, mfu=flops_share / mean["step_s"],
                               tokens_per_gpu_s=first.tokens_per_gpu_s * first.step_s / mean["step_s"],
                               neighbour_exchange=all(e.neighbour_exchange for e, _ in parts))


def estimate(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, hp: int, cp: int, w: int,
             placement: str, seq: int, causal: bool = True, window: Optional[int] = None,
             recompute: str = "none", dkv_dtype: str = "fp32", kv_heads: Optional[int] = None,
             packed: Optional["PackedWork"] = None, mla_ring: Optional[str] = None) -> Estimate:
    """Predict one layout. Assumes the layout is valid (see candidates.check_layout).

    ``window``: a causal sliding window of that many tokens back on every layer (None: none); its FLOPs are the
    visible pairs only, and its transport is the op's own choice (see :mod:`.windows`).
    ``recompute``: one of RECOMPUTE_MODES; it changes memory and the step time (``time_s``, the attention of one
    layer, never includes recompute). ``dkv_dtype``: 'fp32' (ours) or 'bf16' (Transformer Engine's p2p) for the
    dK/dV partials on the ring. ``kv_heads``: K/V heads per TP rank after repetition (see :func:`layer_work`).
    ``packed``: a packed batch of documents (:class:`megatron_2d.plan.packed.PackedWork` for this ``window``,
    causal): the attention FLOPs become the busiest context rank's pairs (within documents and the window), the
    ring messages the mode's ring prefix (none at all: one local block) or, when some context ranks see nothing
    of others, the neighbour exchange of the keys the op's calls read; the linear layers, all-to-alls and
    activation memory scale with the slots per rank (padding included).
    ``mla_ring``: "latent" for an MLA model whose 2D ring carries the latent: smaller blocks, and every ring step
    up-projects the keys it reads (``LayerWork.expand_flops`` at the dense GEMM rate, 3x in backward) in place of
    the layer's own K/V up-projection."""
    return with_recompute(_estimate_none(model, cluster, parallel, hp, cp, w, placement, seq, causal, window,
                                         dkv_dtype, kv_heads, packed, mla_ring), recompute)


def with_recompute(e: "Estimate", mode: str, layers: Optional[int] = None) -> "Estimate":
    """``e`` (any mode) re-derived for recompute ``mode`` on ``layers`` of the model's layers (None: all; only
    full and ckpt++ can recompute some layers): memory from its breakdown, step time, MFU, tokens/s.

        step = layers_total * (time_s + dense_layer) + n * recompute_extra_s(mode) + output layer
    """
    n = e.layers if layers is None or mode in ("none", "selective") else layers
    n = 0 if mode == "none" else n
    extra = recompute_extra_s(mode, e.attn_fwd_s, e.dense_layer_s / 3.0)
    step = e.step_s - e.recompute_layers * e.recompute_s + n * extra
    mem = e.memory
    return dataclasses.replace(e, recompute=mode, recompute_s=extra, recompute_layers=n, step_s=step,
                               mfu=e.mfu * e.step_s / step, tokens_per_gpu_s=e.tokens_per_gpu_s * e.step_s / step,
                               memory_gb=mem.total(mode, n) / GB, activation_gb=mem.activations(mode, n) / GB)


def _estimate_none(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, hp: int, cp: int, w: int,
                   placement: str, seq: int, causal: bool, window: Optional[int], dkv_dtype: str,
                   kv_heads: Optional[int], packed: Optional["PackedWork"] = None,
                   mla_ring: Optional[str] = None) -> "Estimate":
    if dkv_dtype not in DTYPE_BYTES:
        raise ValueError(f"dkv_dtype {dkv_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if mla_ring is not None and (mla_ring not in MLA_RINGS or model.mla is None):
        raise ValueError(f"mla_ring {mla_ring!r} needs an MLA model and one of {MLA_RINGS}")
    dkv_elem = DTYPE_BYTES[dkv_dtype]
    work = layer_work(model, parallel, hp, cp, seq, causal, dkv_bytes_per_elem=dkv_elem, kv_heads=kv_heads,
                      mla_ring=mla_ring)
    local_only = False
    if packed is None:
        ww = window_work(hp, cp, placement, seq, window if causal else None)
        work = dataclasses.replace(work, fwd_flops=work.fwd_flops * ww.fraction)
    else:
        if not causal or packed.window != (window if window is not None and window < seq - 1 else None):
            raise ValueError(f"packed work for window {packed.window} does not match the estimate's causal window "
                             f"{window} (packed documents are modelled for causal attention)")
        # the packed work's own transport: its flops already count the window, the neighbour exchange its keys
        ww = WindowWork(1.0, packed.dense, packed.messages, packed.key_tokens)
        tf, rf = packed.token_fraction, packed.ring_fraction if packed.dense else 1.0
        work = dataclasses.replace(work, fwd_flops=work.fwd_flops * packed.flops_fraction,
                                   kv_bytes=work.kv_bytes * rf, dkv_bytes=work.dkv_bytes * rf,
                                   s_ctx_tokens=work.s_ctx_tokens * rf, a2a_peer_bytes=work.a2a_peer_bytes * tf,
                                   a2a_local_bytes=work.a2a_local_bytes * tf,
                                   merge_fwd_bytes=work.merge_fwd_bytes * tf, merge_bwd_bytes=work.merge_bwd_bytes * tf)
        local_only = cp > 1 and packed.ring_tokens == 0            # the op skips the ring: one local block
    links = link_map(hp, cp, w, placement, parallel.tp, cluster.gpus_per_node, parallel.gpus)
    attn_rate = cluster.peak_tflops * 1e12 * cluster.attn_efficiency
    hbm, lat = cluster.hbm_gbps * GB, cluster.step_latency_us * 1e-6
    kernel = work.fwd_flops / cp / attn_rate                          # one step's forward kernel (zigzag: equal)
    merge = cp > 1                                                    # a single block needs no merge
    dense_rate = cluster.peak_tflops * 1e12 * cluster.dense_efficiency
    expand = work.expand_flops * ww.fraction / dense_rate             # the latent ring's up-projection per step
    tc = kernel + lat + (work.merge_fwd_bytes / hbm if merge else 0.0) + expand
    tcb = BWD_FACTOR * kernel + lat + (work.merge_bwd_bytes / hbm if merge else 0.0) + 3 * expand
    # One direction's all-to-alls: the transfer, plus permuting the tensors into and out of the buffers
    # (read + write each, twice) and the fixed latency; nothing when hp == 1.
    a2a_one = 0.0
    if hp > 1:
        a2a_one = path_time(links.a2a, work.a2a_peer_bytes, cluster, "a2a") + 4 * work.a2a_local_bytes / hbm + lat
    if local_only:
        tc, tcb = cp * kernel + lat, cp * BWD_FACTOR * kernel + lat
        fwd, bwd, ring_serial = tc, tcb, 0.0
        intra, inter, nic = traffic(work, links, cluster, hp, cp, w)
    elif ww.dense:
        fwd, bwd, ring_serial = ring_times(work, links, cluster, cp, w, tc, tcb)
        intra, inter, nic = traffic(work, links, cluster, hp, cp, w)
    else:
        ring_links = link_map(hp, cp, cp, placement, parallel.tp, cluster.gpus_per_node, parallel.gpus)
        fwd, bwd, ring_serial, msg = neighbour_times(work, ww, ring_links, cluster, cp, tc, tcb)
        intra, inter, nic = traffic(dataclasses.replace(work, kv_bytes=0.0, dkv_bytes=0.0), links, cluster, hp, cp, w)
        c = worst_class(ring_links.inner, msg, cluster)
        for peer_bytes, times in ((msg, 2 * ww.messages), (msg * dkv_elem / BF16, ww.messages)):
            intra += times * c.intra_peers * peer_bytes
            inter += times * c.inter_peers * peer_bytes
            nic += times * c.inter_peers * peer_bytes * max(c.node_flows, cluster.nics_per_node) / cluster.nics_per_node
    compute = (tc + tcb) if local_only else cp * (tc + tcb)
    time = 2 * a2a_one + fwd + bwd
    mem = memory_breakdown(model, parallel, hp, cp, w, seq, dkv_elem, kv_heads, mla_ring, packed)

    # Whole model (6*N*tokens for the matmuls; attention as model FLOPs, forward + 2x backward, causal halved).
    B, S, CP, tp = parallel.micro_batch, seq, hp * cp, parallel.tp
    group = tp * CP                                          # GPUs sharing one micro-batch's layer work
    slots = 1.0 if packed is None else packed.token_fraction           # padding slots run the linear layers too
    # (the latent ring up-projects K/V inside attention, in the ring steps above, instead of in the layer)
    dense_layer = (6.0 * model.layer_params() * B * S / group - 3.0 * work.kv_up_flops) / dense_rate * slots
    logits = 6.0 * model.vocab * model.hidden * B * S / group / dense_rate * slots
    step = model.layers * (time + dense_layer) + logits
    attn_model_flops = (3.0 * 2.0 * B * S * S * model.heads * (model.qk_dim + model.v_dim) * (0.5 if causal else 1.0)
                        * ww.fraction)
    if packed is not None:
        attn_model_flops *= packed.useful_fraction                    # only pairs within a document count
    model_flops = 6.0 * model.matmul_params() * B * S + model.layers * attn_model_flops
    mfu = model_flops / group / step / (cluster.peak_tflops * 1e12)
    return Estimate(time_s=time, compute_s=compute, kernel_s=(1.0 + BWD_FACTOR) * work.fwd_flops / attn_rate,
                    a2a_s=2 * a2a_one, ring_exposed_s=fwd + bwd - compute,
                    comm_total_s=2 * a2a_one + ring_serial, intra_bytes=intra, inter_bytes=inter,
                    inter_bytes_nic=nic, memory_gb=mem.total("none") / GB,
                    activation_gb=mem.activations("none") / GB, step_s=step,
                    tokens_per_gpu_s=B * S / group / step, mfu=mfu, work=work, links=links,
                    recompute="none", recompute_s=0.0, attn_fwd_s=a2a_one + fwd, dense_layer_s=dense_layer,
                    layers=model.layers, memory=mem, neighbour_exchange=not ww.dense)
