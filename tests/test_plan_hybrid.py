"""The planner's --hybrid-pattern: 2D and stock attention costed on the attention layers only, Mamba / GDN layers'
own all-to-all over the whole CP group added alike to every layout, and CP sizes their heads cannot split over
refused with Megatron's rule."""

from __future__ import annotations

import pytest

from megatron_2d.plan import ParallelSpec, plan
from megatron_2d.plan.cli import main
from megatron_2d.plan.hardware import PlanError, get_model
from megatron_2d.plan.hybrid import HybridPattern

JOB = dict(model="7B-GQA", cluster="8xH100", parallel=ParallelSpec(gpus=64), seq=1 << 20)


def steps(cands):
    return {(c.kind, c.hp, c.cp, c.w, c.placement): c.step_ms for c in cands if c.runs}


def test_gpt_migration_pattern_plans_exactly_as_the_gpt():
    layers = get_model("7B-GQA").layers
    assert steps(plan(**JOB, hybrid_pattern="*-" * layers)) == steps(plan(**JOB))


def test_mamba_layers_add_the_same_time_to_every_layout_and_attention_counts_only_star_layers():
    attention_only = steps(plan(**JOB, hybrid_pattern="*-" * 8))
    hybrid = steps(plan(**JOB, hybrid_pattern="M-M-M*-" * 8))  # 8 attention, 24 Mamba layers
    extra = {key: hybrid[key] - attention_only[key] for key in attention_only}
    assert min(extra.values()) > 0
    assert max(extra.values()) == pytest.approx(min(extra.values()), rel=1e-9)
    pattern = HybridPattern.parse("M-M-M*-" * 8)
    model, parallel = get_model("7B-GQA"), JOB["parallel"]
    from megatron_2d.plan.hardware import get_cluster

    per_step = pattern.ssm_step_s(pattern.attention_model(model), get_cluster("8xH100"), parallel, 64, JOB["seq"])
    assert min(extra.values()) == pytest.approx(per_step * 1e3, rel=1e-9)
    # beyond the projections' matmuls, the Mamba layers pay their all-to-alls over the whole CP group (64 ranks)
    cluster = get_cluster("8xH100")
    _, _, weights = pattern._channels(model)["mamba"]
    matmuls = 24 * 6.0 * weights * JOB["seq"] / 64 / (cluster.peak_tflops * 1e12 * cluster.dense_efficiency)
    assert per_step > 1.05 * matmuls


def test_cp_sizes_the_ssm_heads_cannot_split_over_are_refused(capsys):
    with pytest.raises(
        PlanError,
        match=r"GDN layers split their heads over the whole CP group: 16 key / 32 value "
        r"heads / TP 1 = 16 / 32 per TP rank do not both divide by "
        r"context_parallel_size 64",
    ):
        plan(**JOB, hybrid_pattern="G*-")
    with pytest.raises(SystemExit) as stop:
        main(["--model", "7B-GQA", "--cluster", "8xH100", "--gpus", "64", "--seq", "1M", "--hybrid-pattern", "GX"])
    assert stop.value.code == 2 and "symbols ['X']" in capsys.readouterr().err
