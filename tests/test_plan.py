"""Tests of the performance model and layout planner (megatron_2d.plan): formulas on hand-computed cases,
sanity properties, feasibility, errors, and the CLI (text, --json, --plot)."""

import json

import pytest

from megatron_2d.layout import topology
from megatron_2d.layout.block_calls import block_pair_calls
from megatron_2d.plan import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ModelSpec,
    ParallelSpec,
    PlanError,
    Scheme,
    WorkCounts,
    calibrate,
    evaluate,
    fit_rates,
    get_cluster,
    get_model,
    layer_work,
    plan,
    replicated_kv_heads,
    work_counts,
)
from megatron_2d.plan.attention_time import flow_gbps, ring_times
from megatron_2d.plan.cli import main, parse_seq
from megatron_2d.plan.link_classes import LinkClass, LinkMap, link_map, peers
from megatron_2d.plan.links import IDEAL_LINKS
from megatron_2d.plan.memory import memory_bytes
from megatron_2d.sequence_sharding import zigzag_chunks

GQA, MHA = get_model("7B-GQA"), get_model("7B-MHA")
H100 = get_cluster("8xH100")
# An idealised cluster for hand computations: no per-step latency, effectively infinite HBM bandwidth.
IDEAL = H100.with_(step_latency_us=0.0, hbm_gbps=1e12)
K128 = 131072


# -- formulas on hand-computed cases ------------------------------------------------------------------------------


def test_layer_work_hand_computed():
    # 7B-GQA, S=128K, CP=64 as hp=8 x cp=8, TP=1, B=1. d = 4096/32 = 128, Ht = 32, Hkvt = 8, L = lcm(8, 8) = 8.
    # forward FLOPs per rank: 4 * S^2 * 32 * 128 / 64 / 2 (causal) = 4 * 17179869184 * 4096 / 128 = 2199023255552
    # K/V block: 2 (k, v) * 2 bytes * S/cp = 16384 tokens * L/hp = 1 head * 128 = 8388608 bytes; dK/dV fp32 = 2x
    # all-to-all per peer: 2 bytes * S/CP = 2048 tokens * 128 * (2*32 + 2*8) / hp = 41943040 / 8 = 5242880
    w = layer_work(GQA, ParallelSpec(gpus=64), hp=8, cp=8, seq=K128)
    assert w.fwd_flops == 2199023255552
    assert w.kv_bytes == 8388608 and w.dkv_bytes == 16777216
    assert w.a2a_peer_bytes == 5242880
    assert w.kv_heads_per_rank == 1


@pytest.mark.parametrize("hp", [1, 2, 4, 8, 16, 32])
def test_kv_bytes_match_paper_formula(hp):
    # Paper: K/V bytes per ring step (bf16) = max(H_kv, d_hp)/H * 4*S*D/d_sp; hp | 32 so lcm(8, hp) = max(8, hp).
    w = layer_work(GQA, ParallelSpec(gpus=64), hp=hp, cp=64 // hp, seq=K128)
    assert w.kv_bytes == max(8, hp) / 32 * 4 * K128 * 4096 / 64


def test_replicated_kv_heads():
    # lcm: 8 KV heads over hp=16 -> 16 (factor 2); hp=4 -> 8 (none); hp=3 -> 24 (factor 3, 8 heads per rank).
    assert replicated_kv_heads(8, 16) == 16
    assert replicated_kv_heads(8, 4) == 8
    assert replicated_kv_heads(8, 3) == 24


def test_flow_bandwidth_shares_nics():
    # 400 GB/s over 8 NICs: one flow gets one NIC (50 GB/s); 16 flows share all NICs (25 GB/s).
    assert flow_gbps(H100, 1) == 50.0
    assert flow_gbps(H100, 8) == 50.0
    assert flow_gbps(H100, 16) == 25.0


def test_ring_times_hand_computed():
    # NVLink 100 GB/s; network 400 GB/s per node over 8 NICs with 16 ring flows per node: 25 GB/s per flow.
    # kv = 0.1 GB: T_in(kv) = 1 ms, T_out(kv) = 4 ms; kv+dkv = 0.3 GB: T_in = 3, T_out = 12; dkv: T_in 2, T_out 8.
    # cp=8, w=4 -> nw=2; Tc = 0.5 ms, Tcb = 1.25 ms.
    # R   = 4*0.5 + 3*max(0, 1-0.5) = 3.5;      fwd = 2*3.5 + 1*max(0, 4-3.5) = 7.5 ms
    # bwd, replaying the loop's events by hand (ms; K/V and dK/dV share each link, one transfer at a time):
    #   round 0: kv hops end at 1, 2.25, 5.5; step 0 (own block) keeps its dK/dV home; riders leave after steps
    #            1-2 and end at 4.5, 7.5; step 3 (5.5-6.75) waits for the last at 7.5 and closes the round: the
    #            rider goes to the next inner ring (outer, 7.5-15.5; the outer K/V arrived at 4);
    #   round 1: kv hops end at 8.5, 11.75, 14.75; riders end at 10.75, 13.75, 16.75; step 3 (14.75-16) waits for
    #            the last at 16.75, adds the carried rider (arrived at 15.5) and sends the sum diagonally to its
    #            owner (outer link, 16.75-24.75, exposed) -> 24.75 ms
    # serial comm = 2*2*3*1 (kv inner) + 5*2 (dkv inner) + 2*1*4 (kv outer) + 2*8 (dkv outer + diagonal)
    #             = 12+10+8+16 = 46 ms
    cluster = H100.with_(nvlink_gbps=100.0, links=IDEAL_LINKS)  # nominal rates (tests/test_plan_links.py: factors)
    links = LinkMap(a2a=(), inner=(LinkClass(1, 0, 0),), outer=(LinkClass(0, 1, 16),))
    work = layer_work(GQA, ParallelSpec(gpus=64), hp=1, cp=64, seq=K128)
    work = type(work)(**{**work.__dict__, "kv_bytes": 1e8, "dkv_bytes": 2e8})
    fwd, bwd, serial = ring_times(work, links, cluster, cp=8, w=4, tc=0.5e-3, tcb=1.25e-3)
    assert fwd == pytest.approx(7.5e-3)
    assert bwd == pytest.approx(24.75e-3)
    assert serial == pytest.approx(46e-3)


def test_zigzag_steps_cost_half_a_block():
    # layer_work charges every one of a rank's cp ring steps fwd_flops / cp: half a (S/cp)^2 block. Count the
    # query-key pairs the op's own block calls (block_calls.block_pair_calls on the zigzag chunks of sequence_sharding)
    # computes at each step: every off-diagonal step is exactly that; the diagonal step adds the c diagonal
    # entries of its 2 causal chunks (2c(2c+1)/2 = (2c)^2/2 + c), which the model neglects.
    model = ModelSpec("one-head", layers=1, hidden=64, heads=1, kv_heads=1, ffn_hidden=64, vocab=64)
    for cp, c in ((4, 6), (8, 2), (3, 5)):
        S = 2 * cp * c
        per_step = layer_work(model, ParallelSpec(gpus=cp), hp=1, cp=cp, seq=S).fwd_flops / cp / (4 * 64)
        assert per_step == (S / cp) ** 2 / 2
        for r in range(cp):
            for src in range(cp):
                calls = block_pair_calls(zigzag_chunks(r, cp), zigzag_chunks(src, cp), c, causal=True)
                pairs = 0
                for x in calls:
                    rows, keys = x.q_end - x.q_start, x.k_end - x.k_start
                    assert x.band is None or (x.band.lo, x.band.hi, rows) == (None, 0, keys)  # full or causal
                    pairs += rows * keys if x.band is None else rows * (rows + 1) // 2
                assert pairs == per_step + (c if src == r else 0), (cp, r, src)


def test_traffic_hand_computed():
    # 7B-GQA, 128K tokens, 64 GPUs of 8 per node, B=1. K/V block = 8388608 bytes (bf16), dK/dV 16777216 (fp32)
    # for both layouts below (L/hp * S/cp = 1 * 16384 = 8 * 2048 head-tokens); all-to-all 5242880 per peer.
    par = ParallelSpec(gpus=64)
    # hp=8 x cp=8, w=8, head_first: the all-to-all inside a node (7 NVLink peers), one ring across nodes, no outer
    # ring. NVLink: 2 directions x 7 peers x 5242880 = 73400320. Network: K/V 2 x 7 sends + dK/dV 7 sends
    # = 14 x 8388608 + 7 x 16777216 = 117440512 + 117440512 = 234881024.
    e = evaluate(Scheme("2d", 8, 8, 8, "head_first"), GQA, H100, par, K128).estimate
    assert (e.intra_bytes, e.inter_bytes) == (73400320, 234881024)
    # hp=1 x cp=64, w=8 (Double-Ring): 8 ranks per inner ring inside nodes, the outer ring across nodes (nw=8).
    # NVLink: K/V 2 x 8 x 7 = 112 sends + dK/dV 7 x 7 + 6 = 55 sends (round 0's rider starts at step 1: the own
    # block's dK/dV stays home) = 939524096 + 922746880 = 1862270976.
    # Network: K/V 2 x 7 = 14 sends + dK/dV 7 outer + 1 diagonal = 8 sends = 117440512 + 134217728 = 251658240.
    e = evaluate(Scheme("2d", 1, 64, 8, "head_first"), GQA, H100, par, K128).estimate
    assert (e.intra_bytes, e.inter_bytes) == (1862270976, 251658240)
    # 8 ring flows per node over 8 NICs: one NIC's worth per flow, so the NIC-normalised bytes are the same
    assert e.inter_bytes_nic == 251658240


def test_memory_hand_computed():
    # A small GQA model on 8 GPUs as hp=2 x cp=4, w=2 (nw=2), S=4096, B=1, TP=PP=DP=1: D=512, H=8, Hkv=2, d=64,
    # F=1024 (gated: fc1 out 2F), V=1000. L = lcm(2, 2) = 2 K/V heads, s_loc = 4096/8 = 512 tokens per rank.
    model = ModelSpec("small", layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, vocab=1000)
    par = ParallelSpec(gpus=8)
    # activations per token: 2 * ((4D + 2F + F) + (H + 2L + 2H) d) + 4H = 2 * (5120 + 1792) + 32 = 13856 bytes,
    # x 512 tokens x 2 layers = 14188544
    activations = 13856 * 512 * 2
    logits = 4 * 512 * 1000  # fp32 logits of the local tokens
    # K/V block: 2 bytes x 2 (k, v) x S/cp = 1024 tokens x L/hp = 1 head x 64 = 262144; dK/dV fp32: 524288.
    # Two of each in flight on the inner ring plus one of each for the outer ring (nw = 2 > 1): 3 x 786432.
    blocks = 3 * (262144 + 524288)
    staging = 2 * 512 * 64 * (2 * 8 + 2 * 2)  # one all-to-all copy of q, k, v, out
    # parameters: per layer Q,O 2*512*512 + K,V 2*512*128 + MLP 3*512*1024 = 2228224; 2 layers + output layer
    # + embedding 2 * 512000: 5480448. bf16 weights + fp32 grads (6 bytes) + 12 bytes of optimizer state / 8.
    params = 2 * 2228224 + 2 * 1000 * 512
    states = params * 6 + params * 12 // 8
    total, act = memory_bytes(model, par, hp=2, cp=4, w=2, seq=4096)
    assert act == activations
    assert total == activations + logits + blocks + staging + states == 61009920
    e = evaluate(Scheme("2d", 2, 4, 2, "context_first"), model, H100, par, 4096).estimate
    assert e.memory_gb == 61009920 / 1e9 and e.activation_gb == activations / 1e9
    # a single ring (w = cp): no outer-ring blocks
    assert memory_bytes(model, par, hp=2, cp=4, w=4, seq=4096)[0] == total - (262144 + 524288)


# -- link classes ------------------------------------------------------------------------------------------------


def test_link_map_hand_cases():
    # 64 GPUs, 8 per node, TP=1. head_first hp=8: a head group is one node (7 NVLink peers); the ring connects
    # ranks 8 apart, so every rank's ring peer is on another node: 8 flows per node.
    lm = link_map(8, 8, 8, "head_first", 1, 8, 64)
    assert lm.a2a == (LinkClass(7, 0, 0),)
    assert lm.inner == (LinkClass(0, 1, 8),) and lm.outer == ()
    # context_first: the ring is one node (NVLink); the all-to-all goes to 7 other nodes from all 8 GPUs.
    lm = link_map(8, 8, 8, "context_first", 1, 8, 64)
    assert lm.a2a == (LinkClass(0, 7, 8),) and lm.inner == (LinkClass(1, 0, 0),)
    # Plain ring of 64: 7 ranks per node send on NVLink, 1 crosses to the next node (1 flow: one NIC's worth).
    lm = link_map(1, 64, 64, "head_first", 1, 8, 64)
    assert set(lm.inner) == {LinkClass(1, 0, 0), LinkClass(0, 1, 1)}
    # Double ring hp=1, w=8: inner rings inside nodes; the outer ring moves all 8 ranks of a node at once.
    lm = link_map(1, 64, 8, "head_first", 1, 8, 64)
    assert lm.inner == (LinkClass(1, 0, 0),) and lm.outer == (LinkClass(0, 1, 8),)
    # TP=2, CP=32: CP ranks are 2 apart, a node holds 4 ranks of each of two CP groups: 2 ring flows per node.
    lm = link_map(1, 32, 32, "head_first", 2, 8, 64)
    assert set(lm.inner) == {LinkClass(1, 0, 0), LinkClass(0, 1, 2)}


def _brute_force_peers(i, hp, cp, w, placement):
    # Independent enumeration: build the (hr, cr) grid, then read off groups.
    grid = {}
    for hr in range(hp):
        for cr in range(cp):
            grid[(hr, cr)] = cr * hp + hr if placement == "head_first" else hr * cp + cr
    ((hr, cr),) = [k for k, v in grid.items() if v == i]
    inner = [grid[(hr, x)] for x in range(cp) if x // w == cr // w]
    outer = [grid[(hr, x)] for x in range(cp) if x % w == cr % w]
    nxt = lambda ring: ring[(ring.index(i) + 1) % len(ring)]  # noqa: E731
    return {
        "a2a": sorted(grid[(h, cr)] for h in range(hp) if h != hr),
        "inner": [nxt(inner)] if w > 1 else [],
        "outer": [nxt(outer)] if cp // w > 1 else [],
    }


@pytest.mark.parametrize("hp,cp,w", [(2, 8, 4), (4, 4, 2), (1, 16, 4), (8, 2, 1), (3, 6, 3)])
@pytest.mark.parametrize("placement", ["head_first", "context_first"])
def test_peers_match_brute_force(hp, cp, w, placement):
    for i in range(hp * cp):
        got = peers(i, hp, cp, w, placement)
        assert {**got, "a2a": sorted(got["a2a"])} == _brute_force_peers(i, hp, cp, w, placement)


def test_placement_matches_megatron_2d_topology():
    # The planner's rank maps must agree with the implementation's (megatron_2d.layout.topology), when importable.
    for hp, cp, w in [(2, 4, 2), (4, 2, 1), (2, 8, 4)]:
        for placement in ("head_first", "context_first"):
            lay = topology.Layout2D(cp_size=hp * cp, head_parallel_size=hp, inner_ring_size=w, placement=placement)
            ranks = list(range(hp * cp))
            for i in ranks:
                p = peers(i, hp, cp, w, placement)
                hg = next(g for g in lay.head_groups(ranks) if i in g)
                assert sorted(p["a2a"]) == sorted(set(hg) - {i})
                if w > 1:
                    ring = next(g for g in lay.inner_ring_groups(ranks) if i in g)
                    assert p["inner"] == [ring[(ring.index(i) + 1) % len(ring)]]
                if cp // w > 1:
                    ring = next(g for g in lay.outer_ring_groups(ranks) if i in g)
                    assert p["outer"] == [ring[(ring.index(i) + 1) % len(ring)]]


# -- sanity properties -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [GQA, MHA])
def test_more_bandwidth_is_never_slower(model):
    par = ParallelSpec(gpus=64)
    base = {c.scheme: c.estimate.time_s for c in plan(model, H100, par, K128) if c.feasible}
    for faster in (
        H100.with_(nvlink_gbps=900.0),
        H100.with_(net_gbps_per_node=800.0),
        H100.with_(nics_per_node=4),
        H100.with_(hbm_gbps=6000.0),
    ):
        # (4 NICs of 100 GB/s each instead of 8 of 50: each flow gets more when fewer than 8 flows leave a node)
        for c in plan(model, faster, par, K128):
            if c.feasible:
                assert c.estimate.time_s <= base[c.scheme] * (1 + 1e-12), c.scheme


def test_longer_sequences_move_toward_compute_bound():
    par = ParallelSpec(gpus=64)
    seqs = [1 << k for k in range(15, 21)]
    ratios = {}
    for s in seqs:
        for c in plan(GQA, H100, par, s):
            if c.feasible and c.estimate.comm_total_s > 0:
                ratios.setdefault(c.scheme, []).append(c.estimate.comm_total_s / c.estimate.compute_s)
    assert ratios
    for layout, r in ratios.items():
        assert len(r) == len(seqs)
        assert all(b < a for a, b in zip(r, r[1:])), (layout, r)


@pytest.mark.parametrize("tp,gpus,seq", [(1, 64, K128), (2, 32, 65536), (1, 16, 1 << 20)])
def test_2d_with_hp1_single_ring_equals_p2p_when_dkv_dtypes_match(tp, gpus, seq):
    # Transformer Engine's p2p sends dK/dV in bf16; ours in fp32 by default. With the op's input-dtype riders the
    # same ring costs the same; with the default (fp32) it is never faster and sends more bytes.
    par = ParallelSpec(gpus=gpus, tp=tp)
    CP = par.cp_size
    p2p = evaluate(Scheme("p2p", 1, CP, CP), GQA, H100, par, seq, recompute="none").estimate
    same = evaluate(Scheme("2d", 1, CP, CP), GQA, H100, par, seq, recompute="none", dkv_comm_dtype="input").estimate
    assert same.time_s == p2p.time_s and same.comm_total_s == p2p.comm_total_s
    ours = evaluate(Scheme("2d", 1, CP, CP), GQA, H100, par, seq, recompute="none").estimate
    assert ours.time_s >= p2p.time_s and ours.intra_bytes + ours.inter_bytes > p2p.intra_bytes + p2p.inter_bytes


def test_plain_ring_at_64_gpus_is_comm_bound_like_the_paper_reports():
    # field-and-peers.md: at 64 GPUs, 128K tokens, GQA, ring communication ~1.8x the compute.
    e = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, ParallelSpec(gpus=64), K128).estimate
    assert 1.2 < e.comm_total_s / e.compute_s < 2.5


def test_ideal_cluster_time_is_compute_plus_exposed_parts():
    # With everything hidden (huge bandwidths, no latency, no merge cost), 2D time == attention kernels alone.
    fast = IDEAL.with_(nvlink_gbps=1e9, net_gbps_per_node=1e9)
    for c in plan(GQA, fast, ParallelSpec(gpus=64), K128):
        if c.feasible:
            assert c.estimate.time_s == pytest.approx(c.estimate.kernel_s, rel=1e-6)


# -- feasibility -------------------------------------------------------------------------------------------------


def _reason(layout, model=GQA, gpus=64, seq=K128, tp=1):
    c = evaluate(layout, model, H100, ParallelSpec(gpus=gpus, tp=tp), seq)
    assert not c.feasible and c.estimate is None and c.reason
    return c.reason


def test_infeasible_layouts_have_reasons():
    # Baselines refuse hp beyond the KV heads (no replication); 2d replicates and stays feasible.
    assert "KV heads" in _reason(Scheme("a2a", 16, 1, 1), gpus=16)
    assert "KV heads" in _reason(Scheme("a2a+p2p", 16, 4, 4))
    assert evaluate(Scheme("2d", 16, 1, 1), GQA, H100, ParallelSpec(gpus=16), K128).feasible
    # hp beyond the query heads
    assert "query heads" in _reason(Scheme("a2a", 64, 1, 1))
    # w not dividing cp
    assert "inner ring size 3 does not divide the context size cp = CP/hp = 64/8 = 8" in _reason(Scheme("2d", 8, 8, 3))
    # hp not dividing the heads (24 heads, CP=16)
    m24 = ModelSpec("24h", layers=4, hidden=3072, heads=24, kv_heads=8, ffn_hidden=8192, vocab=32000)
    assert "does not divide the 24 query heads" in _reason(Scheme("2d", 16, 1, 1), model=m24, gpus=16)
    # hp*cp must be the CP size; sequence divisibility; bad placement
    assert "!= CP=64" in _reason(Scheme("2d", 4, 8, 8))
    assert "2*CP" in _reason(Scheme("p2p", 1, 64, 64), seq=K128 + 64)
    assert "placement" in _reason(Scheme("2d", 8, 8, 8, "diagonal"))


def test_plan_lists_infeasible_baselines_last():
    cands = plan(GQA, H100, ParallelSpec(gpus=64), K128)
    flags = [c.feasible for c in cands]
    assert flags == sorted(flags, reverse=True)
    kinds = {c.kind for c in cands if not c.feasible}
    assert {"a2a", "ds-ulysses", "a2a+p2p", "2d"} <= kinds
    steps = [round(c.estimate.step_s, 9) for c in cands if c.feasible]  # ties ranked at 1e-9 s
    assert steps == sorted(steps)


# -- bad input ---------------------------------------------------------------------------------------------------


def test_errors_name_the_value_and_what_is_valid():
    with pytest.raises(PlanError, match=r"unknown model preset 'llama'.*7B-MHA, 7B-GQA"):
        get_model("llama")
    with pytest.raises(PlanError, match=r"8xH100, 8xH200, 8xA100"):
        get_cluster("tpu")
    with pytest.raises(PlanError, match=r"gpus=64 is not divisible by tp\*pp\*dp=3\*1\*1"):
        ParallelSpec(gpus=64, tp=3)
    with pytest.raises(PlanError, match=r"tp\*pp\*cp=1\*1\*48.*valid CP sizes"):
        ParallelSpec(gpus=64, cp=48)
    with pytest.raises(PlanError, match=r"tp=16 must divide heads=32 and kv_heads=8"):
        plan(GQA, H100, ParallelSpec(gpus=64, tp=16), K128)
    with pytest.raises(PlanError, match=r"pp=3 does not divide layers=32"):
        plan(GQA, H100, ParallelSpec(gpus=48, pp=3), K128)
    with pytest.raises(PlanError, match=r"attn_efficiency must be in \(0, 1\]"):
        H100.with_(attn_efficiency=1.5)
    with pytest.raises(PlanError, match=r"kv_heads=5 must divide heads=32"):
        ModelSpec("x", layers=1, hidden=4096, heads=32, kv_heads=5, ffn_hidden=1, vocab=1)


def test_cli_errors_exit_with_message(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--model", "nope", "--gpus", "64", "--seq", "128K"])
    assert ei.value.code == 2
    assert "known model presets: 7B-MHA, 7B-GQA" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--gpus", "64", "--seq", "12x"])
    assert "not a positive integer like 131072" in capsys.readouterr().err


def test_parse_seq():
    assert parse_seq("128K") == K128 and parse_seq("1M") == 1 << 20 and parse_seq("4096") == 4096


# -- CLI ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODEL_PRESETS))
@pytest.mark.parametrize("cluster", list(CLUSTER_PRESETS))
def test_cli_runs_for_presets(model, cluster, capsys):
    sizes = {"70B-GQA": ["--tp", "8", "--pp", "2", "--gpus", "256"], "DSV3-MLA": ["--tp", "8", "--gpus", "64"]}.get(
        model, ["--gpus", "32"]
    )
    assert main(["--model", model, "--cluster", cluster, *sizes, "--seq", "64K", "--top", "5"]) == 0
    out = capsys.readouterr().out
    cp = {"70B-GQA": 16, "DSV3-MLA": 8}.get(model, 32)
    assert "Recommended:" in out and f"--context-parallel-size {cp}" in out


def test_cli_json_has_fields(capsys):
    main(["--model", "7B-GQA", "--cluster", "8xH100", "--gpus", "64", "--seq", "128K", "--json"])
    rows = json.loads(capsys.readouterr().out)
    need = {
        "kind",
        "hp",
        "cp",
        "w",
        "placement",
        "time_ms",
        "mfu",
        "comm_ms",
        "compute_ms",
        "memory_gb",
        "feasible",
        "reason",
        "flags",
    }
    assert rows and all(need <= set(r) for r in rows)
    ok = [r for r in rows if r["feasible"]]
    assert ok[0]["step_ms"] == min(r["step_ms"] for r in ok)
    assert all(r["time_ms"] is None and r["reason"] for r in rows if not r["feasible"] and r["fits_memory"] is None)
    assert {r["kind"] for r in rows} == {"2d", "p2p", "a2a", "a2a+p2p", "ds-ulysses"}


def test_cli_flags_and_tp(capsys):
    main(["--model", "7B-MHA", "--gpus", "64", "--tp", "2", "--seq", "256K", "--json"])
    rows = json.loads(capsys.readouterr().out)
    p2p = next(r for r in rows if r["kind"] == "p2p")
    assert p2p["flags"].startswith("--tensor-model-parallel-size 2 --context-parallel-size 32 --cp-comm-type p2p ")
    assert "--use-distributed-optimizer" in p2p["flags"]  # every row's memory option is on the line
    hier = next(r for r in rows if r["kind"] == "a2a+p2p" and r["hp"] == 4)
    assert "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 4 8" in hier["flags"]


def test_cli_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "plan.png"
    main(
        ["--model", "7B-GQA", "--gpus", "64", "--seq", "128K", "--plot", str(path), "--plot-seqs", "32K", "128K", "1M"]
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- calibration -------------------------------------------------------------------------------------------------


def test_fit_rates_recovers_known_rates():
    # t = flops/4e14 + nvl/3e11 + nic/4e10 on four independent samples: the fit is exact.
    truth = (4e14, 3e11, 4e10)
    counts = [WorkCounts(1e12, 0, 0), WorkCounts(2e12, 1e9, 0), WorkCounts(1e12, 0, 5e8), WorkCounts(3e12, 2e9, 1e9)]
    samples = [(c, c.flops / truth[0] + c.nvlink_bytes / truth[1] + c.nic_bytes / truth[2]) for c in counts]
    fit = fit_rates(samples)
    assert fit.flops_per_s == pytest.approx(truth[0])
    assert fit.nvlink_bytes_per_s == pytest.approx(truth[1])
    assert fit.nic_bytes_per_s == pytest.approx(truth[2])
    assert fit.rms_residual_s < 1e-9
    # only compute measured: the other rates stay unknown
    assert fit_rates(samples[:1]).nvlink_bytes_per_s is None


def test_calibrate_updates_cluster_figures():
    par = ParallelSpec(gpus=64)
    layouts = [
        Scheme("2d", 8, 8, 8, "head_first"),
        Scheme("2d", 8, 8, 8, "context_first"),
        Scheme("p2p", 1, 64, 64),
        Scheme("2d", 1, 64, 8),
    ]
    rate, nvl, nic = 3e14, 2e11, 3e10  # "measured" machine: 30% efficiency, slower links

    def measured(layout):
        wc = work_counts(layout, GQA, H100, par, K128)
        return wc.flops / rate + wc.nvlink_bytes / nvl + wc.nic_bytes / nic

    cal, fit = calibrate(H100, [(l, measured(l)) for l in layouts], GQA, par, K128)
    assert cal.attn_efficiency == pytest.approx(rate / 989e12)
    # four samples cannot separate five rates: one factor per link, fitted rate / nominal (450 GB/s; 50 per NIC)
    assert fit.nvlink_a2a_bytes_per_s is None and cal.nvlink_gbps == 450.0 and cal.net_gbps_per_node == 400.0
    assert cal.links.nvlink_p2p == cal.links.nvlink_a2a == pytest.approx(200.0 / 450.0)
    assert cal.links.network_p2p == cal.links.network_a2a == pytest.approx(30.0 / 50.0)
    with pytest.raises(PlanError, match="at least one"):
        fit_rates([])


def test_calibrate_raises_a_nominal_below_the_measured_rate():
    """A link measured faster than its nominal rate raises the nominal to it (factor 1). The network's nominal is
    per node: a fitted per-NIC rate is scaled by the NICs of a node before it is stored."""
    par = ParallelSpec(gpus=64)
    layouts = [
        Scheme("2d", 8, 8, 8, "head_first"),
        Scheme("2d", 8, 8, 8, "context_first"),
        Scheme("p2p", 1, 64, 64),
        Scheme("2d", 1, 64, 8),
    ]
    rate, nvl, nic = 3e14, 600e9, 80e9  # both links faster than nominal (450 GB/s NVLink, 50 GB/s per NIC)

    def measured(layout):
        wc = work_counts(layout, GQA, H100, par, K128)
        return wc.flops / rate + wc.nvlink_bytes / nvl + wc.nic_bytes / nic

    cal, _ = calibrate(H100, [(l, measured(l)) for l in layouts], GQA, par, K128)
    assert cal.nvlink_gbps == pytest.approx(600.0)
    assert cal.net_gbps_per_node == pytest.approx(80.0 * H100.nics_per_node)
    assert cal.nic_gbps == pytest.approx(80.0)
    assert cal.links.nvlink_p2p == pytest.approx(1.0) and cal.links.network_p2p == pytest.approx(1.0)


# -- output paths ------------------------------------------------------------------------------------------------


def test_print_plan_plain_and_rich():
    import io

    from megatron_2d.plan.report import format_plan, print_plan

    par = ParallelSpec(gpus=16)
    cands = plan(GQA, H100, par, 65536)
    plain = io.StringIO()
    print_plan(cands, GQA, H100, par, 65536, top=3, stream=plain)  # not a terminal: plain text
    assert plain.getvalue().rstrip("\n") == format_plan(cands, GQA, H100, par, 65536, top=3)
    import rich  # noqa: F401  (a dev dependency: its absence is a failure, not a skip)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    fancy = Tty()
    print_plan(cands, GQA, H100, par, 65536, top=3, stream=fancy)
    assert "Recommended:" in fancy.getvalue() and "tok/GPU/s" in fancy.getvalue()


@pytest.mark.parametrize("gpus", [8, 16, 64])
def test_enumerated_layouts_are_distinct(gpus):
    """Every layout the planner lists is a different rank map: where hp = 1 or cp = 1 both placements are the same
    layout, so it is listed once."""
    seen = set()
    for layout in plan_candidates_layouts(gpus):
        if layout.kind != "2d":
            continue
        hp, cp, w = layout.hp, layout.cp, layout.w
        maps = tuple(
            tuple(sorted(peers(i, hp, cp, w, layout.placement)["a2a"]))
            + tuple(peers(i, hp, cp, w, layout.placement)["inner"] + peers(i, hp, cp, w, layout.placement)["outer"])
            for i in range(hp * cp)
        )
        key = (hp, cp, w, maps)
        assert key not in seen, layout
        seen.add(key)
    assert len(seen) > 3


def plan_candidates_layouts(gpus):
    from megatron_2d.plan.candidates import enumerate_schemes

    return enumerate_schemes(GQA, ParallelSpec(gpus=gpus))
