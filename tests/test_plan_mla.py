"""The planner for multi-latent attention: 2D layouts of an MLA model come with the expanded and the latent ring,
modelled with their bytes and the latent ring's repeated up-projection, next to Transformer Engine's p2p."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_2d.plan import Job, ParallelSpec, evaluate, plan, recommended
from megatron_2d.plan.attention_time import layer_work
from megatron_2d.plan.candidates import Scheme
from megatron_2d.plan.hardware import get_cluster, get_model
from megatron_2d.plan.report import format_plan
from megatron_2d.plan.step import estimate

DSV3 = get_model("DSV3-MLA")


def test_dsv3_preset_has_deepseek_v3_attention_and_active_parameters():
    m = DSV3.mla
    assert (
        DSV3.layers,
        DSV3.hidden,
        DSV3.heads,
        m.kv_lora_rank,
        m.q_lora_rank,
        m.qk_head_dim,
        m.qk_rope_dim,
        m.v_head_dim,
    ) == (61, 7168, 128, 512, 1536, 128, 64, 128)
    assert (DSV3.qk_dim, DSV3.v_dim) == (192, 128)
    assert 36e9 < DSV3.matmul_params() + DSV3.vocab * DSV3.hidden < 39e9  # DeepSeek-V3: 37B activated


@pytest.mark.parametrize("hp", [1, 2, 8])
def test_ring_bytes_per_token_are_the_op_closed_form(hp):
    """Block bytes per token, bf16: expanded (16/hp heads x (192 + 128)) vs latent (512 + 64), as
    tests/test_mla_attention.py measures them on the op; at TP 8 and hp 1 the latent ring moves under 1/8."""
    parallel = ParallelSpec(gpus=64, tp=8)
    expanded = layer_work(DSV3, parallel, hp, 8 // hp, 131072)
    latent = layer_work(DSV3, parallel, hp, 8 // hp, 131072, mla_ring="latent")
    assert expanded.kv_bytes / expanded.s_ctx_tokens == 2 * (16 // hp) * 320
    assert latent.kv_bytes / latent.s_ctx_tokens == 2 * 576
    assert latent.dkv_bytes == 2 * latent.kv_bytes  # fp32 riders
    assert latent.fwd_flops == expanded.fwd_flops
    if hp == 1:
        assert latent.kv_bytes / expanded.kv_bytes <= 1 / 8


def test_latent_ring_pays_the_up_projection_in_every_ring_step():
    """With communication free, the latent ring is slower than the expanded one by its ring steps'
    up-projections (less the layer's own K/V up-projection it no longer runs); the bigger the ring, the more."""
    cluster = get_cluster("8xH100").with_(nvlink_gbps=1e9, net_gbps_per_node=1e9, step_latency_us=0.0)
    parallel = ParallelSpec(gpus=64, tp=8)
    slower = []
    for hp, cp in ((8, 1), (2, 4), (1, 8)):
        e, l = (
            estimate(Job(DSV3, cluster, parallel, 32768), Scheme("2d", hp, cp, cp, "head_first", r))
            for r in (None, "latent")
        )
        slower.append(l.step_s - e.step_s)
    assert slower[0] < slower[1] < slower[2] and slower[2] > 0


@pytest.mark.parametrize("gpus", [64, 256])
def test_plan_compares_te_p2p_and_both_2d_rings_and_recommends_by_time(gpus):
    cands = plan(DSV3, "8xH100", ParallelSpec(gpus=gpus, tp=8), seq=131072)
    feasible = [c for c in cands if c.feasible]
    rings = {c.scheme.mla_ring for c in feasible if c.kind == "2d"}
    assert rings == {"expanded", "latent"} and any(c.kind == "p2p" for c in cands if c.runs)
    best = recommended(cands)
    assert best is feasible[0] and best.step_ms == min(c.step_ms for c in feasible)
    latent = next(c for c in feasible if c.scheme.mla_ring == "latent")
    assert "--cp-2d-mla-ring latent" in latent.flags and latent.to_dict()["mla_ring"] == "latent"
    text = format_plan(cands, DSV3, get_cluster("8xH100"), ParallelSpec(gpus=gpus, tp=8), 131072)
    assert "2d latent" in text and "2d expanded" in text and "Best 2D layout of each MLA ring" in text
    assert "p2p" in text


def test_latent_ring_needs_an_mla_model():
    with pytest.raises(ValueError, match="mla_ring 'latent' needs an MLA model"):
        estimate(
            Job(get_model("7B-GQA"), get_cluster("8xH100"), ParallelSpec(gpus=8), 65536),
            Scheme("2d", 1, 8, 8, "head_first", "latent"),
        )
    standard = evaluate(Scheme("2d", 1, 8, 8), "7B-GQA", "8xH100", ParallelSpec(gpus=8), 65536)
    assert standard.scheme.mla_ring is None and standard.to_dict()["mla_ring"] is None


def test_mla_models_keep_one_kv_head_per_query_head():
    from megatron_2d.plan.hardware import PlanError

    with pytest.raises(PlanError, match="kv_heads=8 must equal heads=128"):
        dataclasses.replace(DSV3, kv_heads=8)
