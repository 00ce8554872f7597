"""The transport's posting order before issue 41, for before/after figures in one run (benchmark support only).

Before: a ring step and a direct hop posted the send before the receive, and a 2-rank head all-to-all was gloo's
``all_to_all_single`` (which sends first too). Now every receive is posted first
(:func:`megatron_2d.transport.comm.post_direct` says why). Inside ``with send_first():`` the op runs the old order:

    with send_first():
        out = attention_2d(q, k, v, groups)   # as before the fix; outside, as now

Only the order of posting changes (the same tensors travel, the same results): bench_compare's ``--send-first``
rows time each 2D layout both ways in the same rounds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_2d import head_all_to_all
from megatron_2d.transport import comm, neighbour_exchange


def _ring_start(self, send: torch.Tensor, recv: torch.Tensor | None = None) -> comm.PendingTransfer:
    if self._in_flight:
        raise RuntimeError(f"{self.kind} transfer started while the previous one is still in flight")
    if recv is None:
        recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, self.next_rank, self.group),
        dist.P2POp(dist.irecv, recv, self.prev_rank, self.group),
    ]
    works = dist.batch_isend_irecv(ops)
    self._in_flight = True
    self.counter.add(self.kind, send.numel() * send.element_size())
    return comm.PendingTransfer(works, recv, send, owner=self)


def _post_direct(group, send, dst, recv, src, counter, kind) -> list:
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        counter.add(kind, send.numel() * send.element_size())
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    return dist.batch_isend_irecv(ops) if ops else []


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, counter: comm.CommCounter) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    parts = send.shape[0]
    counter.add("all_to_all", send.numel() * send.element_size() * (parts - 1) // parts)
    return recv


@contextlib.contextmanager
def send_first() -> Iterator[None]:
    """Run the enclosed op calls with the posting order of before the fix (module docstring)."""
    places = ((comm.RingChannel, "start", _ring_start), (comm, "post_direct", _post_direct))
    places += ((neighbour_exchange, "post_direct", _post_direct), (head_all_to_all, "all_to_all_counted", _all_to_all))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in places]
    for owner, name, old in places:
        setattr(owner, name, old)
    try:
        yield
    finally:
        for owner, name, now in saved:
            setattr(owner, name, now)
