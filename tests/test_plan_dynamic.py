"""The planner's dynamic (hybrid) CP: the per-size layout rule against every candidate, a length mix planned both
ways, and ``python -m megatron_2d.plan --dynamic``."""

from __future__ import annotations

import json

import pytest

from megatron_2d.layout.dynamic import hybrid_group_sizes
from megatron_2d.layout.topology import Layout2D, every_layout
from megatron_2d.plan.candidates import Scheme
from megatron_2d.plan.cli import main
from megatron_2d.plan.dynamic import layout_for_size, plan_length_mix, rule_layouts, size_candidates
from megatron_2d.plan.hardware import ModelSpec, ParallelSpec, PlanError, get_cluster, get_model
from megatron_2d.plan.job import Job
from megatron_2d.plan.lengths import SEQUENCE_MIXES, sequence_lengths
from megatron_2d.plan.step import estimate

CLUSTER = get_cluster("8xH100")
GQA = ModelSpec("tiny", layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1024, vocab=128)


def time_of(model, layout, seq, tp=1):
    parallel = ParallelSpec(gpus=layout.cp_size * tp, tp=tp, cp=layout.cp_size, dp=1)
    padded = -(-seq // (2 * layout.cp_size)) * 2 * layout.cp_size
    return estimate(Job(model, CLUSTER, parallel, padded), Scheme.of("2d", layout)).time_s


@pytest.mark.parametrize("model", [GQA, get_model("7B-GQA"), get_model("70B-GQA")])
@pytest.mark.parametrize("size", [2, 4, 8, 16, 64])
def test_rule_takes_the_fastest_layout_the_heads_allow(model, size):
    seq = size * 4096
    chosen, seconds = layout_for_size(model, CLUSTER, size, seq)
    allowed = [l for l in every_layout(size) if model.heads % l.head_parallel_size == 0]
    assert chosen in allowed and seconds == time_of(model, chosen, seq)
    assert seconds <= min(time_of(model, layout, seq) for layout in allowed) * (1 + 1e-12)


def test_candidates_follow_the_heads_and_tp():
    assert {l.head_parallel_size for l in size_candidates(GQA, 16)} == {1, 2, 4, 8}  # 16 does not split 8 heads
    assert {l.head_parallel_size for l in size_candidates(GQA, 16, tp=4)} == {1, 2}
    assert all(l.inner_ring_size > 1 or l.context_size == 1 for l in size_candidates(GQA, 8))  # w = 1 is w = cp


def test_rule_layouts_cover_every_size_above_one():
    layouts = rule_layouts(get_model("7B-GQA"), CLUSTER, 8, 4096)
    assert sorted(layouts) == [s for s in hybrid_group_sizes(8) if s > 1]
    assert all(layout.cp_size == size for size, layout in layouts.items())


def test_long_tail_mix_plans_both_ways():
    lengths = sequence_lengths("long-tail", 1 << 18, seed=0).tolist()
    plan = plan_length_mix(get_model("7B-GQA"), CLUSTER, 8, lengths, 4096)
    assert plan.static_cp == 8 and sum(plan.sequences_by_size.values()) == len(lengths)
    assert set(plan.sequences_by_size) == {1, 8}  # 1-2K sequences alone, 16-32K ones on all 8 ranks
    assert plan.winner == "dynamic" and plan.speedup == pytest.approx(plan.static_s / plan.dynamic_s)
    record = plan.to_dict()
    assert record["winner"] == "dynamic" and record["dynamic_layouts"].startswith("8=")


def test_equal_lengths_tie():
    lengths = sequence_lengths("equal", 1 << 18).tolist()
    plan = plan_length_mix(get_model("7B-GQA"), CLUSTER, 8, lengths, 4096)
    assert plan.winner == "tie" and plan.sequences_by_size == {8: 8}
    assert plan.dynamic_layouts[8] == plan.static_layout


def test_mix_errors_name_the_values():
    with pytest.raises(PlanError, match=r"sequences of \[40000\] tokens need more than the 8 ranks"):
        plan_length_mix(GQA, CLUSTER, 8, [40000, 10], 4096)
    with pytest.raises(PlanError, match="at least one sequence"):
        plan_length_mix(GQA, CLUSTER, 8, [], 4096)


@pytest.mark.parametrize("name", SEQUENCE_MIXES)
def test_sequence_mixes_sum_to_the_total(name):
    for total in (1, 100, 16384, 1 << 18):
        lengths = sequence_lengths(name, total, seed=3)
        assert lengths.sum() == total and lengths.min() >= 1
    assert (sequence_lengths(name, 1 << 18, seed=3) == sequence_lengths(name, 1 << 18, seed=3)).all()


def test_long_tail_mix_is_long_tailed():
    lengths = sequence_lengths("long-tail", 1 << 18, seed=0)
    long = lengths[lengths >= (1 << 18) // 16]
    assert 1 <= len(long) <= 6 and long.sum() >= (1 << 18) // 4
    assert ((lengths < (1 << 18) // 16) <= (lengths <= (1 << 18) // 128)).all()  # the rest are short


def test_command_line(capsys):
    assert main(["--dynamic", "--gpus", "8", "--seq", "256K", "--mix", "long-tail", "--max-seqlen-per-rank", "4K"]) == 0
    out = capsys.readouterr().out
    assert "dynamic wins by" in out and "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank 4096" in out
    assert main(["--dynamic", "--gpus", "8", "--seq", "256K", "--mix", "equal", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["winner"] == "tie"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "8", "--seq", "64K", "--mix", "long-tail"], "--mix and --max-seqlen-per-rank plan a sequence mix"),
        (["--dynamic", "--gpus", "8", "--seq", "64K"], "--dynamic needs the sequence lengths"),
        (["--dynamic", "--gpus", "8", "--seq", "64K", "--mix", "equal", "--pp", "2"], "runs without pipelining"),
        (["--dynamic", "--gpus", "8", "--seq", "64K", "--lengths-dist", "uniform"], "with --dynamic use --mix"),
    ],
)
def test_command_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_layout_type_is_the_projects():
    assert isinstance(layout_for_size(GQA, CLUSTER, 4, 4096)[0], Layout2D)
