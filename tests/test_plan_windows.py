"""The planner's sliding-window model: visible work, the op's own transport choice, stock refusals."""

from __future__ import annotations

import pytest

from megatron_2d.plan import ParallelSpec, plan
from megatron_2d.plan.windows import visible_fraction, window_work


@pytest.mark.parametrize("seq, left", [(64, 0), (64, 5), (64, 62), (64, 63), (1000, 17)])
def test_visible_fraction_counts_pairs(seq, left):
    pairs = sum(min(i, left) + 1 for i in range(seq))
    assert visible_fraction(seq, left) == pytest.approx(pairs / (seq * (seq + 1) / 2))


def test_window_work_matches_the_neighbours_by_hand():
    # hp=1, cp=8, S=8192: chunk 512. A window of 100 tokens: the busiest rank's keys are seen by r-1 and r+1,
    # each taking the last 100 keys of one of its chunks.
    ww = window_work(1, 8, "head_first", 8192, 100)
    assert not ww.dense and ww.messages == 2 and ww.key_tokens == 200
    assert window_work(1, 8, "head_first", 8192, 8191).dense  # a window over everything: the ring
    assert window_work(1, 8, "head_first", 8192, None).dense


def test_windowed_plan_refuses_stock_rings_and_cuts_2d_traffic():
    parallel = ParallelSpec(gpus=64)
    full = {(c.kind, c.hp, c.w, c.placement): c for c in plan("7B-GQA", "8xH100", parallel, 131072)}
    windowed = plan("7B-GQA", "8xH100", parallel, 131072, window=4096)
    for c in windowed:
        if c.kind in ("p2p", "a2a+p2p"):
            assert not c.feasible and "refuses sliding-window attention" in c.reason
    best = windowed[0]
    assert best.feasible and best.kind == "2d"
    reference = full[(best.kind, best.hp, best.w, best.placement)]
    assert best.estimate.inter_bytes < reference.estimate.inter_bytes
    assert best.time_ms < reference.time_ms / 3
