"""The planner with packed document lengths: both modes' costs follow the lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_2d.plan import ParallelSpec, evaluate, plan
from megatron_2d.plan.candidates import enumerate_schemes
from megatron_2d.plan.cli import main
from megatron_2d.plan.hardware import get_model
from megatron_2d.plan.lengths import DISTRIBUTIONS, document_lengths, parse_lengths
from megatron_2d.plan.packed import packed_work

SEQ = 32768
PARALLEL = ParallelSpec(gpus=16)


def _layouts(kind="2d"):
    return [l for l in enumerate_schemes(get_model("7B-GQA"), PARALLEL) if l.kind == kind and l.cp > 1]


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_distributions_sum_to_the_total_and_are_deterministic(name):
    a = document_lengths(name, 12345, seed=3)
    assert a.sum() == 12345 and a.min() >= 1
    assert (a == document_lengths(name, 12345, seed=3)).all()


def test_parse_lengths_reads_lines_and_json():
    assert parse_lengths("3\n\n4 # a comment\n5\n").tolist() == [3, 4, 5]
    assert parse_lengths("[1, 2]").tolist() == [1, 2]
    with pytest.raises(ValueError):
        parse_lengths("3\n0\n")


def test_all_short_documents_documents_mode_has_no_ring_and_beats_zigzag():
    lengths = [128] * (SEQ // 128)
    layouts = _layouts()
    assert layouts
    for layout in layouts:
        z = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths, packing="zigzag")
        d = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths, packing="documents")
        assert d.packed.ring_tokens == 0 and d.estimate.work.kv_bytes == 0 and d.estimate.work.dkv_bytes == 0
        assert z.packed.ring_fraction >= 1.0 and z.estimate.work.kv_bytes > 0
        assert d.time_ms < z.time_ms, layout
        # the attention work follows the lengths: 256 documents of 128 tokens are ~1/256 of one causal sequence
        assert z.packed.flops_fraction < 0.02 and d.packed.flops_fraction < 0.02
        assert d.estimate.kernel_s < 0.02 * evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ).estimate.kernel_s


def test_one_document_equals_the_unpacked_causal_cost():
    for layout in _layouts() + _layouts("p2p") + _layouts("a2a+p2p"):
        plain = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ)
        for mode in ("zigzag", "documents") if layout.kind == "2d" else ("zigzag",):
            packed = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ, lengths=[SEQ], packing=mode)
            assert packed.packed.flops_fraction == pytest.approx(1.0)
            assert packed.packed.ring_fraction == pytest.approx(1.0) and packed.packed.padding_tokens == 0
            assert packed.time_ms == pytest.approx(plain.time_ms, rel=1e-9), (layout, mode)
            assert packed.step_ms == pytest.approx(plain.step_ms, rel=1e-9), (layout, mode)
            assert packed.estimate.inter_bytes == pytest.approx(plain.estimate.inter_bytes, rel=1e-9)


def test_one_half_ring_follows_the_long_share_and_flops_stay_balanced():
    lengths = document_lengths("one-half", SEQ, seed=0)
    for hp, cp in ((1, 16), (2, 8), (4, 4)):
        z = packed_work(lengths, hp, cp, "head_first", "zigzag")
        d = packed_work(lengths, hp, cp, "head_first", "documents")
        assert d.long_documents >= 1 and d.long_documents < z.long_documents
        # the ring carries the long document (half the tokens, padded to 2*cp) instead of everything (padded)
        assert d.ring_fraction == pytest.approx(0.5, abs=0.02)
        assert z.ring_fraction > 1.0
        assert d.pair_imbalance < 0.05 and d.flops_fraction <= z.flops_fraction * 1.05
        assert d.padding_tokens < z.padding_tokens


def test_plan_rows_name_their_mode_and_refuse_lengths_that_do_not_sum():
    lengths = document_lengths("lognormal", SEQ, seed=1).tolist()
    cands = plan("7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths)
    modes = {(c.kind, c.packing) for c in cands if c.runs}
    assert ("2d", "zigzag") in modes and ("2d", "documents") in modes and ("p2p", "zigzag") in modes
    assert all(c.to_dict()["packing"] in ("zigzag", "documents") for c in cands)
    from megatron_2d.plan.hardware import PlanError

    with pytest.raises(PlanError, match="sum to the sequence length"):
        plan("7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths[:-1])


def test_cli_lengths_file_and_distribution(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(["1024"] * 16))
    assert main(["--gpus", "16", "--seq", "16K", "--lengths", str(f), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["packing"] for r in rows} == {"zigzag", "documents"}
    best_docs = min(r["time_ms"] for r in rows if r["packing"] == "documents" and r["time_ms"] is not None)
    best_zig = min(
        r["time_ms"] for r in rows if r["kind"] == "2d" and r["packing"] == "zigzag" and r["time_ms"] is not None
    )
    assert best_docs < best_zig
    assert main(["--gpus", "16", "--seq", "16K", "--lengths-dist", "one-half"]) == 0
    assert "2d documents" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["--gpus", "16", "--seq", "32K", "--lengths", str(f)])
    assert err.value.code == 2


def test_packed_planner_runs_without_torch():
    from tests.test_plan_without_torch import run_blocked

    done = run_blocked(
        "from megatron_2d.plan.cli import main\n"
        "import sys\n"
        "main(['--gpus', '16', '--seq', '16K', '--lengths-dist', 'lognormal', '--json'])\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["packing"] in ("zigzag", "documents")


def test_window_with_packed_lengths_follows_the_op():
    """A causal window over long documents: the visible pairs per rank (brute force over the op's own views), and
    the neighbour exchange's busiest sender in closed form (hp 1, CP 4: a middle rank sends each neighbour the last
    ``left`` keys of one chunk per document); a window reaching every rank keeps the ring."""
    from megatron_2d.layout.topology import Layout2D
    from megatron_2d.packing.views import materialise, zigzag_runs

    lengths, left = [2 * 4 * c for c in (28, 32, 36)], 5
    w = packed_work(lengths, 1, 4, "head_first", "zigzag", left)
    assert not w.dense and w.messages == 2 and w.key_tokens == 2 * len(lengths) * left
    cu = np.concatenate([[0], np.cumsum(lengths)])
    views = materialise(zigzag_runs(cu, Layout2D(4, 1, 1)), cu, 4, sum(lengths) // 4)
    pos = np.where(views >= 0, views - cu[np.searchsorted(cu, views, side="right") - 1], -1)
    visible = np.where(pos >= 0, np.minimum(pos, left) + 1, 0).sum(axis=1)
    assert w.flops_fraction == pytest.approx(visible.max() / (sum(lengths) * (sum(lengths) + 1) / 2 / 4))
    assert packed_work(lengths, 1, 4, "head_first", "zigzag", 200).dense
    assert packed_work(lengths, 1, 4, "head_first", "zigzag").dense


def test_packed_memory_counts_the_slots_each_rank_holds():
    """Activation memory follows the slots per rank: real tokens and padding (zigzag pads every document to 2*CP;
    128-token documents at CP 16 double the slots), not one unpacked sequence of S tokens."""
    lengths = [17] * (SEQ // 17) + [SEQ % 17] if SEQ % 17 else [17] * (SEQ // 17)
    layout = next(l for l in _layouts() if l.hp * l.cp == 16 and l.cp == 16)
    plain = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ)
    for mode in ("zigzag", "documents"):
        packed = evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths, packing=mode)
        ratio = packed.estimate.memory.tokens / plain.estimate.memory.tokens
        assert ratio == pytest.approx(packed.packed.token_fraction)
    assert (
        evaluate(layout, "7B-GQA", "8xH100", PARALLEL, SEQ, lengths=lengths, packing="zigzag").packed.token_fraction
        > 1.5
    )


def test_cli_window_with_lengths(capsys):
    assert main(["--gpus", "16", "--seq", "32K", "--lengths-dist", "lognormal", "--window", "1K", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["packing"] for r in rows if r["kind"] == "2d"} == {"zigzag", "documents"}
    assert any(r["note"] and "neighbour exchange" in r["note"] for r in rows if r["kind"] == "2d")
