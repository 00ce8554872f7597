"""The planner's stock baselines, recompute modes and output: Transformer Engine's bf16 dK/dV, DeepSpeed-Ulysses
with K/V repeated for GQA, recompute modes in time and memory with a recommendation that fits, one JSON schema with
job metadata, exit codes, --plot without matplotlib or without a feasible layout, one row for identical layouts,
--top, the grid, per-layer windows (first written as the fixes of issue #10)."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from megatron_2d.plan import ParallelSpec, Scheme, evaluate, get_cluster, get_model, layer_work, plan
from megatron_2d.plan.candidates import enumerate_schemes, megatron_flags
from megatron_2d.plan.cli import main
from megatron_2d.plan.memory import CHECKPOINT_PLUS_MODES, RECOMPUTE_MODES, memory_breakdown
from megatron_2d.plan.memory_options import DIST_OPT
from megatron_2d.plan.planner import ROW_KEYS, choose_recompute, recommended
from megatron_2d.plan.report import format_plan
from megatron_2d.plan.step import recompute_extra_s, with_recompute

GQA, MHA = get_model("7B-GQA"), get_model("7B-MHA")
H100 = get_cluster("8xH100")
K64, K128, M1 = 65536, 131072, 1 << 20
GB = 1e9


# -- Transformer Engine sends dK/dV in bf16; we send fp32 ------------------------------------------------------


def test_te_rings_carry_bf16_dkv_ours_fp32():
    # 7B-GQA, S=64K on one node, CP=8 as a plain ring (hp=1): K/V block = 2 (k, v) * 2 bytes * S/8 = 8192 tokens
    # * 8 KV heads * 128 = 33554432 bytes. Per layer a rank sends 2*(cp-1) K/V blocks (forward + backward) and cp-1
    # dK/dV blocks (backward): p2p (bf16 dK/dV) 14 + 7 = 21 blocks, ours (fp32 dK/dV, twice the bytes) 14 + 14 = 28.
    par = ParallelSpec(gpus=8)
    kv = 2 * 2 * 8192 * 8 * 128
    p2p = evaluate(Scheme("p2p", 1, 8, 8), GQA, H100, par, K64, recompute="none")
    ours = evaluate(Scheme("2d", 1, 8, 8), GQA, H100, par, K64, recompute="none")
    assert p2p.dkv_comm_dtype == "input" and ours.dkv_comm_dtype == "accumulator"
    assert p2p.estimate.work.kv_bytes == kv and p2p.estimate.work.dkv_bytes == kv
    assert ours.estimate.work.dkv_bytes == 2 * kv
    assert p2p.estimate.intra_bytes == 21 * kv and p2p.estimate.inter_bytes == 0
    assert ours.estimate.intra_bytes == 28 * kv
    # a2a+p2p is Transformer Engine's ring too; a2a has no ring (dtype irrelevant but reported)
    hier = evaluate(Scheme("a2a+p2p", 2, 4, 4), GQA, H100, par, K64, recompute="none")
    assert hier.estimate.work.dkv_bytes == hier.estimate.work.kv_bytes
    # the op's input-dtype riders (--cp-2d-dkv-comm-dtype input) make our ring the same as TE's, and the flags say so
    same = evaluate(Scheme("2d", 1, 8, 8), GQA, H100, par, K64, recompute="none", dkv_comm_dtype="input")
    assert same.estimate.intra_bytes == 21 * kv and same.estimate.time_s == p2p.estimate.time_s
    assert same.flags.count("--cp-2d-dkv-comm-dtype input") == 1 and "dkv" not in ours.flags + p2p.flags


def test_layer_work_dkv_bytes_per_elem():
    w2 = layer_work(GQA, ParallelSpec(gpus=64), hp=8, cp=8, seq=K128, dkv_bytes_per_elem=2)
    w4 = layer_work(GQA, ParallelSpec(gpus=64), hp=8, cp=8, seq=K128)
    assert w2.dkv_bytes == w2.kv_bytes == 8388608 and w4.dkv_bytes == 16777216


# -- DeepSpeed-Ulysses repeats K/V heads for GQA ----------------------------------------------------------------


def test_ds_ulysses_is_feasible_for_gqa_with_repeated_kv():
    # 7B-GQA (32 heads, 8 KV heads) at CP=16: Megatron/TE a2a refuses (16 does not divide 8 KV heads);
    # Megatron-DeepSpeed repeats K/V to all 32 heads, so each rank gets 2 K/V heads after the all-to-all.
    par = ParallelSpec(gpus=16)
    ds = evaluate(Scheme("ds-ulysses", 16, 1, 1), GQA, H100, par, K128)
    assert ds.feasible and ds.estimate.work.kv_heads_per_rank == 2
    # all-to-all bytes per peer: 2 bytes * S/CP = 8192 tokens * 128 * (2*32 q/out + 2*32 repeated k/v) / 16
    assert ds.estimate.work.a2a_peer_bytes == 2 * 8192 * 128 * 128 / 16 == 16777216
    # ours replicates only to lcm(8, 16) = 16 K/V heads: fewer bytes for the same degree
    ours = evaluate(Scheme("2d", 16, 1, 1), GQA, H100, par, K128)
    assert ours.estimate.work.a2a_peer_bytes == 2 * 8192 * 128 * (64 + 32) / 16
    a2a = evaluate(Scheme("a2a", 16, 1, 1), GQA, H100, par, K128)
    assert not a2a.feasible and "KV heads" in a2a.reason
    # still capped by the query heads
    bad = evaluate(Scheme("ds-ulysses", 64, 1, 1), GQA, H100, ParallelSpec(gpus=64), K128)
    assert not bad.feasible and "query heads" in bad.reason


# -- recompute modes: memory and time ---------------------------------------------------------------------------


def test_memory_breakdown_hand_computed():
    # 7B-GQA, S=1M, CP=64 as hp=8 x cp=8, TP=1: tokens = 16384, D = 4096, F = 11008 (gated), Ht = 32, L = 8, d = 128
    mb = memory_breakdown(GQA, ParallelSpec(gpus=64), 8, 8, 8, M1)
    assert mb.tokens == 16384 and mb.layers == 32
    assert mb.layer_input == 2 * 4096 == 8192
    assert mb.dense_rest == 2 * (3 * 4096 + 2 * 11008 + 11008) == 90624
    assert mb.qkv == 2 * (32 + 2 * 8) * 128 == 12288
    assert mb.attn_out == mb.o_proj_in == 8192 and mb.lse == 128
    a_none = 127616
    assert mb.per_token_none == a_none
    kept = {
        "none": a_none,
        "selective": a_none - 8192 - 128,
        "full": 8192,
        "ckpt++": 8192 + 8192 + 128,  # layer input + out + lse
        "ckpt++inputs": 8192 + 12288 + 8192 + 128 + 8192,  # + head-layout q/K/V, the output in both layouts
    }
    assert set(kept) == set(RECOMPUTE_MODES)
    for mode, k in kept.items():
        assert mb.kept_per_token(mode) == k
    assert mb.activations("none") == 16384 * 32 * a_none
    assert mb.activations("selective") == 16384 * 32 * 119296
    assert mb.activations("full") == 16384 * (32 * 8192 + a_none)  # + the one rebuilt layer
    assert mb.activations("ckpt++") == 16384 * (32 * 16512 + a_none)
    assert mb.activations("ckpt++inputs") == 16384 * (32 * 36992 + a_none)
    # hp 1 with one sequence: the output after the (empty) exchange is a view of the ring's, kept once
    hp1 = memory_breakdown(GQA, ParallelSpec(gpus=64), 1, 64, 64, M1)
    assert hp1.out_view and hp1.kept_per_token("ckpt++inputs") == 8192 + hp1.qkv + 8192 + 128
    # block recompute of n = 10 layers: 10 kept small, 22 kept whole, one rebuilt
    assert mb.activations("full", 10) == 16384 * (10 * 8192 + 22 * a_none + a_none)
    # the total adds logits (fp32, 16384 x 32000), buffers and model states to every mode alike
    assert mb.logits == 4 * 16384 * 32000
    for mode in kept:
        assert mb.total(mode) - mb.activations(mode) == mb.logits + mb.comm_buffers + mb.model_states


def test_recompute_time_formulas():
    assert recompute_extra_s("none", 3.0, 2.0, 0.5) == 0.0
    assert recompute_extra_s("selective", 3.0, 2.0, 0.5) == 3.0
    assert recompute_extra_s("full", 3.0, 2.0, 0.5) == 5.0
    assert recompute_extra_s("ckpt++", 3.0, 2.0, 0.5) == 2.5  # the layer and the head all-to-alls again
    assert recompute_extra_s("ckpt++inputs", 3.0, 2.0, 0.5) == 2.0  # the layer without attention
    c = evaluate(Scheme("2d", 8, 8, 8), GQA, H100, ParallelSpec(gpus=64), M1, recompute="none")
    e = c.estimate
    dense_fwd, a2a_fwd = e.dense_layer_s / 3, e.a2a_s / 2
    assert a2a_fwd > 0
    for mode, extra in (
        ("selective", e.attn_fwd_s),
        ("full", e.attn_fwd_s + dense_fwd),
        ("ckpt++", dense_fwd + a2a_fwd),
        ("ckpt++inputs", dense_fwd),
    ):
        r = with_recompute(e, mode)
        assert r.step_s - e.step_s == pytest.approx(32 * extra)
        assert r.time_s == e.time_s  # the attention layer itself is unchanged
        assert r.mfu == pytest.approx(e.mfu * e.step_s / r.step_s)
    assert with_recompute(e, "full", 8).step_s - e.step_s == pytest.approx(8 * (e.attn_fwd_s + dense_fwd))
    # at 1M tokens the attention dominates: ckpt++ is much cheaper than full, and needs more memory; keeping the
    # attention inputs too saves the all-to-alls for more memory still
    full, ckpt, inputs = (with_recompute(e, m) for m in ("full", "ckpt++", "ckpt++inputs"))
    assert inputs.step_s < ckpt.step_s < full.step_s and inputs.memory_gb > ckpt.memory_gb > full.memory_gb


def test_ckpt_plus_plus_is_2d_only():
    c = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, ParallelSpec(gpus=64), K128, recompute="ckpt++")
    assert not c.feasible and "2D only" in c.reason
    assert {
        o.recompute for o in evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, ParallelSpec(gpus=64), K128).options
    } == {"none", "selective", "full"}
    c = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, ParallelSpec(gpus=64), K128, recompute="ckpt++inputs")
    assert not c.feasible and "2D only" in c.reason


def test_recompute_flags():
    lay, par = Scheme("2d", 8, 8, 8), ParallelSpec(gpus=64)
    assert megatron_flags(lay, par, "none") == megatron_flags(lay, par)
    assert megatron_flags(lay, par, "selective").endswith("--recompute-activations")
    for mode, keep in (("ckpt++", "outputs"), ("ckpt++inputs", "attention-inputs")):
        assert megatron_flags(lay, par, mode).endswith(
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            f"--selective-checkpoint-plus-plus --selective-checkpoint-plus-plus-keep {keep}"
        )
        assert "--recompute-method block --recompute-num-layers 3 --selective-checkpoint-plus-plus " in (
            megatron_flags(lay, par, mode, 3)
        )
    assert megatron_flags(lay, par, "full", 5).endswith(
        "--recompute-granularity full --recompute-method block --recompute-num-layers 5"
    )


# -- the recommendation fits in memory ---------------------------------------------------------------------------


def test_one_million_tokens_no_longer_recommends_what_does_not_fit():
    # 7B-GQA, 1M tokens, 64 H100s, the distributed optimizer (memory options: test_plan_memory.py): without
    # recompute every layout needs > 100 GB per GPU.
    cands = plan(GQA, H100, ParallelSpec(gpus=64), M1, memory=DIST_OPT)
    assert all(o.memory_gb > 100 for c in cands if c.runs for o in c.options if o.recompute == "none")
    best = recommended(cands)
    assert best is cands[0] and best.feasible
    assert best.estimate.memory_gb <= H100.memory_budget_gb == pytest.approx(72.0)
    assert all(c.estimate.memory_gb <= H100.memory_budget_gb for c in cands if c.feasible)
    # Checkpoint++ wins here (it skips the attention in the recompute); stock must recompute attention
    assert best.kind == "2d" and best.recompute in CHECKPOINT_PLUS_MODES
    assert [o.recompute for o in best.options] == list(RECOMPUTE_MODES)
    for c in cands:
        if c.feasible and c.kind != "2d":
            assert c.recompute in ("selective", "full") and c.step_ms > best.step_ms


def test_cheapest_mode_that_fits_is_chosen():
    par, lay = ParallelSpec(gpus=64), Scheme("2d", 8, 8, 8)
    roomy = H100.with_(gpu_memory_gb=1000.0)
    assert evaluate(lay, GQA, roomy, par, M1).recompute == "none"  # everything fits: no recompute
    c = evaluate(lay, GQA, H100, par, M1, memory=DIST_OPT)
    assert c.feasible and c.recompute in CHECKPOINT_PLUS_MODES
    # block recompute: the fewest layers that fit, so one layer fewer would not fit
    n, mode = c.estimate.recompute_layers, c.recompute
    mb = c.estimate.memory
    assert 0 < n < 32 and mb.total(mode, n) <= H100.memory_budget_gb * GB < mb.total(mode, n - 1)
    # both keep policies fit; the one chosen is the faster
    both = {o.recompute: o for o in c.options if o.recompute in CHECKPOINT_PLUS_MODES}
    assert all(o.memory_gb <= H100.memory_budget_gb for o in both.values())
    assert c.estimate is min(both.values(), key=lambda o: o.step_s)
    assert f"--recompute-method block --recompute-num-layers {n}" in c.flags
    # forcing a mode that does not fit makes the layout infeasible, with the memory in the reason
    forced = evaluate(lay, GQA, H100, par, M1, recompute="none", memory=DIST_OPT)
    assert not forced.feasible and forced.runs and "out of memory: needs 106" in forced.reason
    # choose_recompute: fastest that fits; when none fits, the least memory
    opts = c.options
    chosen, fits = choose_recompute(opts, 1.0)
    assert not fits and chosen.memory_gb == min(o.memory_gb for o in opts)


def test_no_feasible_layout_exits_non_zero_and_says_what_helps(capsys):
    argv = ["--model", "7B-GQA", "--gpus", "16", "--seq", "4M"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "No feasible layout." in out and "smallest memory found" in out and "what would help" in out
    assert "more GPUs" in out and "no feasible layout" in err
    # the advice is actionable: that much more CP (4x here: 64 GPUs) does fit
    factor = float(re.search(r"about ([0-9.]+)x the context-parallel size", out).group(1))
    gpus = 16 * 2 ** math.ceil(math.log2(factor))
    assert gpus == 64 and recommended(plan(GQA, H100, ParallelSpec(gpus=gpus), 4 << 20)) is not None
    assert recommended(plan(GQA, H100, ParallelSpec(gpus=32), 4 << 20)) is None
    assert main(argv + ["--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows and not any(r["recommended"] or r["feasible"] for r in rows)
    assert any(r["fits_memory"] is False and r["memory_gb"] > 72 for r in rows)
    assert main(["--model", "7B-GQA", "--gpus", "64", "--seq", "1M", "--recompute", "none"]) == 1
    assert "--recompute auto" in capsys.readouterr().out
    assert main(["--model", "7B-GQA", "--gpus", "64", "--seq", "1M"]) == 0


# -- JSON: one schema with job metadata --------------------------------------------------------------------------


def test_json_has_one_schema_with_job_metadata(capsys):
    assert (
        main(
            [
                "--model",
                "7B-GQA",
                "--cluster",
                "8xH100",
                "--gpus",
                "64",
                "--seq",
                "1M",
                "--json",
                "--memory",
                "dist-opt",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    keys = {"job", "rank", "recommended", *ROW_KEYS}
    assert all(set(r) == keys for r in rows)
    kinds = {(r["feasible"], r["fits_memory"]) for r in rows}
    assert (True, True) in kinds and (False, None) in kinds  # feasible and infeasible rows
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["recommended"] for r in rows].count(True) == 1 and rows[0]["recommended"]
    job = rows[0]["job"]
    assert all(r["job"] == job for r in rows)
    assert job["schema_version"] == 6 and job["seq"] == M1 and job["model"]["name"] == "7B-GQA"
    assert job["memory"] == {"choice": "dist-opt", "fair": False, "global_batch_tokens": 4 << 20}
    assert job["parallel"] == {"gpus": 64, "tp": 1, "pp": 1, "dp": 1, "cp": 64, "micro_batch": 1}
    assert job["cluster"]["memory_budget_gb"] == pytest.approx(72.0) and job["recompute"] == "auto"
    best = rows[0]
    assert best["recompute"] in CHECKPOINT_PLUS_MODES and best["memory_gb"] <= best["memory_budget_gb"]
    assert sum(best["memory_parts_gb"].values()) == pytest.approx(best["memory_gb"], abs=0.05)
    assert set(best["recompute_options"]) == {"none", "selective", "full", "ckpt++", "ckpt++inputs"}
    assert best["recompute_options"]["none"]["fits_memory"] is False
    stock = next(r for r in rows if r["kind"] == "p2p")
    assert stock["recompute_options"]["ckpt++"] is stock["recompute_options"]["ckpt++inputs"] is None
    assert stock["dkv_comm_dtype"] == "input"
    bad = next(r for r in rows if not r["feasible"] and r["fits_memory"] is None)
    assert bad["time_ms"] is None and bad["links"] is None and bad["reason"]


# -- identical rows, --top, --plot --------------------------------------------------------------------------------


def test_w1_and_wcp_are_one_row():
    layouts = enumerate_schemes(GQA, ParallelSpec(gpus=64))
    assert not [l for l in layouts if l.kind == "2d" and l.w == 1 and l.cp > 1]
    assert Scheme("2d", 1, 64, 64) in layouts and Scheme("2d", 64, 1, 1) in layouts
    # w = 1 is still accepted and costs exactly what w = cp costs
    par = ParallelSpec(gpus=64)
    a = evaluate(Scheme("2d", 8, 8, 1), GQA, H100, par, K128).estimate
    b = evaluate(Scheme("2d", 8, 8, 8), GQA, H100, par, K128).estimate
    assert a.time_s == b.time_s and a.memory_gb == b.memory_gb
    rows = [c for c in plan(GQA, H100, par, K128) if c.kind == "2d" and c.feasible]
    assert not [c for c in rows if c.w == 1 and c.cp > 1]
    assert len({c.scheme for c in rows}) == len(rows)


def test_window_neighbour_exchange_rows_are_collapsed():
    cands = plan(GQA, H100, ParallelSpec(gpus=64), K128, window=4096)
    nx = [c for c in cands if c.kind == "2d" and c.runs and c.estimate.neighbour_exchange]
    assert nx
    keys = [(c.hp, c.cp, c.placement) for c in nx]
    assert len(keys) == len(set(keys))
    assert all(c.note == "w has no effect (neighbour exchange)" and c.w == c.cp for c in nx)
    assert all(f"--cp-2d-inner-ring-size {c.cp} " in c.flags for c in nx)


def test_top_rejects_non_positive_and_shows_exactly_n(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--gpus", "64", "--seq", "128K", "--top", "-1"])
    assert ei.value.code == 2 and "positive integer" in capsys.readouterr().err
    par = ParallelSpec(gpus=64)
    cands = plan(GQA, H100, par, K128)
    n_ok = sum(c.feasible for c in cands)
    for top in (1, 3, n_ok):
        text = format_plan(cands, GQA, H100, par, K128, top=top)
        assert len(re.findall(r"^ *\d+ +(?:2d|p2p|a2a\+p2p|a2a|ds-ulysses) ", text, re.M)) == top
    text = format_plan(cands, GQA, H100, par, K128, top=None)
    assert len(re.findall(r"^ *\d+ +(?:2d|p2p|a2a\+p2p|a2a|ds-ulysses) ", text, re.M)) == n_ok


def test_plot_without_matplotlib_fails_cleanly(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "p.png"
    assert main(["--gpus", "64", "--seq", "128K", "--plot", str(path), "--plot-seqs", "128K"]) == 1
    out, err = capsys.readouterr()
    assert "Recommended:" in out and "matplotlib" in err and not path.exists()


def test_plot_with_nothing_feasible_still_writes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "none.png"
    assert main(["--gpus", "16", "--seq", "4M", "--plot", str(path), "--plot-seqs", "2M", "4M"]) == 1
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- presets and the grid ------------------------------------------------------------------------------------------


def test_70b_at_tp8_has_one_kv_head_per_rank():
    m = get_model("70B-GQA")
    par = ParallelSpec(gpus=256, tp=8, pp=2)  # CP = 16
    cands = plan(m, H100, par, K128)
    for c in cands:
        if c.kind == "a2a+p2p":
            assert not c.feasible and "does not divide the 1 KV heads per TP rank" in c.reason
        if c.kind == "a2a":
            assert not c.feasible
    assert any(c.feasible and c.kind == "2d" and c.hp > 1 for c in cands)
    assert any(c.feasible and c.kind == "ds-ulysses" for c in cands) is False  # 8 query heads per rank < 16
    assert get_model("7B-KV4").kv_heads == 4 and get_model("8B-GQA").vocab == 128256


@pytest.mark.slow
def test_grid_cells_and_reasons():
    from megatron_2d.plan.grid import CODES, cell, explain, format_grid, grid, summary

    # 8B-GQA at 512 GPUs, 32K with CP forced to 512: communication-bound; 2D goes beyond the 8 KV heads (K)
    c = cell("8B-GQA", 512, 32768, free_cp=False)
    assert c.ratio > 1.2 and "K" in c.codes and c.best_2d.hp > 8 and c.best_2d.scheme.cp_size == 512
    # ... but a stock user would pick a small CP (DP the rest): then it is a tie at the same CP
    c = cell("8B-GQA", 512, 32768)
    assert c.codes == "=" and c.best_2d.scheme.cp_size == c.best_stock.scheme.cp_size < 512
    assert c.best_2d.estimate.tokens_per_gpu_s / c.best_stock.estimate.tokens_per_gpu_s == c.ratio
    # 8B-GQA at 32 GPUs, 1M: even with sharded states neither fits without recompute; 2D's ckpt++ beats stock's
    # recompute of attention (at 256K, ZeRO-3 lets both run without recompute: test_plan_memory.py)
    c = cell("8B-GQA", 32, 1 << 20)
    assert c.codes.startswith("C") and c.best_2d.recompute == "ckpt++"
    assert c.best_stock.recompute in ("full", "selective") and c.ratio > 1.02
    # nothing fits
    c = cell("8B-GQA", 32, 4 << 20)
    assert c.ratio is None and c.codes == "X" and "least memory" in c.reason
    # stock wins honestly: TE's ring with bf16 dK/dV against the same ring of ours (fp32), across nodes
    par = ParallelSpec(gpus=64)
    ours = evaluate(Scheme("2d", 1, 64, 64), GQA, H100, par, K128)
    te = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, par, K128)
    ratio, codes, reason = explain(ours, te, [ours, te], GQA, H100, par, K128)
    assert ratio < 0.98 and codes == "B" and reason.startswith("stock wins")
    # 70B-GQA (TP=8) at 512 GPUs, 256K: ckpt++ fits at a smaller CP than stock needs without recompute
    c = cell("70B-GQA", 512, 262144)
    if c.ratio > 1.02:
        assert c.codes.startswith(("C", "S")) and c.best_2d.recompute == "ckpt++"
    cells = grid(["7B-MHA"], [32], [65536, 4 << 20])
    text = format_grid(cells)
    assert "7B-MHA" in text and "none X" in text and all(f"  {k}  " in text for k in CODES)
    s = summary(cells)
    assert s["none"] == 1 and sum(s.values()) == 2


def test_grid_prints_with_rich_on_a_terminal():
    import io

    pytest.importorskip("rich")
    from megatron_2d.plan.grid import grid, print_grid

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    print_grid(grid(["7B-MHA"], [32], [32768]), stream=out)
    assert "7B-MHA TP=1 PP=1" in out.getvalue() and "Codes:" in out.getvalue() and "tie" in out.getvalue()


def test_grid_cli(capsys):
    assert main(["grid", "--models", "7B-KV4", "--gpus", "64", "--seqs", "32K", "1M", "--details"]) == 0
    out = capsys.readouterr().out
    assert "7B-KV4" in out and "Codes:" in out and "2D:" in out and "stock:" in out


# -- per-layer windows (the hook for mixed layers) ----------------------------------------------------------------


def test_per_layer_window_pattern_is_the_layer_weighted_mean():
    from megatron_2d.plan.cli import parse_window
    from megatron_2d.plan.planner import layer_windows

    assert parse_window("4K") == 4096 and parse_window("4K,full") == (4096, None)
    assert layer_windows((4096, None), 32) == {4096: 16, None: 16}
    assert layer_windows((128, 128, None), 4) == {128: 3, None: 1}
    par, lay = ParallelSpec(gpus=64), Scheme("2d", 8, 8, 8)
    full = evaluate(lay, GQA, H100, par, K128, recompute="none").estimate
    win = evaluate(lay, GQA, H100, par, K128, window=4096, recompute="none").estimate
    mix = evaluate(lay, GQA, H100, par, K128, window=(4096, None), recompute="none").estimate
    assert mix.time_s == pytest.approx((full.time_s + win.time_s) / 2)
    assert mix.inter_bytes == pytest.approx((full.inter_bytes + win.inter_bytes) / 2)
    # the step counts each layer once: 16 full + 16 windowed layers
    assert mix.step_s == pytest.approx((full.step_s + win.step_s) / 2)
    assert mix.memory_gb == full.memory_gb and not mix.neighbour_exchange
    # a windowed layer anywhere makes Transformer Engine's rings refuse the model
    p2p = evaluate(Scheme("p2p", 1, 64, 64), GQA, H100, par, K128, window=(4096, None))
    assert not p2p.feasible and "refuses sliding-window" in p2p.reason


def test_layers_to_fit_is_the_fewest_that_fit():
    mb = memory_breakdown(GQA, ParallelSpec(gpus=64), 8, 8, 8, M1)
    for mode in ("full", "ckpt++"):
        for step in (1, 2, 4):
            for budget in (50e9, 60e9, 72e9, 100e9, 200e9, 10e9):
                n = mb.layers_to_fit(mode, budget, step)
                brute = next((k for k in range(step, 33, step) if mb.total(mode, k) <= budget), None)
                assert n == brute, (mode, step, budget)


def test_grid_json(capsys):
    assert main(["--grid", "--models", "8B-GQA", "--gpus", "32", "--seqs", "1M", "4M", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and all(set(r) == set(rows[0]) for r in rows)
    ok, none = rows
    assert ok["codes"].startswith("C") and ok["best_2d"]["recompute"] == "ckpt++" and ok["ratio"] > 1
    assert none["codes"] == "X" and none["best_2d"] is None and none["ratio"] is None
