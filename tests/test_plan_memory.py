"""Memory options in the planner (megatron_2d.plan.memory_options, issue 23): sharded model states and the
communication the sharding adds, by hand; each side's options; the what-if flag; the 70B case the issue names."""

from __future__ import annotations

import json

import pytest

from megatron_2d.layout.zero_sharding import state_bytes_per_rank
from megatron_2d.plan import ModelSpec, ParallelSpec, PlanError, Scheme, evaluate, get_cluster, get_model, plan
from megatron_2d.plan.cli import main
from megatron_2d.plan.links import IDEAL_LINKS, LinkEfficiency
from megatron_2d.plan.memory_options import (
    DIST_OPT,
    MemoryPolicy,
    collective_s,
    hybrid_zero_options,
    memory_options,
    sharding_cost,
    stock_options,
    with_memory,
)
from megatron_2d.plan.planner import recommended

H100 = get_cluster("8xH100")
GQA = get_model("7B-GQA")
# The small model of tests/test_plan.py's memory case: 2 layers of 2228224 weights, 5480448 in all.
SMALL = ModelSpec("small", layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, vocab=1000)
# nominal links for round numbers: NVLink 100 GB/s, 8 NICs of 50 GB/s per node of 8 GPUs
NOMINAL = H100.with_(nvlink_gbps=100.0, links=IDEAL_LINKS)


def option(label, dp, cp, ranks_per_node=8):
    return next(o for o in hybrid_zero_options(dp, cp, ranks_per_node, True) if o.label == label)


def test_small_model_parts_and_traffic_by_hand():
    # DP=2 x CP=8 = D = 16 ranks (2 nodes); N = 5480448 params per rank (TP = PP = 1); m = 4 micro-batches a step.
    par, N, layer = ParallelSpec(gpus=16, cp=8), 5480448, 2228224
    assert SMALL.total_params() == N and SMALL.layer_params() == layer
    P, G = N / 2 * 2, N / 2 * 4  # one layer's bf16 params and fp32 grads, the embeddings spread over layers
    # ZeRO-3 over the CP group (S = 8: one node, NVLink), 2 instances one node apart (the network, one NIC each)
    z3 = option("hz-z3/8", 2, 8)
    c = sharding_cost(z3, SMALL, NOMINAL, par, 8, fwd_compute_s=1e-5, bwd_compute_s=2e-5, accum_steps=4)
    assert (c.params, c.grads, c.optimizer) == (N * 2 / 8, N * 4 / 8, N * 12 / 8)
    assert c.gathered == 2 * layer * 2 + layer * 4  # two gathered layers + one layer's grads
    ag, rs = 7 / 8 * P / 100e9, 7 / 8 * G / 100e9  # ring over 8 ranks on NVLink
    ar_out = 2 * (1 / 2) * (G / 8) / 50e9  # all-reduce of a shard over 2 nodes
    assert c.fwd_comm_s == pytest.approx(ag) and c.bwd_comm_s == pytest.approx(ag + rs + ar_out / 4)
    assert c.exposed_s == pytest.approx((ag - 1e-5) + (ag + rs + ar_out / 4 - 2e-5))
    assert c.gather_bytes == pytest.approx(2 * 7 / 8 * P * 2)  # forward + backward, both layers
    assert c.scatter_bytes == pytest.approx((7 / 8 * G + 2 * (1 / 2) * G / 8 / 4) * 2)
    assert c.links == "nvlink" and c.model_states == c.params + c.grads + c.optimizer + c.gathered
    assert c.sharded == c.params + c.grads + c.optimizer
    # the distributed optimizer over all 16 (2 nodes, 8 ranks each: min(NVLink 100, 8 NICs 400) = 100 GB/s):
    # params and grads whole, the optimizer's 12 bytes over 16; once per step, so 1/m per micro-batch
    d = sharding_cost(stock_options(2, 8)[0], SMALL, NOMINAL, par, 8, 1.0, 1.0, accum_steps=4)
    assert (d.params, d.grads, d.optimizer, d.gathered) == (N * 2, N * 4, N * 12 / 16, 0.0)
    assert d.fwd_comm_s == pytest.approx(15 / 16 * P / 100e9 / 4)
    assert d.bwd_comm_s == pytest.approx(15 / 16 * G / 100e9 / 4)
    assert d.exposed_s == 0.0 and d.links == "mixed"  # hidden behind a second of compute
    assert d.sharded == d.optimizer
    # ZeRO-2 over all 16: grads sharded and reduce-scattered every micro-batch, params gathered once a step
    z2 = sharding_cost(stock_options(2, 8)[1], SMALL, NOMINAL, par, 8, 1.0, 1.0, accum_steps=4)
    assert (z2.params, z2.grads, z2.gathered) == (N * 2, N * 4 / 16, layer * 4)
    assert z2.bwd_comm_s == pytest.approx(15 / 16 * G / 100e9)


def test_the_bytes_are_the_librarys_own():
    # the planner's parts are zero_sharding.state_bytes_per_rank, the function megatron/hybrid_zero.py's
    # model_state_bytes_per_rank wraps (checked against real megatron-core buffers in tests/test_hybrid_zero.py)
    par = ParallelSpec(gpus=64, cp=32)
    for o in hybrid_zero_options(2, 32, 8, True):
        c = sharding_cost(o, GQA, H100, par, 32, 1.0, 1.0)
        expected = state_bytes_per_rank(GQA.total_params(), o.zero, 2, 32, param_bytes=2, grad_bytes=4)
        assert (c.params, c.grads, c.optimizer) == (expected["params"], expected["grads"], expected["optimizer"])


def test_collectives_by_hand():
    c = H100.with_(links=LinkEfficiency(nvlink_a2a=0.5, network_a2a=0.25))
    # 8 ranks one apart: one node, NVLink at 450 x 0.5
    assert collective_s(8e9, 8, 1, c) == pytest.approx(7 / 8 * 8e9 / 225e9)
    # 8 ranks 8 apart (TP = 8): every rank on its own node, one NIC each (400 / 8 x 0.25)
    assert collective_s(8e9, 8, 8, c) == pytest.approx(7 / 8 * 8e9 / 12.5e9)
    # 16 ranks 2 apart: 4 per node, 4 NICs' share of the node (200 x 0.25 = 50 < NVLink 225)
    assert collective_s(8e9, 16, 2, c) == pytest.approx(15 / 16 * 8e9 / 50e9)
    assert collective_s(8e9, 1, 1, c) == 0.0


def test_with_memory_replaces_the_states_and_adds_the_exposed_sharding():
    par = ParallelSpec(gpus=64)
    base = evaluate(Scheme("2d", 8, 8, 8), GQA, H100, par, 131072, recompute="none", memory=DIST_OPT).estimate
    z3 = option("hz-z3/8", 1, 64)
    slow = H100.with_(links=LinkEfficiency(nvlink_a2a=0.01, network_a2a=0.01))  # sharding far from hidden
    e = with_memory(base, z3, GQA, slow, par, 64)
    assert e.states.option is z3 and e.states.exposed_s > 0
    assert e.memory.model_states == e.states.model_states
    assert e.memory_gb == pytest.approx(e.memory.total("none") / 1e9)
    d = with_memory(base, stock_options(1, 64)[0], GQA, slow, par, 64)
    assert e.step_s - d.step_s == pytest.approx(32 * (e.states.exposed_s - d.states.exposed_s))
    assert e.mfu == pytest.approx(base.mfu * base.step_s / e.step_s)
    with pytest.raises(ValueError, match="without recompute"):
        from megatron_2d.plan import with_recompute

        with_memory(with_recompute(base, "full"), z3, GQA, H100, par, 64)


def test_each_side_tries_its_own_options():
    par = ParallelSpec(gpus=64, cp=16)  # DP = 4, D = 64
    labels = lambda kind, policy: [o.label for o in memory_options(kind, par, H100, policy)]  # noqa: E731
    assert labels("p2p", MemoryPolicy()) == ["dist-opt", "fsdp-z2", "fsdp-z3"]
    assert labels("2d", MemoryPolicy()) == [
        "dist-opt",
        "fsdp-z2",
        "fsdp-z3",
        "hz-z1/16",
        "hz-z1/8",
        "hz-z2/16",
        "hz-z2/8",
        "hz-z3/16",
        "hz-z3/8",
    ]
    assert labels("p2p", MemoryPolicy(fair=True)) == labels("2d", MemoryPolicy())
    assert labels("2d", MemoryPolicy("stock")) == labels("p2p", MemoryPolicy())
    assert labels("2d", DIST_OPT) == labels("ds-ulysses", DIST_OPT) == ["dist-opt"]
    assert labels("2d", MemoryPolicy("all"))[-2:] == ["hz-z3/16+opt/64", "hz-z3/8+opt/64"]
    # flags: megatron-core's own (HybridZeRO.megatron_cli_args), DeepSpeed's config for DeepSpeed-Ulysses
    assert option("hz-z3/8", 4, 16).flags("2d", 4, 16) == (
        "--use-distributed-optimizer --num-distributed-optimizer-instances 8 --use-megatron-fsdp "
        "--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor --overlap-grad-reduce "
        "--overlap-param-gather"
    )
    assert "--outer-dp-sharding-strategy optim --clip-grad 0.0" in option("hz-z3/8+opt/64", 4, 16).flags("2d", 4, 16)
    assert stock_options(4, 16)[0].flags("ds-ulysses", 4, 16) == "; DeepSpeed zero_optimization.stage 1 over 64 ranks"
    assert MemoryPolicy(global_batch_tokens=4 << 20).accum_steps(131072, par) == 8  # 32 sequences over DP = 4
    with pytest.raises(PlanError, match="memory choice 'zero' is not one of auto, dist-opt, stock, all"):
        MemoryPolicy("zero")
    with pytest.raises(PlanError, match="global_batch_tokens must be a positive integer"):
        MemoryPolicy(global_batch_tokens=0)


def test_70b_tp8_256k_on_64_h100s_is_feasible_with_sharded_states():
    # the case: with the distributed optimizer alone the bf16 weights and fp32 grads (52.9 GB) leave no
    # room; sharding params and grads over the 8 CP ranks fits, and the command line turns it on
    m, par = get_model("70B-GQA"), ParallelSpec(gpus=64, tp=8)
    assert recommended(plan(m, H100, par, 262144, memory=DIST_OPT)) is None
    best = recommended(plan(m, H100, par, 262144))
    assert best is not None and best.kind == "2d" and best.estimate.states.option.zero_stage == 3
    assert best.estimate.memory_gb <= H100.memory_budget_gb
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params" in best.flags
    assert best.flags.startswith("--tensor-model-parallel-size 8 --context-parallel-size 8 --cp-comm-type 2d")


def test_fair_memory_lends_stock_hybrid_zero_and_checkpoint_plus_plus():
    par = ParallelSpec(gpus=64)
    own = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, par, 1 << 20)
    fair = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, par, 1 << 20, memory=MemoryPolicy(fair=True))
    assert own.recompute in ("selective", "full") and fair.recompute == "ckpt++" and fair.step_ms < own.step_ms
    assert "hypothetical" in fair.note and "--selective-checkpoint-plus-plus" not in fair.flags
    assert "--recompute-granularity full" in fair.flags
    forced = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, par, 1 << 20, recompute="ckpt++")
    assert not forced.feasible and "--fair-memory lends it to stock" in forced.reason


def test_rows_show_the_option_its_parts_and_traffic(capsys):
    assert main(["--model", "70B-GQA", "--tp", "8", "--gpus", "64", "--seq", "256K", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    best = rows[0]
    assert best["recommended"] and best["memory_option"] == best["states"]["option"]
    parts = best["memory_parts_gb"]
    assert set(parts) == {"activations", "params", "grads", "optimizer", "gathered", "logits", "comm_buffers"}
    assert sum(parts.values()) == pytest.approx(best["memory_gb"], abs=0.05)
    assert best["states"]["all_gather_mb"] > 0 and best["states"]["links"] == "network"  # TP = 8: a node each
    assert set(best["memory_options"]) >= {"dist-opt", "fsdp-z2", "fsdp-z3"}
    assert best["memory_options"]["dist-opt"]["fits_memory"] is False
    assert main(["--model", "70B-GQA", "--tp", "8", "--gpus", "64", "--seq", "256K", "--memory", "dist-opt"]) == 1
    text = capsys.readouterr().out
    assert "No feasible layout" in text and "--memory auto" in text
    assert main(["--model", "70B-GQA", "--tp", "8", "--gpus", "64", "--seq", "256K", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "states=fsdp-z3" in text and "memory: fsdp-z3: params 2.2 + grads 4.4 + optimizer 13.2" in text
