"""``python -m megatron_2d.plan paper`` (megatron_2d.plan.paper, issue 23): LoongTrain's reported ratios beside the
planner's, differences above 15% explained."""

from __future__ import annotations

import json

import pytest

from megatron_2d.plan.cli import main
from megatron_2d.plan.paper import (
    HEADLINE,
    PAPER_CLUSTER,
    REPORTED,
    TOLERANCE,
    Row,
    efficiency_to_match,
    explain,
    format_reproduction,
    reported_for,
    reproduce,
    step_parts,
)

GQA_32 = dict(models=["7B-GQA"], gpus=[32])


def test_reported_figures_and_their_sources():
    ratios = {(r.seq, r.baseline): r.ratio for r in REPORTED}
    assert ratios[(131072, "Megatron-CP")] == pytest.approx(1.187, abs=1e-3)  # 838.1 / 706.2
    assert ratios[(131072, "DS-Ulysses")] == pytest.approx(1.331, abs=1e-3)  # 838.1 / 629.9
    assert ratios[(1 << 20, "DS-Ulysses")] == pytest.approx(1.227, abs=1e-3)  # 0.448 / 0.365
    assert ratios[(1 << 20, "Megatron-CP")] is None  # out of memory
    assert all("not verified" in r.source for r in REPORTED) and HEADLINE == 2.88
    assert PAPER_CLUSTER.nics_per_node == 4 and PAPER_CLUSTER.net_gbps_per_node == 100.0


def test_rows_ratios_and_explanations():
    rows = reproduce(seqs=[131072, 1 << 20], **GQA_32)
    short, long = rows
    for r in rows:
        two = r.best["2D"]
        assert two is not None and two.kind == "2d" and two.scheme.cp_size == 32
        for b in ("Megatron-CP", "DS-Ulysses"):
            assert r.ratio(b) == pytest.approx(two.estimate.mfu / r.best[b].estimate.mfu)
            parts = step_parts(r.best[b])
            assert sum(parts.values()) == pytest.approx(r.best[b].estimate.step_s)
    # within 15% of the reported ratio: nothing to explain; beyond: predicted, reported and the causes
    for r in rows:
        for b in ("Megatron-CP", "DS-Ulysses"):
            rep, note = reported_for(r, b), explain(r, b, PAPER_CLUSTER, fair=False, search=False)
            if rep is not None and rep.ratio is not None:
                assert (note is None) == (abs(r.ratio(b) / rep.ratio - 1) <= TOLERANCE)
            if note is not None and rep.ratio is not None:
                assert f"reported {rep.ratio:.2f}x" in note and "by cause" in note
    oom = explain(long, "Megatron-CP", PAPER_CLUSTER, fair=False, search=False)
    assert oom.startswith("the paper's Megatron-CP ran out of memory; the planner fits it")
    text = format_reproduction(rows, search=False)
    assert "2.88x" in text and "1.19" in text and "1.33" in text and "OOM" in text
    assert "Differences above 15% and why:" in text


@pytest.mark.slow
def test_the_link_factor_search_finds_the_reported_ratio():
    row = reproduce(seqs=[131072], **GQA_32)[0]
    f = efficiency_to_match(row, "DS-Ulysses", 1.33, PAPER_CLUSTER, fair=False)
    assert f is not None and f < PAPER_CLUSTER.links.nvlink_a2a
    # at that factor the predicted ratio has crossed the reported one; a step above it, not yet
    from dataclasses import replace

    from megatron_2d.plan import get_model
    from megatron_2d.plan.paper import _best

    def ratio_at(x):
        links = replace(PAPER_CLUSTER.links, nvlink_a2a=x, network_a2a=x)
        return Row(
            "7B-GQA", 32, 131072, _best(get_model("7B-GQA"), PAPER_CLUSTER.with_(links=links), 32, 131072, False)
        ).ratio("DS-Ulysses")

    assert ratio_at(f) >= 1.33 > ratio_at(f + 0.01)


def test_cli_json(capsys):
    assert main(["paper", "--json", "--models", "7B-GQA", "--gpus", "32", "--seqs", "128K", "1M"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["gpus"], r["seq"]) for r in rows] == [("7B-GQA", 32, 131072), ("7B-GQA", 32, 1 << 20)]
    cell = rows[0]
    assert cell["reported_vs_DS-Ulysses"]["what"] == "tokens/GPU/s 838.1 vs 629.9"
    assert cell["2D"]["flags"].startswith("--context-parallel-size 32 --cp-comm-type 2d")
    assert rows[1]["reported_vs_Megatron-CP"]["ratio"] is None  # the paper's baseline ran out of memory
    with pytest.raises(SystemExit) as err:
        main(["paper", "--models", "70B-GQA"])  # the paper's models only
    assert err.value.code == 2 and "invalid choice: '70B-GQA'" in capsys.readouterr().err
    assert main(["paper", "--gpus", "48", "--seqs", "128K", "--models", "7B-GQA"]) == 0  # 2 x 48 does not divide
    assert "none fits" in capsys.readouterr().out
