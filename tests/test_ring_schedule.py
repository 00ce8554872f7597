"""One schedule, two uses: the ring loop does exactly what ring_schedule describes, which the planner replays."""

from __future__ import annotations

import pytest
import torch

import megatron_2d
from megatron_2d.layout.ring_schedule import CHANNEL_OF, CHANNELS, EventKind, double_ring_events, replay
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.transport.double_ring import DoubleRing

TIMEOUT = GROUP_TIMEOUT


def record_loop(rank, world, hp, w, backward):
    """Run DoubleRing.run with a recording compute and recording exchanges; return (log, expected log)."""
    groups = megatron_2d.build_2d_groups(hp, w, timeout=TIMEOUT)
    ring = DoubleRing(groups)
    log = []
    for name in CHANNELS:
        exchange = ring.channels[name]
        if exchange is None:
            continue
        if hasattr(exchange, "expect"):

            def expect(new_buffer, _orig=exchange.expect, _name=name):
                log.append(("expect", _name))
                return _orig(new_buffer)

            exchange.expect = expect

        def start(send, recv=None, _orig=exchange.start, _name=name):
            log.append(("post", _name))
            pending = _orig(send, recv)
            orig_wait = pending.wait

            def wait():
                log.append(("wait", _name))
                return orig_wait()

            pending.wait = wait
            return pending

        exchange.start = start
    kv = torch.full((1, 4, 1, 2 + 3), float(groups.place.context_rank))  # [b, keys, g, dk + dv]

    def compute(block, source, first_key):
        log.append(("compute", source))
        assert first_key == 0  # the ring always holds whole blocks
        assert torch.all(block == source), (source, block.flatten()[:2])  # the block really is source's
        return [(0, 4, (torch.ones(1, 4, 1, 2), torch.ones(1, 4, 1, 3)))] if backward else None

    result = ring.run(kv, compute, dkv_dtype=torch.float32 if backward else None)
    expected = []
    for e in double_ring_events(groups.context_size, w, backward):
        if e.kind is EventKind.COMPUTE:
            expected.append(("compute", ring.source(*e.source_offset)))
        elif e.kind.posts:
            expected.append(("post", e.channel))
        elif e.kind.expects:
            expected.append(("expect", e.channel))
        elif e.kind.waits:
            expected.append(("wait", e.channel))
    visited = sorted(s for kind, s in log if kind == "compute")
    own_grad = None if result is None else result.flatten().tolist()
    return log, expected, visited, own_grad


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, w", [(4, 1, 1), (4, 1, 2), (4, 1, 4), (8, 1, 2), (8, 2, 2), (8, 1, 4), (6, 1, 3), (2, 2, 1)]
)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_loop_follows_the_schedule(world, hp, w, backward):
    for log, expected, visited, own_grad in run_on_ranks(world, record_loop, hp, w, backward):
        assert log == expected
        assert visited == list(range(world // hp))  # every context rank's block, once
        if backward:  # every rank added 1 to my block's dK/dV
            assert own_grad == [float(world // hp)] * len(own_grad)


def test_replay_by_hand():
    links = {"inner_kv": "in", "inner_dkv": "in", "outer_kv": "out", "outer_dkv": "out", "final_dkv": "in"}
    fwd = double_ring_events(2, 2, False)  # post kv, compute, wait kv, compute
    assert [e.kind for e in fwd] == [
        EventKind.POST_INNER_KV,
        EventKind.COMPUTE,
        EventKind.WAIT_INNER_KV,
        EventKind.COMPUTE,
    ]
    slow = {"inner_kv": 3.0, "outer_kv": 0.0, "inner_dkv": 0.0, "outer_dkv": 0.0}
    assert replay(fwd, 1.0, slow, links) == 4.0  # the wait exposes 3 - 1
    fast = dict(slow, inner_kv=0.5)
    assert replay(fwd, 1.0, fast, links) == 2.0  # hidden behind the first compute
    # backward, cp = 2, w = 2: the own block's dK/dV stays home; the rider starts at step 1 on the neighbour's
    # block and takes its one hop, to the owner, exposed: 2 computes + 4
    bwd = double_ring_events(2, 2, True)
    t = {"inner_kv": 0.5, "outer_kv": 0.0, "inner_dkv": 0.0, "outer_dkv": 0.0, "final_dkv": 4.0}
    # post kv 0-0.5 | compute 0-1 | wait kv | compute 1-2 | last hop 2-6 | wait 6
    assert replay(bwd, 1.0, t, links) == 6.0
    # backward, cp = 4, w = 2 (two inner rings): no aligning hop; the outer rider has a round to arrive; the last hop
    # goes diagonally to (ring + 1, slot + 1), on the outer link
    links = dict(links, final_dkv="out")
    bwd = double_ring_events(4, 2, True)
    assert [e.channel for e in bwd if e.kind.posts] == [
        "outer_kv",
        "inner_kv",
        "outer_dkv",
        "inner_kv",
        "inner_dkv",
        "final_dkv",
    ]
    t = {"inner_kv": 0.5, "outer_kv": 1.5, "inner_dkv": 0.5, "outer_dkv": 3.0, "final_dkv": 2.0}
    # round 0: outer kv 0-1.5, inner kv 0-0.5 | compute (own, kept home) 0-1 | compute 1-2 | carried (outer) 2-5
    # round 1: inner kv 2-2.5 | compute 2-3 | rider 3-3.5 | compute 3-4 | wait carried 5 | diagonal 5-7 | wait 7
    assert replay(bwd, 1.0, t, links) == 7.0
    # a carried hop no longer than a round is hidden: 4 computes + the exposed last hop
    assert replay(bwd, 1.0, dict(t, outer_dkv=1.5), links) == 6.0
    assert set(CHANNEL_OF.values()) - {None} == set(t) == set(CHANNELS)


def test_every_event_kind_is_one_action_and_the_loop_runs_each():
    """Each kind posts, expects, waits or works locally (exactly one), local work has no channel; kinds compare
    equal to their names, which the planner's replay may read. (The ring loop's table of one method per kind is
    built when megatron_2d.transport.double_ring is imported, above: a kind without a method fails that import.)"""
    for kind in EventKind:
        actions = [kind.posts, kind.expects, kind.waits, kind.channel is None]
        assert actions.count(True) == 1, (kind, actions)
        assert kind == kind.value and EventKind(kind.value) is kind
    assert set(CHANNEL_OF) == set(EventKind)


@pytest.mark.parametrize("cp, w", [(2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (6, 3), (6, 2)])
def test_riders_move_cp_minus_1_times(cp, w):
    """Every variant moves a rider cp - 1 times per rank (the own block's dK/dV stays home, as in Transformer
    Engine's ring), none of them back to where its round began."""
    posts = [e.channel for e in double_ring_events(cp, w, True) if e.kind.posts]
    dkv = [c for c in posts if c.endswith("_dkv")]
    nw = cp // w
    assert len(dkv) == cp - 1
    assert dkv.count("outer_dkv") == nw - 1 - (w == 1)
    assert dkv.count("final_dkv") == 1
    assert dkv.count("inner_dkv") == (nw - 1) * (w - 1) + max(w - 2, 0)
    assert len(posts) - len(dkv) == cp - 1  # K/V


@pytest.mark.parametrize("cp, w", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (6, 3), (6, 2)])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_every_wait_but_the_last_hop_follows_a_compute(cp, w, backward):
    """What the schedule promises: a transfer is awaited only after at least one compute has run since it was
    posted (so it can hide behind that compute), except the last dK/dV hop, which nothing is left to hide."""
    posted_at = {}
    computes = 0
    for e in double_ring_events(cp, w, backward):
        if e.kind is EventKind.COMPUTE:
            computes += 1
        elif e.kind.posts:
            assert e.channel not in posted_at, f"{e.channel} posted twice without a wait"
            posted_at[e.channel] = computes
        elif e.kind.waits:
            hidden_behind = computes - posted_at.pop(e.channel)
            assert hidden_behind >= (0 if e.kind is EventKind.WAIT_FINAL else 1), (e.kind, hidden_behind)
    assert not posted_at  # every transfer is awaited


# the outer ring at w = 1 does what the inner ring does at w = cp, event by event
_OUTER_AS_INNER = {
    EventKind.POST_OUTER_KV: EventKind.POST_INNER_KV,
    EventKind.WAIT_OUTER_KV: EventKind.WAIT_INNER_KV,
    EventKind.POST_CARRIED: EventKind.POST_RIDER,
    EventKind.TAKE_CARRIED: EventKind.WAIT_RIDER,
}


def _as_inner(event):
    kind = _OUTER_AS_INNER.get(event.kind, event.kind)
    offset = event.source_offset
    return kind, None if offset is None else (offset[1], offset[0])  # (outer step, inner step) swapped


@pytest.mark.parametrize("cp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("backward", [False, True])
def test_one_rank_inner_rings_are_the_one_ring(cp, backward):
    """w = 1 and w = cp are the same ring: the same events (outer ring for inner ring), every rank sending to the
    same rank on it and holding the same blocks in the same order. So neither default can be the slower one; the
    planner and the benchmarks list the ring once, as w = cp."""
    one_rank = [_as_inner(e) for e in double_ring_events(cp, 1, backward)]
    one_ring = [(e.kind, e.source_offset) for e in double_ring_events(cp, cp, backward)]
    assert one_rank == one_ring
    assert any(kind in _OUTER_AS_INNER for kind in (e.kind for e in double_ring_events(cp, 1, backward)))
    for hp in (1, 2):
        w1, wcp = megatron_2d.Layout2D(hp * cp, hp, 1), megatron_2d.Layout2D(hp * cp, hp, cp)
        assert wcp == megatron_2d.Layout2D(hp * cp, hp)  # the default
        for index in range(hp * cp):
            assert w1.send_peers(index)["outer"] == wcp.send_peers(index)["inner"]
            assert w1.send_peers(index)["inner"] == wcp.send_peers(index)["outer"] == []
