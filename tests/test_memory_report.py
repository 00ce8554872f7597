"""tools/memory_report.py at a tiny size: the measured properties the report is for."""

import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "memory_report.py"


@pytest.fixture(scope="module")
def memory_report():
    spec = importlib.util.spec_from_file_location("memory_report", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("hp, batch", [(1, 1), (2, 1), (1, 2)])
def test_recompute_modes(memory_report, hp, batch):
    """The measured activations of each Checkpoint++ keep policy match its formula (full recompute's measured
    bytes plus what the policy keeps: out + lse for "outputs") within 2%; "outputs" sends full recompute's
    all-to-all bytes again and no ring byte, "attention-inputs" nothing."""
    flags = ["--layers", "2", "--hidden", "64", "--seq", "128", "--hp", str(hp), "--batch", str(batch), "--plot", ""]
    args = memory_report.parse_args(flags)
    rows = {r["mode"]: r for r in memory_report.report(args)}
    assert set(rows) == {"none", "selective", "full", "ckpt++ outputs", "ckpt++ attention-inputs"}
    act = {m: r["activation_MiB_per_layer"] for m, r in rows.items()}
    assert act["full"] < act["ckpt++ outputs"] < act["ckpt++ attention-inputs"] < act["none"]
    for mode in ("ckpt++ outputs", "ckpt++ attention-inputs"):
        assert act[mode] == pytest.approx(rows[mode]["formula_MiB_per_layer"], rel=0.02), mode
    out_lse = batch * ((128 // 4) * 8 * 8 * 4 + (128 // 4) * 8 * 4)  # b x s/CP tokens x 8 heads x d 8, fp32; lse
    check = 3 * 64 * 4  # the recompute check's samples of q, k and v
    assert rows["ckpt++ outputs"]["formula_MiB_per_layer"] - act["full"] == pytest.approx((out_lse + check) / 2**20)
    inputs = rows["ckpt++ attention-inputs"]
    assert inputs["extra_a2a_MiB"] == inputs["extra_ring_MiB"] == rows["ckpt++ outputs"]["extra_ring_MiB"] == 0
    assert rows["ckpt++ outputs"]["extra_a2a_MiB"] == rows["full"]["extra_a2a_MiB"]
    assert (rows["full"]["extra_a2a_MiB"] > 0) == (hp > 1) and rows["full"]["extra_ring_MiB"] > 0
    assert rows["full"]["extra_fwd_flops_vs_layer_fwd"] == pytest.approx(1.0)


def test_model_states_and_plot(memory_report, tmp_path):
    args = memory_report.parse_args(["--model-params", "1000000", "--plot", str(tmp_path / "m.png")])
    states = {r["choice"]: r for r in memory_report.model_state_rows(args)}
    replicated = states["replicated (DDP)"]
    full = states["optimizer+grads+params, over 8 ranks"]
    assert full["params"] == pytest.approx(replicated["params"] / 8, rel=1e-3)
    assert full["optimizer"] == pytest.approx(replicated["optimizer"] / 8, rel=1e-3)
    memory_report.plot(
        [{"mode": "none", "activation_MiB_per_layer": 1.0, "extra_fwd_flops_vs_layer_fwd": 0.0}],
        list(states.values()),
        args.plot,
    )
    assert (tmp_path / "m.png").stat().st_size > 1000


@pytest.mark.distributed
@pytest.mark.megatron
def test_sequence_parallelism_saves_what_the_planner_says(memory_report, monkeypatch):
    """TP 2 x 2D CP 2 with and without sequence parallelism: the activations SP saves per layer (measured, no recompute
    and full recompute) are the planner's saving (megatron_2d.plan.memory: the norm and linear inputs and the
    checkpointed layer input sequence-sharded over TP) plus the decoder's final-norm input, which SP shards too and
    the report counts once per decoder, within 5%; and the planner's kept bytes stay within 12% of the measured
    ones either way (its parts leave out RoPE tables and the final norm)."""
    from megatron_2d.plan.hardware import ModelSpec, ParallelSpec
    from megatron_2d.plan.memory import memory_breakdown

    monkeypatch.setattr(memory_report, "MODES", {m: memory_report.MODES[m] for m in ("none", "full")})
    flags = ["--ranks", "4", "--tp", "2", "--hp", "2", "--layers", "2", "--hidden", "64", "--seq", "256", "--plot", ""]
    model = ModelSpec("tiny", layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=256, vocab=128, gated_mlp=False)
    measured, planned = {}, {}
    for sp in (False, True):
        args = memory_report.parse_args(flags + (["--sequence-parallel"] if sp else []))
        rows = {r["mode"]: r["activation_MiB_per_layer"] * 2**20 for r in memory_report.report(args)}
        mb = memory_breakdown(model, ParallelSpec(gpus=4, tp=2, cp=2, sequence_parallel=sp), hp=2, cp=1, w=1, seq=256)
        for mode in ("none", "full"):
            measured[sp, mode] = rows[mode]
            planned[sp, mode] = 2 * mb.tokens * mb.kept_per_token(mode)  # the report runs fp32: twice bf16's bytes
    final_norm = (256 // 2) * 64 * 4 / 2 / 2  # tokens x hidden x fp32, half of it saved by SP, per layer of 2
    for mode in ("none", "full"):
        saved = measured[False, mode] - measured[True, mode]
        assert saved == pytest.approx(planned[False, mode] - planned[True, mode] + final_norm, rel=0.05), mode
    assert measured[False, "none"] == pytest.approx(planned[False, "none"], rel=0.12)
    assert measured[True, "none"] == pytest.approx(planned[True, "none"], rel=0.12)
