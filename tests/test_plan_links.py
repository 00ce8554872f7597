"""Link efficiency (megatron_2d.plan.links, issue 23): P2P and collective factors per link class, compute slowed while
transfers run, the CLI flags, and calibrate fitting the factors; hand-computed cases."""

from __future__ import annotations

import json

import pytest

from megatron_2d.layout.ring_schedule import double_ring_events, replay, slowed_finish
from megatron_2d.plan import ParallelSpec, PlanError, Scheme, calibrate, evaluate, get_cluster, get_model, work_counts
from megatron_2d.plan.attention_time import class_time, layer_work, ring_times
from megatron_2d.plan.cli import main
from megatron_2d.plan.link_classes import LinkClass, LinkMap
from megatron_2d.plan.links import IDEAL_LINKS, LinkEfficiency, overlapped

GQA = get_model("7B-GQA")
H100 = get_cluster("8xH100")
K128 = 131072


def test_defaults_are_the_documented_measurements():
    assert H100.links == LinkEfficiency() == LinkEfficiency(0.70, 0.80, 0.94, 0.80, 0.0)
    assert IDEAL_LINKS.factor("network", "a2a") == 1.0 and IDEAL_LINKS.interference == 0.0


def test_factors_scale_each_link_and_kind_by_hand():
    # 1e9 bytes to one NVLink peer at 100 GB/s nominal: p2p factor 0.5 -> 20 ms, a2a factor 0.8 -> 12.5 ms
    cluster = H100.with_(nvlink_gbps=100.0, links=LinkEfficiency(nvlink_p2p=0.5, nvlink_a2a=0.8))
    nvl = LinkClass(1, 0, 0)
    assert class_time(nvl, 1e9, cluster) == pytest.approx(0.020)
    assert class_time(nvl, 1e9, cluster, "a2a") == pytest.approx(0.0125)
    # one network peer, 16 flows on 8 NICs of 50 GB/s: 25 GB/s per flow; x 0.94 (p2p) / x 0.8 (a2a)
    net = LinkClass(0, 1, 16)
    assert class_time(net, 1e9, cluster) == pytest.approx(1 / 23.5)
    assert class_time(net, 1e9, cluster, "a2a") == pytest.approx(1 / 20.0)
    with pytest.raises(ValueError, match="valid links"):
        cluster.links.factor("pcie", "p2p")


def test_a_factor_is_the_same_as_that_much_less_bandwidth():
    par = ParallelSpec(gpus=64)
    halved = H100.with_(links=LinkEfficiency(0.5, 0.5, 0.5, 0.5))
    slower = H100.with_(nvlink_gbps=225.0, net_gbps_per_node=200.0, links=IDEAL_LINKS)
    for layout in (
        Scheme("p2p", 1, 64, 64),
        Scheme("2d", 8, 8, 8),
        Scheme("2d", 1, 64, 8),
        Scheme("2d", 8, 8, 2, "context_first"),
    ):
        a = evaluate(layout, GQA, halved, par, K128, recompute="none").estimate
        b = evaluate(layout, GQA, slower, par, K128, recompute="none").estimate
        assert a.time_s == pytest.approx(b.time_s) and a.a2a_s == pytest.approx(b.a2a_s), layout
    # the all-to-all uses the a2a factor, the ring the p2p factor
    only_a2a = H100.with_(links=replace_links(nvlink_a2a=0.4))
    e0 = evaluate(Scheme("2d", 8, 1, 1), GQA, H100.with_(links=IDEAL_LINKS), ParallelSpec(gpus=8), K128).estimate
    e1 = evaluate(Scheme("2d", 8, 1, 1), GQA, only_a2a, ParallelSpec(gpus=8), K128).estimate
    transfer = e0.work.a2a_peer_bytes * 7 / (450e9)  # 7 NVLink peers per direction at 450 GB/s
    assert e1.a2a_s - e0.a2a_s == pytest.approx(2 * transfer * (1 / 0.4 - 1))


def replace_links(**factors) -> LinkEfficiency:
    from dataclasses import replace

    return replace(IDEAL_LINKS, **factors)


def test_slowed_compute_by_hand():
    # 2 s of work at 1/(1+1) speed while busy: busy [0, 1] does 0.5 of it, the rest runs free -> 2.5
    assert slowed_finish(0.0, 2.0, [(0.0, 1.0)], 1.0) == pytest.approx(2.5)
    # a free stretch first: [0, 1] free (1 done), [1, 2] busy (0.5 done), the last 0.5 free -> 2.5
    assert slowed_finish(0.0, 2.0, [(1.0, 2.0)], 1.0) == pytest.approx(2.5)
    # overlapping intervals merge; work that ends inside a busy stretch: 0.5 of work in [0, 3] at half speed -> 1
    assert slowed_finish(0.0, 0.5, [(0.0, 2.0), (1.0, 3.0)], 1.0) == pytest.approx(1.0)
    assert slowed_finish(5.0, 2.0, [(0.0, 1.0)], 1.0) == 7.0  # nothing in flight any more
    assert slowed_finish(0.0, 2.0, [(0.0, 1.0)], 0.0) == 2.0  # no interference
    # a transfer of 3 and a compute of 1 with x = 0.5: the compute takes 1.5, the transfer sets the time
    assert overlapped(1.0, 3.0, 0.5) == 3.0
    assert overlapped(1.0, 0.4, 0.5) == pytest.approx(0.4 + (1.0 - 0.4 / 1.5))


def test_replay_with_interference_by_hand():
    links = {"inner_kv": "in", "inner_dkv": "in", "outer_kv": "out", "outer_dkv": "out", "final_dkv": "in"}
    fwd = double_ring_events(2, 2, False)  # post kv, compute, wait kv, compute
    t = {"inner_kv": 0.5, "outer_kv": 0.0, "inner_dkv": 0.0, "outer_dkv": 0.0}
    assert replay(fwd, 1.0, t, links) == 2.0
    # x = 1: the first compute does 0.25 while the K/V hop runs (0-0.5), then 0.75 at full speed: 1.25; + 1
    assert replay(fwd, 1.0, t, links, interference=1.0) == pytest.approx(2.25)
    # the same through the planner's ring_times (one inner ring of 2 on NVLink: kv transfer of 0.5 ms)
    work = layer_work(GQA, ParallelSpec(gpus=2), hp=1, cp=2, seq=4096)
    lm = LinkMap(a2a=(), inner=(LinkClass(1, 0, 0),), outer=())
    cluster = H100.with_(links=replace_links(interference=1.0), nvlink_gbps=work.kv_bytes / 0.5e-3 / 1e9)
    fwd_s, _, _ = ring_times(work, lm, cluster, cp=2, w=2, tc=1e-3, tcb=2.5e-3)
    assert fwd_s == pytest.approx(2.25e-3)


def test_efficiency_and_interference_never_speed_a_plan_up():
    par = ParallelSpec(gpus=32)
    a100 = get_cluster("8xA100")
    for worse in (a100, a100.with_(links=LinkEfficiency(interference=0.3))):
        ideal = {c.scheme: c.estimate.time_s for c in _plan(a100.with_(links=IDEAL_LINKS), par) if c.runs}
        for c in _plan(worse, par):
            if c.runs:
                assert c.estimate.time_s >= ideal[c.scheme] * (1 - 1e-12), c.scheme


def _plan(cluster, par):
    from megatron_2d.plan import plan

    return plan(GQA, cluster, par, K128, recompute="none")


def test_bad_factors_are_refused_naming_the_flag():
    with pytest.raises(PlanError, match=r"network_p2p \(--net-p2p-eff\) must be in \(0, 1\], got 1.5"):
        LinkEfficiency(network_p2p=1.5)
    with pytest.raises(PlanError, match=r"interference \(--interference\) must be a finite number >= 0"):
        LinkEfficiency(interference=-0.1)
    with pytest.raises(PlanError, match="cluster links must be a LinkEfficiency"):
        H100.with_(links=0.5)


def test_cli_flags(capsys):
    main(["--gpus", "16", "--seq", "64K", "--json", "--nvlink-p2p-eff", "0.5", "--interference", "0.1"])
    job = json.loads(capsys.readouterr().out)[0]["job"]
    assert job["cluster"]["links"] == {
        "nvlink_p2p": 0.5,
        "nvlink_a2a": 0.8,
        "network_p2p": 0.94,
        "network_a2a": 0.8,
        "interference": 0.1,
    }
    main(["--gpus", "16", "--seq", "64K", "--json", "--ideal-links", "--net-a2a-eff", "0.9"])
    job = json.loads(capsys.readouterr().out)[0]["job"]
    assert job["cluster"]["links"] == {
        "nvlink_p2p": 1.0,
        "nvlink_a2a": 1.0,
        "network_p2p": 1.0,
        "network_a2a": 0.9,
        "interference": 0.0,
    }
    with pytest.raises(SystemExit) as err:
        main(["--gpus", "16", "--seq", "64K", "--nvlink-a2a-eff", "0"])
    assert err.value.code == 2 and "--nvlink-a2a-eff" in capsys.readouterr().err


def test_calibrate_fits_ring_and_all_to_all_factors_apart():
    # A "measured" machine whose ring sends and all-to-alls run at different rates on each link; six layouts that
    # move different mixes of bytes separate the five rates, and calibrate turns them into factors over the
    # nominal rates (450 GB/s NVLink, 50 GB/s per NIC).
    par = ParallelSpec(gpus=64)
    layouts = [
        Scheme("2d", 8, 8, 8, "head_first"),
        Scheme("2d", 8, 8, 8, "context_first"),
        Scheme("p2p", 1, 64, 64),
        Scheme("2d", 1, 64, 8),
        Scheme("2d", 4, 16, 4, "head_first"),
        Scheme("2d", 2, 32, 8, "context_first"),
        Scheme("2d", 16, 4, 4, "head_first"),
    ]
    rate, nvl, nvl_a2a, nic, nic_a2a = 3e14, 300e9, 360e9, 45e9, 40e9

    def measured(layout):
        c = work_counts(layout, GQA, H100, par, K128)
        return (
            c.flops / rate
            + (c.nvlink_bytes - c.nvlink_a2a_bytes) / nvl
            + c.nvlink_a2a_bytes / nvl_a2a
            + (c.nic_bytes - c.nic_a2a_bytes) / nic
            + c.nic_a2a_bytes / nic_a2a
        )

    cal, fit = calibrate(H100, [(l, measured(l)) for l in layouts], GQA, par, K128)
    assert fit.nvlink_a2a_bytes_per_s == pytest.approx(nvl_a2a) and fit.nic_bytes_per_s == pytest.approx(nic)
    assert cal.nvlink_gbps == 450.0 and cal.net_gbps_per_node == 400.0
    assert cal.links.nvlink_p2p == pytest.approx(300 / 450) and cal.links.nvlink_a2a == pytest.approx(360 / 450)
    assert cal.links.network_p2p == pytest.approx(45 / 50) and cal.links.network_a2a == pytest.approx(40 / 50)
    # a rate above the nominal raises the nominal (factor 1)
    fast, _ = calibrate(H100.with_(nvlink_gbps=200.0), [(l, measured(l)) for l in layouts], GQA, par, K128)
    assert fast.nvlink_gbps == pytest.approx(360.0) and fast.links.nvlink_a2a == pytest.approx(1.0)


def test_fit_folds_the_all_to_all_when_apart_it_is_not_positive():
    # Separable samples whose all-to-all bytes cost less than nothing apart (noise): asked to fit them apart, the
    # fit refuses; left to decide, it folds them into the ring's rate and gives every rate positive.
    from megatron_2d.plan import WorkCounts, fit_rates

    counts = [
        WorkCounts(1e12, 1e9),
        WorkCounts(1e12, 3e9, nvlink_a2a_bytes=1e9),
        WorkCounts(2e12, 1e9, nvlink_a2a_bytes=5e8),
        WorkCounts(1e12, 4e9, nvlink_a2a_bytes=2e9),
    ]
    samples = [(c, c.flops / 4e14 + c.nvlink_bytes / 3e11 - 1.2 * c.nvlink_a2a_bytes / 3e11) for c in counts]
    with pytest.raises(PlanError, match="non-positive time per unit for NVLink all-to-all"):
        fit_rates(samples, separate_a2a=True)
    fit = fit_rates(samples)
    assert fit.nvlink_a2a_bytes_per_s is None and fit.flops_per_s > 0 and fit.nvlink_bytes_per_s > 0
