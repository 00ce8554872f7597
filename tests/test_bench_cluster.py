"""The benchmarks' side of the emulated cluster, without building one: a preset's scaling, the shape the flags ask
for, the cluster as the planner's (link factors from measured figures), the planner's kind of each benchmark row
and its summary, the end-to-end benchmark's modes, and the posting order of before issue 41 (bench/send_first.py).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_2d.plan import Scheme
from megatron_2d_dev.bench import cluster as bc
from megatron_2d_dev.bench import cluster_plan
from megatron_2d_dev.bench.cluster_pretrain import Mode, iteration_seconds, parse_modes
from megatron_2d_dev.bench.compare import Row, posting_orders
from megatron_2d_dev.bench.runners import OURS, RING_FLASH, SEND_FIRST, TORCH_CP, USP
from megatron_2d_dev.emulated_cluster import ClusterShape


def flags(**kw):
    base = dict(
        cluster=None, nodes=2, net_mbit=None, nvl_mbit=None, nics_per_node=None, gpu_seq=None, burst_kib=16, seq=4096
    )
    return argparse.Namespace(**(base | kw))


def test_scaling_keeps_the_ring_steps_comm_over_compute():
    gpu = bc.GPU_PRESETS["dgx-h100"]
    r_gpu = bc.gpu_attention_flops(gpu)
    assert r_gpu == pytest.approx(989e12 * gpu.kernel_efficiency("te_fused"))
    s = bc.Scaling(gpu, cpu_flops=5e9, seq=4096, gpu_seq=65536)
    assert s.factor == pytest.approx(5e9 / r_gpu * 16)
    assert s.nic_mbit() == pytest.approx(400e3 * s.factor)  # one 400 Gb/s NIC
    assert s.nvl_mbit() / s.nic_mbit() == pytest.approx(9.0)  # NVLink 450 GB/s : 50 GB/s
    # a ring step's (bytes / rate) / (flops / R): bytes ~ S, flops ~ S^2; the same on both sides
    kv_gpu, kv_emu = 65536.0, 4096.0  # bytes of a block scale with S
    flops_gpu, flops_emu = 65536.0**2, 4096.0**2
    ratio_gpu = (kv_gpu / (gpu.nic_gbps * 1e9)) / (flops_gpu / r_gpu)
    ratio_emu = (kv_emu / (s.nic_mbit() * 1e6 / 8)) / (flops_emu / 5e9)
    assert ratio_emu == pytest.approx(ratio_gpu)
    assert bc.equivalent_gpu_seq(gpu, s.nic_mbit(), 5e9, 4096) == pytest.approx(65536)


def test_shape_from_flags():
    shape, scaling = bc.cluster_shape(flags(net_mbit=50), 8, None)
    assert (shape.nodes, shape.ranks_per_node, shape.nic_mbit, shape.nvl_mbit, shape.nics) == (2, 4, 50, 450, 4)
    assert scaling is None
    shape, scaling = bc.cluster_shape(flags(cluster="a100-4nic", gpu_seq=8192), 8, 4e9)
    assert shape.nics == 2 and shape.ranks_per_nic == 2  # 4 NICs for 8 GPUs: shared by two ranks each
    assert shape.nvl_mbit / shape.nic_mbit == pytest.approx(300 / 25)  # NVLink 3 : one 200 Gb/s NIC
    assert scaling.gpu_seq == 8192 and scaling.seq == 4096
    with pytest.raises(SystemExit, match="--nodes 3 must divide the ranks"):
        bc.cluster_shape(flags(net_mbit=50, nodes=3), 8, None)


def test_job_of_packed_flags():
    job = bc.Job.of(argparse.Namespace(tokens=16384, heads=8, dim=64))
    assert job == bc.Job(16384, 1, 8, 8, 64)


def figures_at_rate(shape: ClusterShape, nbytes: int, slowdown: float) -> bc.LinkFigures:
    """What measure_links would see on a cluster whose links run ``slowdown`` times slower than shaped."""
    nvl, nic = shape.nvl_mbit * 1e6 / 8, shape.nic_mbit * 1e6 / 8
    g, n = shape.ranks_per_node, shape.world
    flow = nic * shape.nics / max(g, shape.nics)
    return bc.LinkFigures(
        nbytes,
        intra_ring_s=slowdown * nbytes / nvl,
        inter_ring_s=slowdown * nbytes / flow,
        node_a2a_s=slowdown * (g - 1) * nbytes / nvl,
        world_a2a_s=slowdown * (n - g) * nbytes / flow,
        latency_s=1e-3,
    )


@pytest.mark.parametrize("nics", [None, 2])
def test_planner_spec_of_the_cluster(nics):
    shape = ClusterShape(2, 4, 50, 450, nics)
    spec, factors = bc.emulated_cluster_spec(shape, figures_at_rate(shape, 1 << 18, 1.0), 5e9, 4e9)
    assert (spec.gpus_per_node, spec.nics_per_node) == (4, shape.nics)
    assert spec.nvlink_gbps == pytest.approx(450e6 / 8 / 1e9)
    assert spec.net_gbps_per_node == pytest.approx(shape.nics * 50e6 / 8 / 1e9)
    assert spec.peak_tflops == pytest.approx(5e-3) and spec.attn_efficiency == 1.0 and spec.step_latency_us == 1e3
    assert all(v == pytest.approx(1.0) for v in factors.values()) and len(factors) == 4
    slow, factors = bc.emulated_cluster_spec(shape, figures_at_rate(shape, 1 << 18, 2.0), 5e9, 4e9)
    assert all(v == pytest.approx(0.5) for v in factors.values())
    assert slow.links.nvlink_p2p == pytest.approx(0.5) and slow.links.network_a2a == pytest.approx(0.5)


def test_a_faster_measurement_is_clamped():
    shape = ClusterShape(2, 2, 50, 450)
    _, factors = bc.emulated_cluster_spec(shape, figures_at_rate(shape, 1 << 18, 0.9), 5e9, 4e9)
    assert set(factors.values()) == {1.0}


def row(name, family, seconds, layout=None, rounds=()):
    return Row(name, family, "ok", seconds, None, None, None, layout=layout, round_seconds=list(rounds))


def test_planner_kind_of_each_row():
    args = argparse.Namespace(ranks=8)
    lay = {"hp": 2, "cp": 4, "w": 2, "placement": "context_first"}
    assert cluster_plan.scheme_of(row("x", OURS, 1, lay), args) == Scheme("2d", 2, 4, 2, "context_first")
    usp = {"hp": 2, "cp": 4}
    assert cluster_plan.scheme_of(row("USP ulysses2 x ring4", USP, 1, usp), args) == Scheme("2d", 2, 4, 4)
    repeated = row("USP ulysses8 x ring1, K/V repeated by the caller", USP, 1, {"hp": 8, "cp": 1})
    assert cluster_plan.scheme_of(repeated, args) is None
    assert cluster_plan.scheme_of(row(RING_FLASH, RING_FLASH, 1), args) == Scheme("2d", 1, 8, 8)
    assert cluster_plan.scheme_of(row("TE p2p", "TE p2p", 1), args) == Scheme("p2p", 1, 8, 8)
    assert cluster_plan.scheme_of(row("TE a2a", "TE a2a", 1), args) == Scheme("a2a", 8, 1, 1)
    assert cluster_plan.scheme_of(row("TE a2a+p2p [2, 4]", "TE a2a+p2p", 1), args) == Scheme("a2a+p2p", 2, 4, 4)
    assert cluster_plan.scheme_of(row("torch CP alltoall", TORCH_CP, 1), args) is None


def test_planner_summary():
    rows = [
        {"name": "a", "family": OURS, "measured_s": 1.0, "predicted_s": 1.2},
        {"name": "b", "family": OURS, "measured_s": 0.8, "predicted_s": 1.3},
        {"name": "c", "family": USP, "measured_s": 0.7, "predicted_s": None},
    ]
    s = cluster_plan.summary(rows)
    assert (s["rows"], s["within"]) == (2, 1)
    assert s["worst_error"] == pytest.approx(0.625) and s["median_abs_error"] == pytest.approx((0.2 + 0.625) / 2)
    assert (s["recommended"], s["measured_best"], s["best_of_all"]) == ("a", "b", "c")
    assert s["regret"] == pytest.approx(0.25)


def test_end_to_end_modes():
    modes = parse_modes("all", 4)
    names = [m.name for m in modes]
    assert "2d hp1 w4 head_first" in names and "2d hp4 w1 head_first" in names
    assert "2d hp2 w2 context_first" in names and "2d hp1 w1 head_first" not in names  # w = 1: the same ring
    assert names[-4:] == ["p2p", "a2a", "a2a+p2p [2]", "all_gather"] and all(m.stock for m in modes[-4:])
    assert parse_modes("2d:2:2:context_first,a2a+p2p:2,all_gather", 4) == [
        Mode("2d", 2, 2, "context_first"),
        Mode("a2a+p2p", 2),
        Mode("all_gather"),
    ]
    assert Mode("2d", 2, 4).env(8) == {"MODE": "2d", "CP": "8", "HP": "2", "WINDOW": "4", "PLACEMENT": "head_first"}
    with pytest.raises(argparse.ArgumentTypeError, match="expected 2d:HP:W"):
        parse_modes("2d:2", 4)
    log = " [t] iteration        2/       4 | consumed samples: 2 | elapsed time per iteration (ms): 812.5 | lm"
    assert iteration_seconds(log) == {2: 0.8125}


def test_end_to_end_stock_modes():
    """A stock mode launches with the TE release its workers run in and the stock-CP spec, and torchrun_gpt.sh's
    flags for its comm type; a mode TE refuses for the heads is refused by name before any launch."""
    from megatron_2d_dev.bench.cluster_pretrain import STOCK_SPEC, launch_of, parse_args, stock_refusal
    from megatron_2d_dev.cluster_launch import launch_flags
    from megatron_2d_dev.cluster_worker import TE_RELEASE_ENV

    base = {"SEQ": "256"}
    env, flags = launch_of(Mode("a2a+p2p", 2), 8, base, ["--x"], "2.20.2")
    assert env[TE_RELEASE_ENV] == "2.20.2" and flags == ["--x", *STOCK_SPEC]
    hierarchical = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"]
    assert launch_flags(env, ["CP_FLAGS"]) == hierarchical
    env, flags = launch_of(Mode("all_gather"), 8, base, ["--x"], "2.20.2")
    assert launch_flags(env, ["CP_FLAGS"]) == ["--cp-comm-type", "all_gather"]
    env, flags = launch_of(Mode("2d", 2, 4), 8, base, ["--x"], "2.20.2")
    assert TE_RELEASE_ENV not in env and flags == ["--x"]
    args = parse_args(["--ranks", "8", "--net-mbit", "50", "--heads", "8", "--kv-heads", "2"])
    assert stock_refusal(Mode("p2p"), args) is None and stock_refusal(Mode("a2a+p2p", 2), args) is None
    assert "divide CP=8, the 8 query heads and the 2 K/V heads" in stock_refusal(Mode("a2a"), args)
    assert "all-to-all of 4 ranks" in stock_refusal(Mode("a2a+p2p", 4), args)
    args.te_release = "0.0.1"
    assert "Transformer Engine 0.0.1 is not installed" in stock_refusal(Mode("p2p"), args)


def test_send_first_swaps_the_posting_order_and_restores_it(monkeypatch):
    import torch.distributed as dist

    from megatron_2d import head_all_to_all
    from megatron_2d.transport import comm, neighbour_exchange
    from megatron_2d_dev.bench.send_first import send_first

    now = (comm.RingChannel.start, comm.post_direct, neighbour_exchange.post_direct, head_all_to_all.all_to_all_counted)
    posted = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.append(ops) or [])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    x = torch.zeros(2)
    with send_first():
        comm.RingChannel(None, [4, 9, 2], 0, comm.CommCounter(), "inner_ring").start(x)
        comm.DirectChannel(None, 7, 5, comm.CommCounter(), "outer_ring").start(x)
    comm.RingChannel(None, [4, 9, 2], 0, comm.CommCounter(), "inner_ring").start(x)
    assert posted == [[(dist.isend, 9), (dist.irecv, 2)], [(dist.isend, 7), (dist.irecv, 5)]] + [
        [(dist.irecv, 2), (dist.isend, 9)]
    ]
    after = (comm.RingChannel.start, comm.post_direct, neighbour_exchange.post_direct)
    assert after + (head_all_to_all.all_to_all_counted,) == now


def test_posting_orders_pair_each_layout_by_round():
    lay = {"hp": 1, "cp": 4, "w": 4, "placement": "head_first"}
    rows = [
        row("hp1 x cp4  w4  head_first", OURS, 1.0, lay, (1.0, 0.9, 1.1)),
        row("hp1 x cp4  w4  head_first (send first)", SEND_FIRST, 1.25, lay, (1.25, 1.2, 1.3)),
        row("hp2 x cp2  w2  head_first", OURS, 1.0, lay | {"hp": 2, "cp": 2, "w": 2}, (1.0, 1.0, 1.0)),
    ]
    (pair,) = posting_orders(rows)
    assert pair.row == "hp1 x cp4  w4  head_first" and pair.ratio == pytest.approx(0.8)
    assert pair.verdict == "faster" and not math.isnan(pair.round_ratios[1])
