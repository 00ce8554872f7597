"""The forked-rank harness (megatron_2d.testing.distributed.run_on_ranks) fails fast and names the root cause, and
nothing in it depends on how fast the machine is: long group timeouts, a world called hung only when no rank uses
CPU, one gloo device per rank."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_2d.testing import distributed
from megatron_2d.testing.distributed import GROUP_TIMEOUT, RankFailure, run_on_ranks

pytestmark = pytest.mark.distributed


def _abort_while_peer_waits(rank, world):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 goes away instead: the connection to it breaks
    else:
        os.abort()  # no report: only the stack faulthandler leaves


def test_a_rank_that_dies_comes_before_the_rank_that_lost_it():
    """Rank 1 dies by a signal while rank 0 waits for it (as a rank aborted in gloo under load): the failure names
    rank 1 first, with its exit code and its Python stack, and rank 0's lost connection after it."""
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _abort_while_peer_waits)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed:\ndied with exit code -6 and no report"), message
    assert "_abort_while_peer_waits" in message.split("rank 0 of 2")[0], message  # rank 1's own stack
    assert "then (it lost a peer) rank 0 of 2 failed:" in message, message


def test_the_root_cause_comes_first_whatever_arrives_first():
    """A rank whose error only says a peer went away is reported after the rank that raised on its own, even when
    its report came first (it can: a peer's socket closes before its traceback is written)."""
    lost = distributed._Failure(0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1", at=1.0)
    root = distributed._Failure(3, "ValueError: the root cause", at=2.0)
    later = distributed._Failure(2, "AssertionError: also wrong", at=3.0)
    message = distributed._failure_message(4, [lost, later, root])
    assert message.index("rank 3 of 4") < message.index("rank 2 of 4") < message.index("rank 0 of 4"), message
    assert message.startswith("rank 3 of 4 failed:\nValueError: the root cause"), message


def _raise_on_rank(rank, world, bad):
    if rank == bad:
        raise ValueError(f"rank {bad} refuses")
    dist.barrier()  # the others wait for it in a collective


def test_a_rank_that_raises_fails_the_world_with_its_traceback():
    with pytest.raises(RankFailure, match=r"^rank 2 of 4 failed:\nTraceback[\s\S]*ValueError: rank 2 refuses"):
        run_on_ranks(4, _raise_on_rank, 2)


def _deadlock(rank, world):
    dist.recv(torch.zeros(1), src=1 - rank)  # both wait for the other


def test_a_hung_world_fails_when_no_rank_uses_cpu():
    """Both ranks wait for each other (their groups would wait GROUP_TIMEOUT): the parent sees no CPU used for
    timeout_s and fails the world, with each rank's Python stack."""
    with pytest.raises(RankFailure, match=r"^hung: no rank of 2 used CPU for 3 s \(ranks done: \[\]\)") as failure:
        run_on_ranks(2, _deadlock, timeout_s=3)
    # and says where each rank waits: its threads' Python stacks
    for rank in (0, 1):
        stacks = str(failure.value).split(f"rank {rank}'s threads:\n")[1]
        assert "in _deadlock" in stacks.split("rank ")[0], str(failure.value)


def _busy_while_peer_waits(rank, world, cpu_seconds):
    if rank == 1:
        start = time.process_time()
        while time.process_time() - start < cpu_seconds:  # CPU time, not wall: as long on a loaded machine
            pass
    dist.barrier()
    return rank


def test_a_slow_world_is_not_a_hung_one():
    """One rank computes for longer than timeout_s while the other waits for it: the world still uses CPU, so it
    runs to the end (on a loaded machine a world is slower, not hung)."""
    assert run_on_ranks(2, _busy_while_peer_waits, 2.0, timeout_s=1) == [0, 1]


def _group_timeouts_and_gloo_loops(rank, world):
    groups = [dist.new_group([0, 1], timeout=GROUP_TIMEOUT) for _ in range(20)]
    dist.barrier(group=groups[-1])
    loops = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            loops += f.read().strip() == "gloo_tcp_loop"
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return loops, default.options._timeout


def test_every_group_of_a_rank_shares_one_gloo_device():
    """21 groups per rank, one gloo event loop (torch's default gives each group its own, each waking every few
    milliseconds), and the default group waits GROUP_TIMEOUT."""
    assert run_on_ranks(2, _group_timeouts_and_gloo_loops) == [(1, GROUP_TIMEOUT)] * 2


def _megatron_group_timeouts(rank, world):
    from megatron.core import parallel_state

    from megatron_2d_dev import tiny_gpt as tg

    tg.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.megatron
def test_megatrons_groups_wait_as_long_as_the_world():
    """tiny_gpt.init_parallel gives Megatron's groups the world's timeout (it gave them one minute: a peer slower
    than that on a loaded machine failed a generated configuration)."""
    assert run_on_ranks(2, _megatron_group_timeouts) == [GROUP_TIMEOUT] * 2
