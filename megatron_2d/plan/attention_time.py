"""Per-layer attention time and traffic of one context-parallel layout: the work of one rank (FLOPs, message
sizes), the time of each link path, the (double) ring and the neighbour exchange replayed with modelled times, and
the bytes each rank sends.

Notation (per TP rank; every quantity is for one transformer layer and one rank unless it says otherwise)
    B        micro-batch size (sequences)
    S        sequence length (tokens of one sequence, the whole CP group together)
    H, Hkv   query / key-value heads of the model;  Ht = H/TP, Hkvt = Hkv/TP on one TP rank
    d        head dimension = D/H;  D = hidden size;  F = MLP size;  V = vocabulary
    dk, dv   query/key and value head dims (d and d; MLA: dn + dr and dv, e.g. 192 and 128)
    r, dr    MLA's kv_lora_rank and rope dim: the latent ring carries r + dr values per token
    CP       context-parallel size = hp * cp
    hp       head-parallel size (all-to-all group);  cp  context size (ring length);  w  inner ring size
    nw       inner rings = cp / w (outer ring length)
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

from collections import Counter
from dataclasses import dataclass

from ..layout.choices import DKV_COMM_DTYPES, DkvCommDtype, MlaRing
from ..layout.heads import replicated_kv_heads
from ..layout.ring_schedule import double_ring_events, final_hop_link, replay
from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .link_classes import LinkClass, LinkMap
from .links import overlapped
from .windows import WindowWork

BF16 = 2  # bytes per element of activations, K/V and the all-to-all tensors (bf16 training)
FP32 = 4  # bytes per element of fp32 tensors (the ring's dK/dV accumulators, softmax lse, logits)
RIDER_BYTES = {DkvCommDtype.ACCUMULATOR: FP32, DkvCommDtype.INPUT: BF16}
"""Bytes per element of the dK/dV partials that travel a ring in backward, by the op's ``dkv_comm_dtype``
(:data:`megatron_2d.layout.choices.DKV_COMM_DTYPES`) in bf16 training: the accumulator dtype (fp32, the op's default) or
the input dtype (bf16: Transformer Engine's rings, and the op with ``--cp-2d-dkv-comm-dtype input``)."""
assert tuple(RIDER_BYTES) == DKV_COMM_DTYPES
HEAD_EXCHANGE_COPIES = 2
"""Copies of the data one direction of the op's head all-to-all makes on each rank: into the send buffer and out of
the receive buffer (:mod:`megatron_2d.head_all_to_all`, on every backend and batch size)."""
MAX_LOGIT_SCORE_BYTES = 2 * BF16
"""HBM bytes per score of the op's separate max-logit pass (a kernel without it in its launch, QK-clip): each tile of
q k^T scores is written once and read once by the amax, in bf16 on CUDA (:mod:`megatron_2d.kernels.max_logit`)."""
MAX_LOGIT_REDUCTIONS = 2
"""All-reduces of the max logit per layer and forward: over the head group and over the context group (a few
hundred bytes each: their latency)."""
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
    """Bytes of q, k, v and out on one rank before/after the all-to-all (one direction), each copied
    :data:`HEAD_EXCHANGE_COPIES` times (into the send buffer and out of the receive buffer)."""
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


def layer_work(
    model: ModelSpec,
    parallel: ParallelSpec,
    hp: int,
    cp: int,
    seq: int,
    causal: bool = True,
    dkv_bytes_per_elem: int = FP32,
    kv_heads: int | None = None,
    mla_ring: str | None = None,
) -> LayerWork:
    """Work and message sizes of one layer on one rank for head-parallel size ``hp`` and context size ``cp``.

    ``dkv_bytes_per_elem``: bytes per element of the dK/dV partials on the ring (:data:`RIDER_BYTES`: 4 for the
    accumulator dtype, the op's default; 2 for the input dtype, Transformer Engine's). ``kv_heads``: K/V heads per
    TP rank after repetition (None: L = lcm(Hkvt, hp), our replication; DeepSpeed-Ulysses repeats them to all Ht
    query heads). ``mla_ring``: "latent" for an MLA model whose 2D ring carries the latent (None / "expanded":
    per-head K/V)."""
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
    if mla_ring == MlaRing.LATENT:
        m = model.mla
        # all-to-all of q and out (1/hp of each to each peer), all-gather of the whole latent to each peer
        a2a_peer = BF16 * B * s_loc * (Ht * (dk + dv) / hp + m.latent_width)
        kv = BF16 * B * s_ctx * m.latent_width
        keys = 1.0 if not causal or cp == 1 else (1 + 0.75 * (cp - 1)) / cp
        expand = 2.0 * B * s_ctx * keys * m.kv_lora_rank * q_heads * (m.qk_head_dim + m.v_head_dim)
        kv_up = 2.0 * B * s_loc * m.kv_lora_rank * Ht * (m.qk_head_dim + m.v_head_dim)
        return LayerWork(
            fwd_flops=fwd,
            a2a_peer_bytes=a2a_peer,
            kv_bytes=kv,
            dkv_bytes=kv * dkv_bytes_per_elem / BF16,
            kv_heads_per_rank=int(q_heads),
            a2a_local_bytes=a2a_peer * hp,
            merge_fwd_bytes=3 * FP32 * B * s_ctx * q_heads * dv,
            # dQ, the block's per-head dK/dV partials (gathered before the up-projection's backward)
            # and its latent gradient
            merge_bwd_bytes=3 * FP32 * B * s_ctx * (q_heads * (2 * dk + dv) + m.latent_width),
            s_ctx_tokens=s_ctx,
            expand_flops=expand,
            kv_up_flops=kv_up,
        )
    # All-to-all, forward: q (Ht heads), k and v (L heads, after replication), and the output (Ht heads), each
    # s_loc tokens; a rank keeps 1/hp of each and sends 1/hp to each of its hp-1 peers. Backward: dout, dq, dk, dv.
    a2a_peer = BF16 * B * s_loc * (Ht + L) * (dk + dv) / hp
    kv = BF16 * B * s_ctx * (L // hp) * (dk + dv)
    merge_f = 3 * FP32 * B * s_ctx * q_heads * dv
    merge_b = 3 * FP32 * B * s_ctx * (q_heads * dk + (L // hp) * (dk + dv))
    return LayerWork(
        fwd_flops=fwd,
        a2a_peer_bytes=a2a_peer,
        kv_bytes=kv,
        dkv_bytes=kv * dkv_bytes_per_elem / BF16,
        kv_heads_per_rank=L // hp,
        a2a_local_bytes=a2a_peer * hp,
        merge_fwd_bytes=merge_f,
        merge_bwd_bytes=merge_b,
        s_ctx_tokens=s_ctx,
    )


def max_logit_pass_s(step_flops: float, qk_dim: int, v_dim: int, cluster: ClusterSpec) -> float:
    """Seconds of the op's separate max-logit pass over one ring step whose attention kernel does ``step_flops``
    forward FLOPs (2 (dk + dv) per visible pair): q k^T again for those pairs (2 dk FLOPs each, at the dense GEMM
    rate) and each score written and read once (:data:`MAX_LOGIT_SCORE_BYTES`, HBM); 0 for no pairs."""
    pairs = step_flops / (2.0 * (qk_dim + v_dim))
    gemm = 2.0 * qk_dim * pairs / (cluster.peak_tflops * 1e12 * cluster.dense_efficiency)
    return gemm + pairs * MAX_LOGIT_SCORE_BYTES / (cluster.hbm_gbps * GB)


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
    inter = (
        c.inter_peers * peer_bytes / (flow_gbps(cluster, c.node_flows) * eff.factor("network", kind) * GB)
        if c.inter_peers
        else 0.0
    )
    return max(intra, inter)


def path_time(classes: tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec, kind: str = "p2p") -> float:
    """The slowest rank's time on a path: collectives and ring steps wait for the slowest member."""
    return max((class_time(c, peer_bytes, cluster, kind) for c in classes), default=0.0)


def worst_class(
    classes: tuple[LinkClass, ...], peer_bytes: float, cluster: ClusterSpec, kind: str = "p2p"
) -> LinkClass:
    """The class that sets ``path_time`` (an all-zero class when the path is unused)."""
    return max(classes, key=lambda c: class_time(c, peer_bytes, cluster, kind), default=LinkClass(0, 0, 0))


# -- the head all-to-all, the ring and the neighbour exchange ---------------------------------------------------


def head_exchange_time(work: LayerWork, links: LinkMap, cluster: ClusterSpec) -> float:
    """Seconds of one direction's head all-to-all (hp > 1): the transfer on the slowest rank's links, the op's
    :data:`HEAD_EXCHANGE_COPIES` copies, each read and written once in HBM, and the fixed latency."""
    hbm, lat = cluster.hbm_gbps * GB, cluster.step_latency_us * 1e-6
    copies = 2 * HEAD_EXCHANGE_COPIES * work.a2a_local_bytes / hbm  # each copy reads and writes once
    return path_time(links.a2a, work.a2a_peer_bytes, cluster, "a2a") + copies + lat


def ring_times(work: LayerWork, links: LinkMap, cluster: ClusterSpec, cp: int, w: int, tc: float, tcb: float):
    """(forward, backward, serialised comm) seconds of the (double) ring; ``tc``/``tcb`` are one step's work.

    Not a closed form: the op's own schedule (:func:`megatron_2d.layout.ring_schedule.double_ring_events`, the events
    the ring loop executes) is replayed with modelled times: a compute takes ``tc`` (``tcb``), a K/V (dK/dV) transfer
    takes its path time on the inner or outer links, transfers on one link go one after another, and a wait
    blocks until its transfer is done. Forward reduces to the paper's Double-Ring formula
        R = w*Tc + (w-1)*relu(T_in(kv) - Tc),   fwd = nw*R + (nw-1)*relu(T_out(kv) - R);
    backward follows whatever the loop does (riders posted after each step, each round's rider added to the one
    carried over the outer ring a round earlier, the last hop to the owner exposed); dK/dV riders are
    ``work.dkv_bytes`` (fp32 for ours, bf16 for Transformer Engine).
    """
    kv, dkv = work.kv_bytes, work.dkv_bytes
    last = final_hop_link(cp, w)  # the last hop (ring, slot) -> (ring + 1, slot + 1)
    transfer = {
        "inner_kv": path_time(links.inner, kv, cluster),
        "outer_kv": path_time(links.outer, kv, cluster),
        "inner_dkv": path_time(links.inner, dkv, cluster),
        "outer_dkv": path_time(links.outer, dkv, cluster),
        "final_dkv": path_time(getattr(links, last), dkv, cluster),
    }
    link_of = {"inner_kv": "inner", "inner_dkv": "inner", "outer_kv": "outer", "outer_dkv": "outer", "final_dkv": last}
    forward, backward = double_ring_events(cp, w, False), double_ring_events(cp, w, True)
    fwd = replay(forward, tc, transfer, link_of, cluster.links.interference)
    bwd = replay(backward, tcb, transfer, link_of, cluster.links.interference)
    serial = sum(transfer[e.channel] for e in forward + backward if e.kind.startswith("post_"))
    return fwd, bwd, serial


def neighbour_times(
    work: LayerWork, ww: WindowWork, ring_links: LinkMap, cluster: ClusterSpec, cp: int, tc: float, tcb: float
):
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

    def t_msg(b: float) -> float:  # one ring message of b bytes
        return path_time(ring_links.inner, b, cluster)

    t, tb = cp * tc / (m + 1), cp * tcb / (m + 1)
    x = cluster.links.interference
    fwd = t + m * overlapped(t, t_msg(kv), x)
    bwd = tb + m * overlapped(tb, t_msg(kv + dkv), x) + t_msg(dkv)
    return fwd, bwd, m * (2 * t_msg(kv) + t_msg(dkv)), kv


# -- traffic ----------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes one rank sends, added up send by send: over NVLink (``intra``), over the network (``inter``), and the
    network bytes scaled by max(flows, NICs)/NICs (``nic``: what one NIC's worth of bandwidth must carry)."""

    cluster: ClusterSpec
    intra: float = 0.0
    inter: float = 0.0
    nic: float = 0.0

    def add(self, classes: tuple[LinkClass, ...], peer_bytes: float, times: float, kind: str = "p2p") -> None:
        """``times`` sends of ``peer_bytes`` to each peer on a path, by the path's slowest rank class."""
        c = worst_class(classes, peer_bytes, self.cluster, kind)
        nics = self.cluster.nics_per_node
        self.intra += times * c.intra_peers * peer_bytes
        self.inter += times * c.inter_peers * peer_bytes
        self.nic += times * c.inter_peers * peer_bytes * max(c.node_flows, nics) / nics


def traffic(work: LayerWork, links: LinkMap, cluster: ClusterSpec, hp: int, cp: int, w: int) -> Traffic:
    """The bytes one rank sends per layer, forward + backward, through the all-to-all and the (double) ring.

    Message counts: all-to-all 2 x (hp-1) per-peer chunks; the ring's K/V and dK/dV sends are counted off the
    schedule the loop runs (:func:`megatron_2d.layout.ring_schedule.double_ring_events`, forward and backward): K/V
    nw*(w-1) inner and nw-1 outer sends in each direction, dK/dV cp-1 sends (the last hop on the outer links
    unless w = cp).
    """
    sent = Traffic(cluster)
    sends = Counter(
        e.channel
        for e in double_ring_events(cp, w, False) + double_ring_events(cp, w, True)
        if e.kind.startswith("post_")
    )
    sent.add(links.a2a, work.a2a_peer_bytes, 2, "a2a")
    sent.add(links.inner, work.kv_bytes, sends["inner_kv"])
    sent.add(links.outer, work.kv_bytes, sends["outer_kv"])
    sent.add(links.inner, work.dkv_bytes, sends["inner_dkv"])
    sent.add(links.outer, work.dkv_bytes, sends["outer_dkv"])
    sent.add(getattr(links, final_hop_link(cp, w)), work.dkv_bytes, sends["final_dkv"])
    return sent
