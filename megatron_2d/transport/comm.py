"""Communication helpers: the byte counter, the point-to-point channels of the K/V transports and the head group's
collectives.

    CommCounter       bytes this rank sent, by kind (all_to_all, inner_ring, outer_ring, neighbour)
    RingChannel      send to the next rank of a ring, receive from the previous one (the Double-Ring's rings)
    DirectChannel    send to one fixed rank, receive from another, the receive postable early (the last dK/dV hop)
    post_direct       one send and/or receive between any two ranks (the neighbour exchange, DirectChannel)
    PendingTransfer   a transfer in flight: ``wait()`` gives what arrived, ``sent`` what left (both transports)
    BufferPool        send and receive buffers of one run, reused from step to step (both transports)
    all_to_all_counted, all_gather_counted   the head group's collectives, bytes counted
    check_same_on_every_rank   refuse, on every rank at once, a value that differs between ranks (build time)

No device synchronisation happens here, so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..layout.choices import StrEnum
from ..layout.ring_schedule import Link


class CommKind(StrEnum):
    """What a sent byte is counted as (:class:`CommCounter`): the head group's all-to-all, a ring's links (inner or
    outer), the neighbour exchange."""

    ALL_TO_ALL = "all_to_all"
    INNER_RING = "inner_ring"
    OUTER_RING = "outer_ring"
    NEIGHBOUR = "neighbour"


COMM_KINDS = tuple(CommKind)
RING_TRAFFIC = {Link.INNER: CommKind.INNER_RING, Link.OUTER: CommKind.OUTER_RING}
"""The kind a ring hop's bytes count as, by the links it crosses."""


def traffic_backend(group: dist.ProcessGroup) -> str:
    """The backend that carries this library's tensors on ``group``: its backend name, or for a multi-backend
    group (``backend="cpu:gloo,cuda:nccl"``, which ``dist.get_backend`` reports whole) the one of the device the
    tensors live on: CUDA's where CUDA is available, else the CPU's."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    if "cuda" in by_device and torch.cuda.is_available():
        return by_device["cuda"]
    return by_device.get("cpu", next(iter(by_device.values())))


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the current GPU for NCCL (also as the CUDA backend of
    a multi-backend group such as "cpu:gloo,cuda:nccl"), else the CPU."""
    if traffic_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_on_every_rank(
    value,
    groups: Sequence[dist.ProcessGroup | None],
    what: str,
    *,
    fingerprint: int | None = None,
    error: type = ValueError,
) -> None:
    """Raise ``error`` on every rank of ``groups`` at once unless they all hold the same ``value``.

    groups: process groups that together span the ranks that must agree (e.g. a rank's head and context groups
    span its CP group; ``dist.group.WORLD`` every rank); None entries (single-rank groups) are skipped. The ranks
    compare a 63-bit ``fingerprint`` of the value (default: a CRC of its repr) with one all-reduce (min and max)
    per group, on the groups' device: one device-to-host read, and every rank learns the same verdict, so none
    hangs. Only on a mismatch are the values gathered, to name in the message the ranks whose fingerprint differs
    and what they hold (``what`` says what differs; ``value`` need only be picklable and printable)."""
    span = [g for g in groups if g is not None]
    if not span:
        return
    if fingerprint is None:
        fingerprint = int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1
    extremes = torch.from_numpy(np.array([fingerprint, -fingerprint], dtype=np.int64)).to(collective_device(span[0]))
    for group in span:
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=group)
    low, neg_high = extremes.tolist()
    if low == fingerprint and neg_high == -fingerprint:
        return
    rank, others = dist.get_rank(), {}
    for group in span:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (fingerprint, value), group=group)
        others.update((r, v) for r, (f, v) in zip(dist.get_process_group_ranks(group), gathered) if f != fingerprint)
    differing = sorted(others)
    seen = (
        f"rank {differing[0]} has {_shown(others[differing[0]])}"
        if differing
        else "ranks outside its own groups hold another"
    )
    raise error(
        f"{what}: rank {rank} has {_shown(value)}, {seen} (ranks differing from rank {rank} in its groups: "
        f"{differing}); every rank must pass the same values"
    )


def _shown(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


class CommCounter:
    """Bytes this rank sent, by kind (all_to_all, inner_ring, outer_ring, neighbour); accumulates until reset()."""

    def __init__(self) -> None:
        self._bytes: Counter = Counter()

    def add(self, kind: CommKind, nbytes: int) -> None:
        if kind not in COMM_KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; expected one of {COMM_KINDS}")
        self._bytes[kind] += int(nbytes)

    def reset(self) -> None:
        self._bytes.clear()

    def as_dict(self) -> dict[str, int]:
        return {kind: self._bytes[kind] for kind in COMM_KINDS}

    def __repr__(self) -> str:
        return f"CommCounter({self.as_dict()})"


class PendingTransfer:
    """A transfer in flight: ``wait()`` returns the received tensor (None when nothing is received) once the send and
    the receive have completed; ``sent`` is the tensor sent (None when nothing is sent), free again after the wait."""

    def __init__(
        self,
        works: list,
        received: torch.Tensor | None,
        sent: torch.Tensor | None = None,
        owner: RingChannel | None = None,
    ) -> None:
        self._works, self._received, self.sent, self._owner = works, received, sent, owner

    def wait(self) -> torch.Tensor | None:
        for work in self._works:
            work.wait()
        if self._owner is not None:
            self._owner._in_flight = False
        return self._received


class RingChannel:
    """Send to the next rank and receive from the previous rank of one ring (one process group).

    ``ring`` lists the ring's global ranks in ring order; ``position`` is this rank's place in it. One transfer
    per instance may be in flight; separate traffic (K/V vs dK/dV) uses separate instances and groups.
    """

    def __init__(
        self, group: dist.ProcessGroup, ring: Sequence[int], position: int, counter: CommCounter, kind: CommKind
    ) -> None:
        if len(ring) < 2:
            raise ValueError(f"a ring channel needs at least 2 ranks, got {list(ring)}")
        self.group, self.kind, self.counter = group, kind, counter
        self.next_rank = ring[(position + 1) % len(ring)]
        self.prev_rank = ring[(position - 1) % len(ring)]
        self._in_flight = False

    def start(self, send: torch.Tensor, recv: torch.Tensor | None = None) -> PendingTransfer:
        """Post the receive into ``recv`` (allocated if None), then the send of ``send``; return at once.

        The receive goes first (:func:`post_direct` says why); NCCL runs the two as one group either way."""
        if self._in_flight:
            raise RuntimeError(f"{self.kind} transfer started while the previous one is still in flight")
        if recv is None:
            recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group),
            dist.P2POp(dist.isend, send, self.next_rank, self.group),
        ]
        works = dist.batch_isend_irecv(ops)
        self._in_flight = True
        self.counter.add(self.kind, send.numel() * send.element_size())
        return PendingTransfer(works, recv, send, owner=self)


class DirectChannel:
    """Send to one fixed rank and receive from another over one process group (not a ring: for example the
    Double-Ring's last dK/dV hop); the same ``start``/``wait`` contract as :class:`RingChannel`, and the receive
    can be posted ahead of the send (:meth:`expect`)."""

    def __init__(self, group: dist.ProcessGroup, dst: int, src: int, counter: CommCounter, kind: CommKind) -> None:
        self.group, self.kind, self.counter = group, kind, counter
        self.next_rank, self.prev_rank = dst, src
        self._in_flight = False
        # gloo moves a posted receive's data on its own threads whenever the sender sends; an early NCCL receive
        # would hold a GPU block spinning until then, so NCCL posts it with the send
        self._receive_early = traffic_backend(group) == "gloo"
        self._expected = None  # (buffer factory, the buffer and its receive's works if already posted)

    def expect(self, new_buffer: Callable[[], torch.Tensor]) -> None:
        """Receive the next :meth:`start` into ``new_buffer()``; where the backend lets the data land before this
        rank waits for it (gloo), the buffer is taken and its receive posted now, else both wait for the send."""
        recv = works = None
        if self._receive_early:
            recv = new_buffer()
            works = post_direct(self.group, None, self.next_rank, recv, self.prev_rank, self.counter, self.kind)
        self._expected = (new_buffer, recv, works)

    def start(self, send: torch.Tensor, recv: torch.Tensor | None = None) -> PendingTransfer:
        """Post the send of ``send`` to ``dst`` and the receive from ``src`` into the expected buffer, else into
        ``recv`` (allocated if None)."""
        early = None
        if self._expected is not None:
            (new_buffer, recv, early), self._expected = self._expected, None
            recv = new_buffer() if recv is None else recv
        elif recv is None:
            recv = torch.empty_like(send)
        works = post_direct(
            self.group,
            send,
            self.next_rank,
            None if early is not None else recv,
            self.prev_rank,
            self.counter,
            self.kind,
        )
        return PendingTransfer(works + (early or []), recv, send, owner=self)


def post_direct(
    group: dist.ProcessGroup,
    send: torch.Tensor | None,
    dst: int,
    recv: torch.Tensor | None,
    src: int,
    counter: CommCounter,
    kind: CommKind,
) -> list:
    """Post a receive into ``recv`` from ``src``, then a send of ``send`` to global rank ``dst`` (either may be
    None: the peers decide from the same pure schedule, so posts always match). Returns the works to wait on.

    Receive first: gloo carries a rank pair's traffic on one TCP connection, and a receive's "ready to receive"
    notice travels on it in line with the data, while the peer's send waits for that notice. Posted after this
    rank's send, the notice waits behind this rank's whole payload, and where the peer sends back on the same
    pair (a ring of 2, a direct hop to the previous rank) the two payloads cross one after the other: on the
    emulated cluster a 2-rank ring step of 512 KiB at 20 Mbit/s took 434 ms sent first, 228 ms received first
    (210 ms at the rate; docs/benchmarks.md). NCCL runs a batch as one group, in any order."""
    ops = []
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        counter.add(kind, send.numel() * send.element_size())
    return dist.batch_isend_irecv(ops) if ops else []


class BufferPool:
    """Buffers of one dtype and device reused across the steps of one run instead of one allocation per step.

    Every buffer holds ``shape`` [b, keys, ...]; ``get()`` hands one out whole, ``get(keys)`` a contiguous
    [b, keys, ...] on one (keys <= shape[1]: the neighbour exchange's slices of varying size); ``put`` gives it back
    (whole or as handed out) once nothing reads it."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self._spec = (tuple(shape), dtype, device)
        self._free: list = []

    def get(self, keys: int | None = None) -> torch.Tensor:
        shape, dtype, device = self._spec
        buf = self._free.pop() if self._free else torch.empty(shape, dtype=dtype, device=device)
        if keys is None or keys == shape[1]:
            return buf
        sliced = (shape[0], keys, *shape[2:])  # [b, keys, ...] at the buffer's start
        return buf.view(-1)[: math.prod(sliced)].view(sliced)

    def put(self, buf: torch.Tensor) -> None:
        self._free.append(buf if buf._base is None else buf._base)  # a slice of get(keys): its whole buffer


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host index array (numpy or CPU tensor) as a tensor on ``device``: on a GPU through pinned memory,
    non-blocking (no host-device synchronisation); on the CPU without a copy."""
    tensor = torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def all_to_all_counted(send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter) -> torch.Tensor:
    """all_to_all_single over dim 0 of ``send`` [hp, ...]: slice j goes to head rank j; returns [hp, ...].

    Between two gloo ranks it is one receive-first exchange instead: gloo's all-to-all posts its send to the peer
    before its receive from the same peer, so the peer's payload waits behind this rank's (see
    :func:`post_direct`); measured on the emulated cluster, 2 ranks, 256 KiB each way at 20 Mbit/s: 230 ms
    against 112 ms received first (105 ms at the rate)."""
    recv = torch.empty_like(send)
    parts = send.shape[0]
    if parts == 2 and traffic_backend(group) == "gloo":
        me = dist.get_rank(group)
        peer = dist.get_global_rank(group, 1 - me)
        recv[me].copy_(send[me])
        ops = [dist.P2POp(dist.irecv, recv[1 - me], peer, group), dist.P2POp(dist.isend, send[1 - me], peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        dist.all_to_all_single(recv, send, group=group)
    counter.add(CommKind.ALL_TO_ALL, send.numel() * send.element_size() * (parts - 1) // parts)
    return recv


def all_gather_counted(x: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter) -> torch.Tensor:
    """All-gather over dim 0: [n, ...] from every rank of ``group`` -> [ranks * n, ...] in rank order (bytes counted
    as the head group's traffic, "all_to_all")."""
    parts = dist.get_world_size(group)
    out = x.new_empty(parts * x.shape[0], *x.shape[1:])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, x.contiguous(), group=group)
    counter.add(CommKind.ALL_TO_ALL, (parts - 1) * x.numel() * x.element_size())
    return out
