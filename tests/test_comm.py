"""Communication pieces (megatron_2d.transport.comm, megatron_2d.groups): the byte counter, ring and direct exchanges
(the direct one on forked gloo ranks), the traffic backend of multi-backend groups."""

import pytest
import torch


def test_comm_counter_counts_by_kind_and_refuses_unknown_kinds():
    from megatron_2d.transport.comm import COMM_KINDS, CommCounter, RingChannel

    counter = CommCounter()
    counter.add("inner_ring", 10)
    counter.add("inner_ring", 5)
    counter.add("all_to_all", 7)
    assert counter.as_dict() == {**{kind: 0 for kind in COMM_KINDS}, "inner_ring": 15, "all_to_all": 7}
    with pytest.raises(ValueError, match=r"unknown communication kind 'ring'"):
        counter.add("ring", 1)
    counter.reset()
    assert set(counter.as_dict().values()) == {0}
    with pytest.raises(ValueError, match=r"a ring channel needs at least 2 ranks, got \[3\]"):
        RingChannel(None, [3], 0, counter, "inner_ring")
    ring = RingChannel(None, [4, 9, 2], 0, counter, "outer_ring")  # ring order, not rank order
    assert (ring.next_rank, ring.prev_rank) == (9, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("receive_early", [True, False], ids=["gloo-early", "with-the-send"])
def test_direct_exchange_receives_into_the_expected_buffer(receive_early):
    from megatron_2d.testing.distributed import run_on_ranks

    def body(rank, world, receive_early):
        import torch.distributed as dist

        from megatron_2d.transport.comm import CommCounter, DirectChannel

        counter = CommCounter()
        peer = (rank + 1) % world
        exchange = DirectChannel(dist.group.WORLD, peer, (rank - 1) % world, counter, "outer_ring")
        exchange._receive_early = receive_early  # NCCL's path: the receive is posted with the send
        made = []
        exchange.expect(lambda: made.append(torch.full((3,), -1.0)) or made[-1])
        assert len(made) == (1 if receive_early else 0)  # the buffer is taken only when it is posted
        pending = exchange.start(torch.full((3,), float(rank)))
        received = pending.wait()
        assert received is made[0]
        # a second exchange without expect() receives into a buffer of its own
        plain = exchange.start(torch.full((2,), float(rank) + 10)).wait()
        return received.tolist(), plain.tolist(), counter.as_dict()["outer_ring"]

    for rank, (received, plain, sent) in enumerate(run_on_ranks(3, body, receive_early)):
        assert received == [float((rank - 1) % 3)] * 3
        assert plain == [float((rank - 1) % 3) + 10] * 2
        assert sent == 5 * 4  # both sends counted, the early receive not


def test_backend_detection_accepts_multi_backend_strings(monkeypatch):
    """A group made with backend="cpu:gloo,cuda:nccl" reports that whole string: its CUDA traffic is NCCL's, so
    collectives need CUDA tensors, the subset-P2P groups get their warm-up, and receives are not posted early.
    (The device is faked: no CUDA here, and torch's CPU build has no NCCL to make such a group.)"""
    import torch.distributed as dist

    import megatron_2d.groups as groups_module
    from megatron_2d.transport.comm import CommCounter, DirectChannel, traffic_backend

    backend = {"name": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    group = object()
    assert traffic_backend(group) == "nccl"
    assert groups_module.collective_device(group) == torch.device("cuda", 0)
    asked, reduced = [], []  # devices of the warm-up's tensors, its batched P2P calls

    empty = torch.empty

    def zeros_on_meta(*shape, device=None):  # records the device the warm-up asks for
        asked.append(torch.device(device))
        return empty(shape, device="meta")

    monkeypatch.setattr(torch, "zeros", zeros_on_meta)
    monkeypatch.setattr(torch, "empty", zeros_on_meta)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, peer, group))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: reduced.append(ops) or [])
    groups_module.warm_up_p2p(group, [5, 6, 7], 0)
    assert asked == [torch.device("cuda", 0)] * 4  # the warm-up ran, with CUDA tensors
    assert reduced == [[(dist.isend, 6, group), (dist.isend, 7, group), (dist.irecv, 6, group), (dist.irecv, 7, group)]]
    assert not DirectChannel(group, 1, 0, CommCounter(), "inner_ring")._receive_early
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU job on the same group: gloo
    assert traffic_backend(group) == "gloo"
    for name, expected in (("nccl", "nccl"), ("gloo", "gloo"), ("cuda:nccl", "nccl"), ("cpu:gloo", "gloo")):
        backend["name"] = name
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert traffic_backend(group) == expected, name


COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "monitored_barrier",
)


def _warm_up_traffic(rank, world, hp, w):
    """build_2d_groups with the warm-up's NCCL branch taken (gloo carries it) and every torch.distributed call
    recorded: per context group, its batched P2P calls (op, peer) and any collective on it."""
    import torch.distributed as dist

    import megatron_2d.groups as groups_module

    calls = []
    saved = {name: getattr(dist, name) for name in (*COLLECTIVES, "batch_isend_irecv")}

    def recording(name):
        def call(*args, **kwargs):
            if name == "batch_isend_irecv":
                ops = args[0]
                calls.append((name, ops[0].group, [("send" if op.op is dist.isend else "recv", op.peer) for op in ops]))
            else:
                calls.append((name, kwargs.get("group"), None))
            return saved[name](*args, **kwargs)

        return call

    saved_backend = groups_module.traffic_backend
    groups_module.traffic_backend = lambda group: "nccl"  # the branch an NCCL job takes; tensors stay on the CPU
    for name in saved:
        setattr(dist, name, recording(name))
    try:
        groups = groups_module.build_2d_groups(hp, w)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        groups_module.traffic_backend = saved_backend
    ring, position = groups.place.context_group, groups.place.context_rank
    found = {}
    for kind, group in (("kv", groups.context_kv_group), ("dkv", groups.context_dkv_group)):
        on_group = [(name, ops) for name, g, ops in calls if g is group]
        found[kind] = on_group
    groups.destroy()
    return list(ring), position, found


@pytest.mark.distributed
@pytest.mark.parametrize("world,hp,w", [(2, 1, 1), (3, 1, 1), (4, 1, 2), (4, 2, 1), (8, 2, 2)])
def test_p2p_warm_up_is_one_ring_step_each_way_and_no_collective(world, hp, w):
    """Each context group gets one batch_isend_irecv: a send to the next and to the previous rank of the context
    ring and a receive from each (one each way on a ring of 2), and no collective (an all_reduce would set up
    NCCL's collective channels on communicators that carry point-to-point traffic only)."""
    from megatron_2d.testing.distributed import run_on_ranks

    for ring, position, found in run_on_ranks(world, _warm_up_traffic, hp, w):
        nxt, prv = ring[(position + 1) % len(ring)], ring[(position - 1) % len(ring)]
        peers = [nxt] if nxt == prv else [nxt, prv]
        expected = [("send", p) for p in peers] + [("recv", p) for p in peers]
        for kind in ("kv", "dkv"):
            assert found[kind] == [("batch_isend_irecv", expected)], (kind, ring, position, found[kind])


def test_receives_are_posted_before_sends(monkeypatch):
    """Ring steps and direct hops post the receive first: on gloo a send posted first holds back the peer's
    payload on their shared connection (comm.post_direct; 2-rank ring 434 ms against 228 on the emulated cluster)."""
    import torch.distributed as dist

    from megatron_2d.transport.comm import CommCounter, RingChannel, post_direct

    posted = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.append(ops) or [])
    x = torch.zeros(2)
    RingChannel(None, [4, 9, 2], 0, CommCounter(), "inner_ring").start(x)
    post_direct(None, x, 7, torch.zeros(2), 5, CommCounter(), "outer_ring")
    post_direct(None, x, 7, None, 5, CommCounter(), "outer_ring")
    assert posted == [
        [(dist.irecv, 2), (dist.isend, 9)],
        [(dist.irecv, 5), (dist.isend, 7)],
        [(dist.isend, 7)],
    ]


def _pair_all_to_all(rank, world):
    import torch.distributed as dist

    from megatron_2d.transport.comm import CommCounter, all_to_all_counted

    pairs = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # group ranks are not global ranks
    group = pairs[0] if rank in (0, 3) else pairs[1]
    counter = CommCounter()
    send = torch.arange(2 * 3, dtype=torch.float32).view(2, 3) + 10 * rank  # [hp, ...]
    collective, used = dist.all_to_all_single, []
    dist.all_to_all_single = lambda *args, **kwargs: used.append(1) or collective(*args, **kwargs)
    try:
        got = all_to_all_counted(send, group, counter)
    finally:
        dist.all_to_all_single = collective
    ref = torch.empty_like(send)
    dist.all_to_all_single(ref, send, group=group)  # gloo's own all-to-all
    return got.tolist(), ref.tolist(), counter.as_dict()["all_to_all"], used


@pytest.mark.distributed
def test_two_rank_all_to_all_matches_gloos_own():
    """The receive-first exchange that replaces gloo's all-to-all between two ranks gives its result and count."""
    from megatron_2d.testing.distributed import run_on_ranks

    for rank, (got, ref, sent, used) in enumerate(run_on_ranks(4, _pair_all_to_all)):
        assert got == ref and used == [], (rank, used)  # the exchange, not gloo's collective
        peer = {0: 3, 3: 0, 1: 2, 2: 1}[rank]
        me = 0 if rank < peer else 1  # group rank
        assert got[me] == [10.0 * rank + 3 * me + i for i in range(3)]  # own slice kept
        assert got[1 - me] == [10.0 * peer + 3 * me + i for i in range(3)]  # the peer's slice for me
        assert sent == 3 * 4  # one slice of 3 fp32 sent
