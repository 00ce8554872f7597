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
