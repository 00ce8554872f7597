"""The pure rank math against a brute-force enumeration over large virtual worlds, and its errors."""

import itertools

import pytest

from megatron_2d.layout.topology import Layout2D, LayoutError, place_all_ranks, validate_cp_rank_lists


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def brute_force_groups(cp_ranks, hp, w, placement):
    """Groups by definition, pairwise: which CP indices share a head group / context group / inner ring / slot."""
    CP = len(cp_ranks)
    cp = CP // hp

    def coords(i):  # (head rank, context rank) straight from the placement's definition
        return (i % hp, i // hp) if placement == "head_first" else (i // cp, i % cp)

    def collect(same):
        groups = []
        for i in range(CP):
            members = sorted((j for j in range(CP) if same(i, j)), key=lambda j: key_of(i, j))
            g = [cp_ranks[j] for j in members]
            if g not in groups:
                groups.append(g)
        return sorted(groups)

    def key_of(i, j):  # order inside a head group: head rank; otherwise by context rank
        return coords(j)

    heads = collect(lambda i, j: coords(i)[1] == coords(j)[1])
    contexts = collect(lambda i, j: coords(i)[0] == coords(j)[0])
    intra = collect(lambda i, j: coords(i)[0] == coords(j)[0] and coords(i)[1] // w == coords(j)[1] // w)
    inter = collect(lambda i, j: coords(i)[0] == coords(j)[0] and coords(i)[1] % w == coords(j)[1] % w)
    return heads, contexts, intra, inter


def strided_cp_lists(world, CP, stride):
    """Megatron-like CP rank lists: CP ranks `stride` apart (TP innermost), the rest outer."""
    lists = []
    for outer in range(world // (CP * stride)):
        for inner in range(stride):
            lists.append([outer * CP * stride + inner + stride * k for k in range(CP)])
    return lists


@pytest.mark.parametrize("placement", ["head_first", "context_first"])
@pytest.mark.parametrize("CP", [1, 2, 6, 8, 12, 16])
def test_all_layouts_match_brute_force(CP, placement):
    for hp in divisors(CP):
        for w in divisors(CP // hp):
            layout = Layout2D(CP, hp, w, placement)
            cp_ranks = [3 * r + 1 for r in range(CP)]  # arbitrary global ranks
            expected = brute_force_groups(cp_ranks, hp, w, placement)
            got = (
                sorted(layout.head_groups(cp_ranks)),
                sorted(layout.context_groups(cp_ranks)),
                sorted(layout.inner_ring_groups(cp_ranks)),
                sorted(layout.outer_ring_groups(cp_ranks)),
            )
            assert got == expected, (CP, hp, w, placement)


@pytest.mark.parametrize("placement", ["head_first", "context_first"])
@pytest.mark.parametrize(
    "world, CP, stride, hp, w",
    [
        (4096, 64, 8, 8, 2),  # 64 CP groups over 4096 ranks, TP=8 innermost
        (4096, 64, 8, 4, 4),
        (2048, 32, 4, 2, 8),
        (3072, 48, 2, 3, 4),
    ],
)
def test_large_virtual_world(world, CP, stride, hp, w, placement):
    lists = strided_cp_lists(world, CP, stride)
    layout = Layout2D(CP, hp, w, placement)
    places = place_all_ranks(layout, lists, world)
    assert sorted(places) == list(range(world))
    cp = CP // hp
    for cp_ranks in lists[:: max(1, len(lists) // 4)]:  # brute force on a spread of the groups
        heads, contexts, intra, inter = brute_force_groups(cp_ranks, hp, w, placement)
        for rank in cp_ranks:
            p = places[rank]
            assert list(p.head_group) in heads and rank in p.head_group and len(p.head_group) == hp
            assert list(p.context_group) in contexts and len(p.context_group) == cp
            assert list(p.inner_ring_group) in intra and len(p.inner_ring_group) == w
            assert list(p.outer_ring_group) in inter and len(p.outer_ring_group) == cp // w
            assert p.head_group[p.head_rank] == rank and p.context_group[p.context_rank] == rank
            assert p.cp_ranks[p.cp_index] == rank


def test_placement_adjacency():
    cp_ranks = list(range(16))
    head_first = Layout2D(16, 4, 2, "head_first")
    context_first = Layout2D(16, 4, 2, "context_first")
    assert head_first.head_groups(cp_ranks)[1] == [4, 5, 6, 7]  # head group on adjacent ranks
    assert context_first.context_groups(cp_ranks)[1] == [4, 5, 6, 7]  # ring on adjacent ranks
    assert context_first.inner_ring_groups(cp_ranks)[0] == [0, 1]
    assert context_first.outer_ring_groups(cp_ranks)[0] == [0, 2]


def test_coords_round_trip():
    for placement, (CP, hp) in itertools.product(["head_first", "context_first"], [(12, 3), (8, 8), (8, 1)]):
        layout = Layout2D(CP, hp, 1, placement)
        for i in range(CP):
            assert layout.index_of(*layout.coords_of(i)) == i


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(cp_size=8, head_parallel_size=3, inner_ring_size=1),
            r"head-parallel size 3 does not divide .* 8; valid .* \[1, 2, 4, 8\]",
        ),
        (
            dict(cp_size=8, head_parallel_size=2, inner_ring_size=3),
            r"inner ring size 3 does not divide .* cp = CP/hp = 8/2 = 4; valid inner ring sizes: \[1, 2, 4\]",
        ),
        (
            dict(cp_size=8, head_parallel_size=2, inner_ring_size=1, placement="interleaved"),
            r"placement 'interleaved' is not valid; choose one of \['head_first', 'context_first'\]",
        ),
        (
            dict(cp_size=0, head_parallel_size=1, inner_ring_size=1),
            r"context-parallel size must be a positive integer, got 0",
        ),
        (
            dict(cp_size=4, head_parallel_size=2.0, inner_ring_size=1),
            r"head-parallel size must be a positive integer, got 2.0",
        ),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        Layout2D(**kwargs)


@pytest.mark.parametrize(
    "lists, world, message",
    [
        ([[0, 1], [1, 2]], 3, r"ranks \[1\] appear more than once"),
        ([[0, 1], [2, 3]], 5, r"ranks \[4\] are missing from cp_rank_lists"),
        ([[0, 1], [2]], 3, r"different sizes \[1, 2\]"),
        ([[0, 7]], 2, r"rank 7 in cp_rank_lists is not a valid rank of a world of size 2"),
        ([], 2, r"cp_rank_lists is empty"),
    ],
)
def test_rank_list_errors(lists, world, message):
    with pytest.raises(LayoutError, match=message):
        validate_cp_rank_lists(lists, world)


def test_rank_lists_must_match_layout_size():
    with pytest.raises(LayoutError, match=r"CP groups have 2 ranks but the layout expects CP=4"):
        place_all_ranks(Layout2D(4, 2, 1), [[0, 1], [2, 3]], 4)
