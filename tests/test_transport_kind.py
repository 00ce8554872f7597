"""One transport rule (megatron_2d.layout.transports.transport_kind) for the op and the planner: over generated
layouts, windows and packed batches, the transport the op builds and the one the planner charges are the same kind.

The op's side is its own routing code (``zigzag_route`` / ``packed_route`` of megatron_2d.attention, on the calls
and PackedSharding of each context rank, built over virtual groups: no process groups needed to choose); the planner's
is ``window_work`` / ``packed_window_work`` (megatron_2d.plan.windows), as ``estimate`` calls them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_2d.attention import packed_route, zigzag_route
from megatron_2d.layout.band import SlidingWindow
from megatron_2d.layout.block_calls import context_calls
from megatron_2d.layout.topology import Layout2D, divisors
from megatron_2d.layout.transports import TRANSPORT_KINDS, transport_kind
from megatron_2d.packed_sharding import PackedSharding
from megatron_2d.plan.packed import modes_for, packed_work
from megatron_2d.plan.windows import MAX_EXACT_CP, packed_window_work, window_work
from megatron_2d.testing.loopback import virtual_groups
from megatron_2d.transport.base import KeyRoutes, LocalBlock
from megatron_2d.transport.double_ring import DoubleRing
from megatron_2d.transport.kinds import transport_classes
from megatron_2d.transport.neighbour_exchange import NeighbourExchange


def test_the_rule():
    assert transport_kind(1, 100, True) == transport_kind(1, 100, False) == "local"  # one context rank
    assert transport_kind(4, 0, True) == transport_kind(4, 0, False) == "local"  # nothing another rank sees
    assert transport_kind(4, 100, True) == "double_ring"
    assert transport_kind(4, 100, False) == "neighbour"


def test_the_op_builds_each_kind_from_one_table():
    assert set(transport_classes()) == set(TRANSPORT_KINDS)
    layout = Layout2D(8, 2, 2)
    groups = virtual_groups(layout, 0)  # no process groups: transports whose construction posts nothing
    group_calls = context_calls(layout, 4, True, SlidingWindow(2, 0))
    assert type(transport_classes()["local"].for_routes(groups, KeyRoutes())) is LocalBlock
    neighbour = transport_classes()["neighbour"].for_routes(groups, KeyRoutes(keys=group_calls.keys))
    assert type(neighbour) is NeighbourExchange
    ring = transport_classes()["double_ring"].for_routes(
        virtual_groups(Layout2D(2, 2, 1), 0), KeyRoutes(ring_keys=3)
    )  # cp 1: no hop
    assert type(ring) is DoubleRing and ring.ring_keys == 3


def _layouts(sizes=(2, 4, 8, 16)):
    for CP in sizes:
        for hp in divisors(CP):
            for placement in ("head_first", "context_first") if 1 < hp < CP else ("head_first",):
                yield Layout2D(CP, hp, 1, placement)


def _op_kinds_zigzag(layout: Layout2D, chunk: int, causal: bool, left: int | None) -> set[str]:
    """The kind every context rank's _setup chooses (prepare_call's window, _setup's calls, zigzag_route)."""
    seq = 2 * layout.cp_size * chunk
    window = SlidingWindow.of((-1, -1) if left is None else (left, 0), causal, seq)
    group_calls = context_calls(layout, chunk, causal, window)
    return {
        zigzag_route(virtual_groups(layout, layout.index_of(0, cr)), 2 * chunk, group_calls)[0]
        for cr in range(layout.context_size)
    }


def test_zigzag_op_and_planner_agree_on_the_transport():
    seen = set()
    for layout, chunk in itertools.product(_layouts(), (2, 5, 8)):
        seq, cp = 2 * layout.cp_size * chunk, layout.context_size
        lefts = sorted({0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk, seq // 2, seq - 2, seq - 1, seq})
        for left in [None, *lefts]:
            op = _op_kinds_zigzag(layout, chunk, True, left)
            planner = window_work(layout.head_parallel_size, cp, layout.placement, seq, left).transport
            assert op == {planner}, (layout, chunk, left, op, planner)
            seen.add(planner)
        full = _op_kinds_zigzag(layout, chunk, False, None)  # the planner models full attention as unwindowed
        assert full == {window_work(layout.head_parallel_size, cp, layout.placement, seq, None).transport}
    assert seen == set(TRANSPORT_KINDS)


def _lengths(rng: np.random.Generator, total: int, kind: str) -> list[int]:
    if kind == "one":
        return [total]
    if kind == "short":  # documents no longer than a rank's share: the documents mode keeps each on one rank
        cuts = np.sort(rng.choice(np.arange(1, total), size=max(total // 6, 1), replace=False))
    else:
        cuts = np.sort(rng.choice(np.arange(1, total), size=int(rng.integers(1, 6)), replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


@pytest.mark.parametrize("mode", modes_for("2d"))
def test_packed_op_and_planner_agree_on_the_transport(mode):
    rng = np.random.default_rng(7)
    seen = set()
    for layout in _layouts(sizes=(2, 4, 8)):
        CP, hp, cp = layout.cp_size, layout.head_parallel_size, layout.context_size
        assert cp <= MAX_EXACT_CP
        for shape, total in itertools.product(("one", "few", "short"), (8 * CP, 24 * CP + 6)):
            lengths = _lengths(rng, total, shape)
            cu = np.concatenate([[0], np.cumsum(lengths)])
            for left in (None, 0, 9, total):
                planner = packed_window_work(packed_work(lengths, hp, cp, layout.placement, mode, left), cp)
                op = set()
                for cr in range(cp):
                    packing = PackedSharding(cu, virtual_groups(layout, layout.index_of(0, cr)), mode=mode)
                    window = SlidingWindow.of(
                        (-1, -1) if left is None else (left, 0), True, packing.max_document_length
                    )
                    op.add(packed_route(packing.groups, packing, True, window)[0])
                assert op == {planner.transport}, (layout, mode, lengths, left, op, planner)
                seen.add(planner.transport)
    assert seen == set(TRANSPORT_KINDS)  # cp 1 is local in every mode; documents that cross no rank too


def test_the_planner_refuses_a_kind_it_has_no_cost_for():
    """A new kind reaches the planner through the shared rule; until plan/step.py charges it, estimates fail."""
    from megatron_2d.plan import Job, ParallelSpec, Scheme, get_cluster, get_model, step
    from megatron_2d.plan.windows import WindowWork

    job = step._run(Job(get_model("7B-GQA"), get_cluster("8xH100"), ParallelSpec(gpus=8), 8192), Scheme("2d", 2, 4, 1))
    work, ww = step._windowed_work(job)
    assert ww.transport == "double_ring" and step._attention_times(job, work, ww).time > 0
    with pytest.raises(ValueError, match="no cost model for transport kind 'pigeon'"):
        step._attention_times(job, work, WindowWork(1.0, True, 0, 0, "pigeon"))


def test_the_table_is_every_transport_of_the_folder():
    """docs/architecture.md's "where to add" row: a transport is its module in transport/ (a class with ``kind`` and
    ``for_routes``), its kind and rule in layout/transports.py and the planner's cost; the op's table is read from
    the folder, one class per kind of the rule."""
    assert transport_classes() == {"local": LocalBlock, "neighbour": NeighbourExchange, "double_ring": DoubleRing}
    assert list(transport_classes()) == list(TRANSPORT_KINDS)


def _a_transport(name, kind):
    def for_routes(cls, groups, routes):
        return cls()

    return type(name, (), {"kind": kind, "traffic_kinds": (), "for_routes": classmethod(for_routes)})


@pytest.mark.parametrize(
    "classes, message",
    [
        ([("A", "local"), ("B", "neighbour"), ("C", "double_ring")], None),
        ([("C", "double_ring"), ("A", "local"), ("B", "neighbour")], None),  # another import order, the same table
        ([("A", "local"), ("B", "neighbour")], r"kinds without a class: \['double_ring'\]"),
        (
            [("A", "local"), ("B", "neighbour"), ("C", "double_ring"), ("D", "neighbour")],
            r"'neighbour' is registered already \(B\); D claims it too",
        ),
        (
            [("A", "local"), ("B", "neighbour"), ("C", "double_ring"), ("D", "pigeon")],
            r"D.kind 'pigeon' is not one of \['local', 'neighbour', 'double_ring'\]",
        ),
    ],
)
def test_the_table_holds_each_transport_and_refuses_gaps(classes, message):
    """The registry (megatron_2d.layout.registry, as transport/kinds.py builds it) holds one class per kind, in
    TransportKind's order whatever the registration order; a gap, a second class or an unknown kind is refused."""
    from megatron_2d.layout.choices import TransportKind
    from megatron_2d.layout.registry import Registry

    table = Registry("transport kind", TransportKind, key="kind")
    if message is None:
        for name, kind in classes:
            table.register(_a_transport(name, kind))
        assert [(k, c.__name__) for k, c in table.complete().items()] == [
            ("local", "A"),
            ("neighbour", "B"),
            ("double_ring", "C"),
        ]
        return
    with pytest.raises((RuntimeError, ValueError), match=message):
        for name, kind in classes:
            table.register(_a_transport(name, kind))
        table.complete()


def test_the_planner_costs_every_kind():
    """Each kind of the shared rule has a cost in plan/step.py (the fourth file of a new transport)."""
    from megatron_2d.plan import Job, ParallelSpec, Scheme, get_cluster, get_model, step
    from megatron_2d.plan.windows import WindowWork

    job = step._run(Job(get_model("7B-GQA"), get_cluster("8xH100"), ParallelSpec(gpus=8), 8192), Scheme("2d", 2, 4, 1))
    work, _ = step._windowed_work(job)
    for kind in TRANSPORT_KINDS:
        dense = kind != "neighbour"
        assert (
            step._attention_times(job, work, WindowWork(1.0, dense, 0 if dense else 2, 0 if dense else 64, kind)).time
            > 0
        )
