"""Dynamic (hybrid) CP's pure rank math against megatron-core's own code: the group sizes its parallel state builds,
the CP size its scheduler gives a sequence; the per-size layout flag's syntax and its errors."""

from __future__ import annotations

import pytest

from megatron_2d.layout.dynamic import (
    check_dynamic_sizes,
    format_dynamic_layouts,
    hybrid_group_sizes,
    hybrid_slices,
    megatron_cp_size,
    parse_dynamic_layouts,
)
from megatron_2d.layout.topology import Layout2D, LayoutError

pytestmark = pytest.mark.megatron  # imports megatron-core's scheduler and parallel state


def megatron_groups(ranks, monkeypatch):
    """The groups megatron-core 0.19.2's ``create_hybrid_dp_cp_groups`` creates for one DP x CP rank list (its own
    code, its create_group recorded instead of run), plus the whole list it uses for size N."""
    from megatron.core import parallel_state

    made = []
    monkeypatch.setattr(parallel_state, "create_group", lambda r, **kwargs: made.append(list(r)) or tuple(r))
    parallel_state.create_hybrid_dp_cp_groups(ranks[0], list(ranks), None)
    return made + [list(ranks)]


@pytest.mark.parametrize("n", [2, 4, 6, 8, 12, 16, 32])
def test_group_sizes_and_slices_are_megatrons(n, monkeypatch):
    ranks = list(range(100, 100 + n))
    groups = megatron_groups(ranks, monkeypatch)
    assert sorted({len(g) for g in groups}) == [s for s in hybrid_group_sizes(n) if s > 1]
    for size in hybrid_group_sizes(n)[1:]:
        assert hybrid_slices(ranks, size) == [g for g in groups if len(g) == size]


def test_cp_size_is_megatrons_scheduler():
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    class Group:
        def size(self):
            return 8

    for longest in (1, 7, 64, 1000):
        scheduler = BalancedCPScheduler(longest, Group())
        for length in range(1, 9 * longest, max(1, longest // 7)):
            assert megatron_cp_size(length, longest) == scheduler.gpus_needed(length), (length, longest)


def test_sizes_of_odd_worlds():
    assert hybrid_group_sizes(1) == (1,)
    assert hybrid_group_sizes(3) == (1, 3)
    with pytest.raises(LayoutError, match="must be a positive integer"):
        hybrid_group_sizes(0)
    with pytest.raises(LayoutError, match="group size 3 does not divide the 8 ranks"):
        hybrid_slices(range(8), 3)


def test_layouts_round_trip():
    text = "2=2,4=1x4/2,8=2x4/2@context_first,16=8x2"
    layouts = parse_dynamic_layouts(text)
    assert layouts == {
        2: Layout2D(2, 2),
        4: Layout2D(4, 1, 2),
        8: Layout2D(8, 2, 2, "context_first"),
        16: Layout2D(16, 8),
    }
    assert parse_dynamic_layouts(format_dynamic_layouts(layouts)) == layouts
    assert format_dynamic_layouts(layouts) == "2=2x1,4=1x4/2,8=2x4/2@context_first,16=8x2"
    # the default placement of entries that name none
    assert parse_dynamic_layouts("8=2", "context_first")[8].placement == "context_first"
    assert parse_dynamic_layouts(None) == parse_dynamic_layouts(" ") == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("8", r"entry '8': write SIZE=HP\[xCP\]\[/W\]\[@PLACEMENT\]"),
        ("8=x2", r"must be positive integers"),
        ("8=0", r"must be positive integers"),
        ("8=2x2", r"hp x cp = 2 x 2 = 4 is not the group size 8; choose hp among \[1, 2, 4, 8\]"),
        ("8=3", r"head-parallel size 3 does not divide the context-parallel size 8"),
        ("8=2/3", r"inner ring size 3 does not divide the context size cp = CP/hp = 8/2 = 4"),
        ("8=2@rows_first", r"placement 'rows_first' is not valid"),
        ("4=2,4=4", r"gives group size 4 twice"),
    ],
)
def test_layout_errors_name_the_entry(text, message):
    with pytest.raises(LayoutError, match=message):
        parse_dynamic_layouts(text)


def test_sizes_the_run_does_not_have_are_refused():
    check_dynamic_sizes(parse_dynamic_layouts("2=2,8=2"), hybrid_group_sizes(8))
    with pytest.raises(LayoutError, match=r"group sizes \[16\], which this run has no groups of; its group sizes are"):
        check_dynamic_sizes(parse_dynamic_layouts("16=2"), hybrid_group_sizes(8))
