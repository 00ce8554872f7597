"""The planner knows which attention kernel each side runs: per-kernel, per-architecture rates (with their sources),
stock on Transformer Engine's kernel, 2D on what its selection picks, --kernel overriding 2D's, and the flags and
the report naming it."""

import json

import pytest

from megatron_2d.plan import ParallelSpec, plan
from megatron_2d.plan.cli import main
from megatron_2d.plan.hardware import CLUSTER_PRESETS, PlanError, get_cluster
from megatron_2d.plan.kernel_rates import (
    ARCHITECTURES,
    KERNEL_RATES,
    PLANNED_KERNELS,
    SELECTED_KERNEL,
    STOCK_KERNEL,
    fwd_bwd_efficiency,
    kernel_rate,
    side_kernel,
)
from megatron_2d.plan.planner import recommended

JOB = dict(model="7B-GQA", cluster="8xH100", parallel=ParallelSpec(gpus=64), seq=131072)


def test_every_planned_kernel_has_a_sourced_rate_on_every_architecture():
    assert set(PLANNED_KERNELS) == {"te_fused", "torch_cudnn", "flash_attn2", "torch_flash"}
    for arch in ARCHITECTURES:
        for kernel in PLANNED_KERNELS:
            rate = kernel_rate(arch, kernel)
            assert 0 < rate.efficiency <= 1 and rate.source
    # the published figures behind the Hopper rows: FA3 paper, H100, head dim 128, 16K tokens
    assert KERNEL_RATES[("hopper", "te_fused")].efficiency == pytest.approx(fwd_bwd_efficiency(539, 516, 989))
    assert KERNEL_RATES[("hopper", "flash_attn2")].efficiency == pytest.approx(fwd_bwd_efficiency(335, 322, 989))
    assert not KERNEL_RATES[("hopper", "te_fused")].estimated and KERNEL_RATES[("hopper", "torch_cudnn")].estimated
    assert fwd_bwd_efficiency(100, 100, 100) == pytest.approx(1.0)  # equal rates: the rate itself
    assert {c.arch for c in CLUSTER_PRESETS.values()} == set(ARCHITECTURES)
    with pytest.raises(PlanError, match=r"kernel 'cpu_flash' is not one the planner prices"):
        kernel_rate("hopper", "cpu_flash")


def test_the_planner_assumes_what_the_selection_picks_where_stock_runs(monkeypatch):
    """Stock CP needs Transformer Engine, so where it runs 2D's selection finds TE: its first choice on Hopper, and
    flash-attn 2 (also in NGC images) first before Hopper."""
    import megatron_2d.kernels as kernels

    assert kernels.HOPPER_ORDER[0] == SELECTED_KERNEL["hopper"] == STOCK_KERNEL["hopper"] == "te_fused"
    assert kernels.AMPERE_ORDER[0] == SELECTED_KERNEL["ampere"] == STOCK_KERNEL["ampere"] == "flash_attn2"
    assert side_kernel("a2a+p2p", "hopper", "flash_attn2") == "te_fused"  # --kernel is 2D's only
    assert side_kernel("ds-ulysses", "hopper") == "flash_attn2"


def test_each_side_runs_its_kernel_and_kernel_overrides_2d():
    """The default: both sides TE's cuDNN kernel on H100 (same compute); --kernel flash_attn2: 2D's attention
    compute grows by the rate ratio, stock's does not move, and 2D's flags carry --cp-2d-kernel."""
    same = plan(**JOB)
    fa2 = plan(**JOB, kernel="flash_attn2")
    by_label = lambda cands: {(c.kind, c.scheme.label()): c for c in cands if c.feasible}  # noqa: E731
    a, b = by_label(same), by_label(fa2)
    ratio = KERNEL_RATES[("hopper", "te_fused")].efficiency / KERNEL_RATES[("hopper", "flash_attn2")].efficiency
    for key, c in a.items():
        assert c.kernel == ("flash_attn2" if c.kind == "ds-ulysses" else "te_fused")
        if c.kind == "2d":
            assert b[key].kernel == "flash_attn2" and "--cp-2d-kernel flash_attn2" in b[key].flags
            assert "--cp-2d-kernel" not in c.flags
            assert b[key].estimate.kernel_s == pytest.approx(c.estimate.kernel_s * ratio)
        else:
            assert b[key].kernel == c.kernel and b[key].estimate.step_s == pytest.approx(c.estimate.step_s)
    assert recommended(same).kernel == "te_fused"
    one = plan(**{**JOB, "cluster": get_cluster("8xH100").with_(attn_efficiency=0.45)}, kernel="flash_attn2")
    assert len({round(c.estimate.kernel_s / c.estimate.work.fwd_flops, 18) for c in one if c.feasible}) == 1


def test_the_report_and_json_name_the_kernels(capsys):
    assert main(["--model", "7B-GQA", "--gpus", "64", "--seq", "128K", "--kernel", "torch_cudnn", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "attention kernels: stock (TE) te_fused at 52.8% of peak" in out and "2D torch_cudnn at 52.8%" in out
    assert "Recommended: " in out and ", kernel " in out
    assert main(["--model", "7B-GQA", "--gpus", "64", "--seq", "128K", "--kernel", "flash_attn2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kernel"] for r in rows if r["kind"] == "2d"} == {"flash_attn2"}
    assert {r["kernel"] for r in rows if r["kind"] in ("p2p", "a2a+p2p") and r["feasible"]} == {"te_fused"}
    with pytest.raises(SystemExit):
        main(["--model", "7B-GQA", "--gpus", "64", "--seq", "128K", "--kernel", "cpu_flash"])
    assert "invalid choice: 'cpu_flash'" in capsys.readouterr().err


# ---- QK-clip: the max attention logit ---------------------------------------------------------------------------
def test_the_kernels_whose_launch_gives_the_max_logit_are_the_ones_the_planner_prices_free():
    """LAUNCH_MAX_LOGIT is the kernels whose forward launches take ``max_logit`` (te_fused, from TE 2.9 on): every
    other kernel runs the op's separate pass."""
    import inspect

    from megatron_2d.kernels import KERNELS
    from megatron_2d.plan.kernel_rates import LAUNCH_MAX_LOGIT

    def launches_give_it(cls) -> bool:
        launch = getattr(cls, "dense_forward", None)
        return launch is not None and "max_logit" in inspect.signature(launch).parameters

    assert {name for name, cls in KERNELS.items() if launches_give_it(cls)} == set(LAUNCH_MAX_LOGIT)


def test_the_max_logit_is_charged_per_kernel_and_recomputed_with_the_forward():
    """A kernel without it in its launch pays a q k^T pass per ring step (max_logit_pass_s: 2 dk FLOPs per visible
    pair at the dense rate, a score written and read in bf16) and two all-reduces' latency; te_fused the latency
    alone; selective recompute runs the forward, so the pass, again; Checkpoint++ keeps it."""
    from megatron_2d.plan.attention_time import MAX_LOGIT_REDUCTIONS, max_logit_pass_s
    from megatron_2d.plan.candidates import Scheme
    from megatron_2d.plan.hardware import get_model
    from megatron_2d.plan.job import Job
    from megatron_2d.plan.step import estimate

    model, cluster, parallel = get_model("7B-GQA"), get_cluster("8xA100"), ParallelSpec(gpus=64, tp=8, cp=8)
    layout = Scheme("2d", 2, 4, 4, "head_first")
    lat = cluster.step_latency_us * 1e-6
    for kernel, free in (("te_fused", True), ("flash_attn2", False)):
        job = Job(model, cluster, parallel, 131072, kernel=kernel)
        clipped_job = Job(model, cluster, parallel, 131072, kernel=kernel, qk_clip=True)
        base = estimate(job, layout)
        clipped = estimate(clipped_job, layout)
        per_step = max_logit_pass_s(base.work.fwd_flops / 4, model.qk_dim, model.v_dim, cluster)
        expected = MAX_LOGIT_REDUCTIONS * lat + (0.0 if free else 4 * per_step)
        assert clipped.max_logit_s == pytest.approx(expected)
        assert clipped.time_s - base.time_s == pytest.approx(expected, rel=1e-6)
        for mode, again in (("selective", 2), ("ckpt++", 1)):
            with_mode = estimate(clipped_job, layout, recompute=mode)
            plain = estimate(job, layout, recompute=mode)
            added = (with_mode.step_s - plain.step_s) / model.layers
            assert added == pytest.approx(again * expected if mode == "selective" else expected, rel=1e-6), mode
    # the pass on A100 at 128K: a sizeable share of the layer's attention (docs/benchmarks.md)
    assert 0.1 < (expected - MAX_LOGIT_REDUCTIONS * lat) / base.time_s < 0.5


def test_stock_runs_tes_fused_attention_under_qk_clip():
    """Transformer Engine switches FlashAttention off for return_max_logit: stock CP on Ampere then runs its fused
    attention, whose launch gives the max."""
    assert side_kernel("p2p", "ampere") == "flash_attn2" and side_kernel("p2p", "ampere", qk_clip=True) == "te_fused"
    assert side_kernel("2d", "ampere", qk_clip=True) == "flash_attn2"  # 2D keeps its selection (the pass)
    cands = plan(**{**JOB, "cluster": "8xA100"}, qk_clip=True)
    assert {c.kernel for c in cands if c.kind == "p2p"} == {"te_fused"}
    assert all(c.estimate.max_logit_s > 0 for c in cands if c.runs)
