"""The head all-to-all (Ulysses style) between Megatron's sbhd layout and the ring's layout, as autograd ops.

Notation
    hp  head-parallel size     c  zigzag chunk length = s_local / 2     H  heads of a tensor, Hl = H / hp
    S   tokens of the context rank after the exchange = 2 * hp * c (its 2*hp chunks in ascending global order)
    n   tensors stacked in one group (q: 1; K and V: 2)       W  heads of all tensors of one exchange, / hp

to_heads:   tensors [2c, b, H_i, d] (this rank's zigzag shard, all heads) -> one [n, b, S, Hl, d] per group of n
            consecutive tensors (its head group's tokens); q, K and V travel in ONE all-to-all, and K/V come out
            stacked as the ring sends them.
to_tokens:  groups [n, b, S, Hl, d] -> tensors [2c, b, H, d] (the inverse, also one all-to-all).
Each is the other's backward. As an all-to-all, each direction copies the data twice, once into the send buffer and
once out of the receive buffer (hp = 1 sends nothing: views, and one stacking copy for a group of n > 1). With batch
1 and chunk units (Megatron's usual long-sequence case) the exchange is point-to-point instead and copies once: one
message per (tensor, peer, unit), each unit received straight into its ascending place (to_heads) or sent straight
from it (to_tokens), this rank's own units copied directly.

``order`` sorts the units as received (by head rank, then zigzag half) into ascending order; a unit is a chunk of c
tokens, or, for packed documents (``per_token``), a single token (Megatron's zigzag, so that each document's
tokens are contiguous and ascending for the ring). None keeps the received order (hp = 1, and the packed documents
layout, which is built in ring order).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .comm import CommCounter, all_to_all_counted, to_device


def ascending_order(received_keys: Sequence[int]) -> np.ndarray:
    """The order that sorts units received with these sort keys: ascending unit i is received unit order[i]."""
    return np.argsort(np.asarray(received_keys, dtype=np.int64), kind="stable")


def _head_slices(buf: torch.Tensor, widths: Sequence[int]) -> List[torch.Tensor]:
    """Views of ``buf`` [..., W, d] cut along the heads into ``widths`` (summing to W)."""
    return list(torch.split(buf, list(widths), dim=-2))


def to_heads(xs: Sequence[torch.Tensor], grouping: Sequence[int], hp: int, order: Optional[torch.Tensor],
             unit: int, group: Optional[dist.ProcessGroup], counter: CommCounter) -> List[torch.Tensor]:
    """Tensors [2c, b, H_i, d] -> one [n, b, S, H_i/hp, d] per group of ``grouping`` (n consecutive tensors of
    equal shape each), through one all-to-all."""
    two_c, b, _, d = xs[0].shape
    starts = [sum(grouping[:i]) for i in range(len(grouping))]
    if group is None:                                                    # hp = 1: this rank's own tokens
        groups = [[x.transpose(0, 1) for x in xs[i:i + n]] for i, n in zip(starts, grouping)]  # [b, S, H, d]
        tokens = [ys[0].unsqueeze(0) if len(ys) == 1 else torch.stack(ys) for ys in groups]     # [n, b, S, H, d]
    else:
        widths = [x.shape[2] // hp for x in xs]
        send = xs[0].new_empty(hp, two_c, b, sum(widths), d)            # [hp (dst), 2c, b, W, d]
        for x, dst in zip(xs, _head_slices(send, widths)):
            dst.copy_(x.view(two_c, b, hp, -1, d).permute(2, 0, 1, 3, 4))
        recv = all_to_all_counted(send, group, counter)                 # [hp (src), 2c, b, W, d]
        group_widths = [sum(widths[i:i + n]) for i, n in zip(starts, grouping)]
        tokens = [slab.unflatten(-2, (n, -1)).permute(3, 2, 0, 1, 4, 5).flatten(2, 3)   # [n, b, S (received), Hl, d]
                  for slab, n in zip(_head_slices(recv, group_widths), grouping)]
    return [_ascending(y, order, unit) for y in tokens]


def _ascending(y: torch.Tensor, order: Optional[torch.Tensor], unit: int) -> torch.Tensor:
    """[n, b, S, Hl, d] in received order (any strides) -> contiguous, in ascending order (unit i of the result
    is unit order[i] of y); no copy when y is already contiguous and needs no sorting."""
    if order is None:
        return y.contiguous()
    return y.unflatten(2, (y.shape[2] // unit, unit)).index_select(2, order).flatten(2, 3)


def to_tokens(ys: Sequence[torch.Tensor], hp: int, order: Optional[torch.Tensor], unit: int,
              group: Optional[dist.ProcessGroup], counter: CommCounter) -> List[torch.Tensor]:
    """Groups [n, b, S, Hl, d] -> their n tensors each, [2c, b, Hl*hp, d] (contiguous); inverse of
    :func:`to_heads` with the same ``order``."""
    b, S, d = ys[0].shape[1], ys[0].shape[2], ys[0].shape[4]
    two_c = S // hp
    if group is None:                                                    # hp = 1: views where the layout allows
        outs = []
        for y in ys:
            if order is not None:
                y = _into_received(torch.empty_like(y), y, order, unit)
            outs += [y[i].transpose(0, 1).contiguous() for i in range(y.shape[0])]   # [S, b, H, d]
        return outs
    widths = [y.shape[0] * y.shape[3] for y in ys]
    send = ys[0].new_empty(hp, two_c, b, sum(widths), d)                # [hp (dst), 2c, b, W, d]
    for y, dst in zip(ys, _head_slices(send, widths)):
        dst = dst.unflatten(-2, (y.shape[0], y.shape[3])).permute(3, 2, 0, 1, 4, 5)   # [n, b, hp, 2c, Hl, d]
        _into_received(dst.flatten(2, 3), y, order, unit)                           # S (received) = hp * 2c
    recv = all_to_all_counted(send, group, counter)                     # [hp (src), 2c, b, W, d]
    outs = []
    for y, slab in zip(ys, _head_slices(recv, widths)):
        slab = slab.unflatten(-2, (y.shape[0], y.shape[3]))             # [hp (src), 2c, b, n, Hl, d]
        outs += [slab[:, :, :, i].permute(1, 2, 0, 3, 4).reshape(two_c, b, hp * y.shape[3], d).contiguous()
                 for i in range(y.shape[0])]                            # [2c, b, H, d]
    return outs


def _into_received(dst: torch.Tensor, y: torch.Tensor, order: Optional[torch.Tensor], unit: int) -> torch.Tensor:
    """Write y [n, b, S, Hl, d] (ascending order) into dst (same shape, any strides) in received order: unit
    order[i] of dst is unit i of y (a plain copy when ``order`` is None). Returns dst."""
    units = (y.shape[2] // unit, unit)
    if order is None:
        dst.copy_(y)
    else:
        dst.unflatten(2, units).index_copy_(2, order, y.unflatten(2, units))
    return dst


def _unit_pairs(ex: "HeadExchange", unit: int, units: int):
    """(head rank, unit j, its rows among that rank's 2c tokens, its rows among the S ascending tokens) for each of
    the ``units`` units of ``unit`` tokens that this rank exchanges with every head rank (itself included)."""
    for peer in range(ex.head_parallel_size):
        for j in range(units):
            p = ex.positions[peer * units + j]
            yield peer, j, slice(j * unit, (j + 1) * unit), slice(p * unit, (p + 1) * unit)


def _direct_to_heads(xs: Sequence[torch.Tensor], grouping: Sequence[int], ex: "HeadExchange",
                     unit: int) -> List[torch.Tensor]:
    """:func:`to_heads` for batch 1 by point-to-point messages: one pack copy of the heads sent to each peer, no
    receive-side copy (each unit lands in its ascending place of the output groups), this rank's own heads copied
    straight into place."""
    two_c, b, _, d = xs[0].shape
    hp, me, units = ex.head_parallel_size, ex.head_rank, two_c // unit
    outs, ops, sent = [], [], 0
    for first, n in zip([sum(grouping[:k]) for k in range(len(grouping))], grouping):
        hl = xs[first].shape[2] // hp
        out = xs[first].new_empty(n, b, hp * two_c, hl, d)              # [n, b, S (ascending), Hl, d]
        outs.append(out)
        for t, x in enumerate(xs[first:first + n]):
            by_rank = x.view(two_c, b, hp, hl, d)
            send = {peer: by_rank[:, :, peer].contiguous() for peer in range(hp) if peer != me}   # [2c, b, Hl, d]
            for peer, j, rows, place in _unit_pairs(ex, unit, units):
                dst = out[t, :, place]                                   # [b = 1, unit, Hl, d], contiguous
                if peer == me:
                    dst.copy_(by_rank[rows, :, me].transpose(0, 1))
                    continue
                tag = (first + t) * units + j
                ops += [dist.P2POp(dist.isend, send[peer][rows], ex.peers[peer], ex.group, tag),
                        dist.P2POp(dist.irecv, dst, ex.peers[peer], ex.group, tag)]
                sent += dst.numel() * dst.element_size()
    _run(ops, ex, sent)
    return outs


def _direct_to_tokens(ys: Sequence[torch.Tensor], ex: "HeadExchange", unit: int) -> List[torch.Tensor]:
    """:func:`to_tokens` for batch 1 by point-to-point messages: units sent straight from the (contiguous) groups,
    one copy of everything received into the outputs."""
    b, S, d = ys[0].shape[1], ys[0].shape[2], ys[0].shape[4]
    hp, me = ex.head_parallel_size, ex.head_rank
    two_c = S // hp
    units = two_c // unit
    outs, recvs, ops, sent = [], [], [], 0
    for y in ys:
        y = y.contiguous()
        for i in range(y.shape[0]):
            out = y.new_empty(two_c, b, hp, y.shape[3], d)                 # [2c, b, H = hp * Hl, d]
            recv = {peer: y.new_empty(two_c, b, y.shape[3], d) for peer in range(hp) if peer != me}   # [2c, b, Hl, d]
            for peer, j, rows, place in _unit_pairs(ex, unit, units):
                src = y[i, :, place]                                        # [b = 1, unit, Hl, d], contiguous
                if peer == me:
                    out[rows, :, me].copy_(src.transpose(0, 1))
                    continue
                tag = len(outs) * units + j
                ops += [dist.P2POp(dist.isend, src, ex.peers[peer], ex.group, tag),
                        dist.P2POp(dist.irecv, recv[peer][rows], ex.peers[peer], ex.group, tag)]
                sent += src.numel() * src.element_size()
            outs.append(out)
            recvs.append(recv)
    _run(ops, ex, sent)
    for out, recv in zip(outs, recvs):
        for peer, received in recv.items():
            out[:, :, peer].copy_(received)
    return [out.flatten(2, 3) for out in outs]


def _run(ops: list, ex: "HeadExchange", sent: int) -> None:
    """Post every message of one exchange at once, wait for all of them and count the bytes sent."""
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ex.counter.add("all_to_all", sent)


class Direction(enum.Enum):
    """Which way the head all-to-all goes."""

    TO_HEADS = "to_heads"        # tensors [2c, b, H, d] -> groups [n, b, S, H/hp, d]
    TO_TOKENS = "to_tokens"      # groups [n, b, S, H/hp, d] -> tensors [2c, b, H, d]


@dataclass(frozen=True)
class HeadExchange:
    """Everything the head all-to-all needs besides the tensors, built once per (groups, device)."""

    head_parallel_size: int
    order: Optional[torch.Tensor]     # unit index (as received) of each ascending position (a device tensor)
    group: Optional[dist.ProcessGroup]
    counter: CommCounter
    per_token: bool = False           # order permutes single tokens (packed documents), not chunks
    positions: Tuple[int, ...] = ()   # ascending place of each received unit (host ints, for the direct path)
    peers: Tuple[int, ...] = ()       # global rank of each head rank
    head_rank: int = 0

    @classmethod
    def build(cls, hp: int, order, group, counter: CommCounter, device, per_token: bool = False) -> "HeadExchange":
        """From ``order`` (ascending unit i is unit order[i] as received, see :func:`ascending_order`: a numpy array
        or a CPU LongTensor made ahead, e.g. by a PackedLayout) or None (the ring takes the units in the order
        received). The order goes to the device once, pinned and non-blocking: no host-device synchronisation."""
        host = None if order is None else order.numpy() if isinstance(order, torch.Tensor) else np.asarray(order)
        if host is not None and np.array_equal(host, np.arange(len(host))):
            order = host = None
        if isinstance(order, np.ndarray):
            order = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
        as_tensor = None if order is None else to_device(order, torch.device(device))
        positions = ()                      # chunk units: the ascending place of each received unit
        if host is not None and not per_token:
            positions = tuple(np.argsort(host).tolist())
        peers = () if group is None else tuple(dist.get_process_group_ranks(group))
        return cls(hp, as_tensor, group, counter, per_token, positions, peers,
                   0 if group is None else dist.get_rank(group))

    def _direct(self, batch: int) -> bool:
        """Whether the exchange goes by point-to-point messages, unit by unit (batch 1, chunk units)."""
        return self.group is not None and batch == 1 and not self.per_token and self.order is not None

    def unit(self, tokens: int) -> int:
        """Tokens per permuted unit for a tensor of ``tokens`` tokens on this rank (before the exchange)."""
        return 1 if self.per_token else tokens // 2

    def to_heads(self, xs: Sequence[torch.Tensor], grouping: Sequence[int]) -> List[torch.Tensor]:
        if self._direct(xs[0].shape[1]):
            return _direct_to_heads(xs, grouping, self, self.unit(xs[0].shape[0]))
        return to_heads(xs, grouping, self.head_parallel_size, self.order, self.unit(xs[0].shape[0]),
                        self.group, self.counter)

    def to_tokens(self, ys: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if self._direct(ys[0].shape[1]):
            return _direct_to_tokens(ys, self, self.unit(ys[0].shape[2] // self.head_parallel_size))
        return to_tokens(ys, self.head_parallel_size, self.order, self.unit(ys[0].shape[2] // self.head_parallel_size),
                         self.group, self.counter)


class HeadAllToAll(torch.autograd.Function):
    """The head all-to-all in ``direction`` over several tensors at once; its backward is the reverse exchange.

    TO_HEADS: ``tensors`` [2c, b, H_i, d], ``grouping`` their group sizes -> one [n, b, S, H_i/hp, d] per group.
    TO_TOKENS: ``tensors`` groups [n, b, S, Hl, d] (``grouping`` unused) -> their tensors [2c, b, H, d]."""

    @staticmethod
    def forward(ctx, exchange: HeadExchange, direction: Direction, grouping: Tuple[int, ...],
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.exchange, ctx.direction = exchange, direction
        if direction is Direction.TO_HEADS:
            ctx.grouping = tuple(grouping)
            return tuple(exchange.to_heads(tensors, grouping))
        ctx.grouping = tuple(t.shape[0] for t in tensors)
        return tuple(exchange.to_tokens(tensors))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.direction is Direction.TO_HEADS:
            back = ctx.exchange.to_tokens([g.contiguous() for g in grads])
        else:
            back = ctx.exchange.to_heads([g.contiguous() for g in grads], ctx.grouping)
        return (None, None, None, *back)
