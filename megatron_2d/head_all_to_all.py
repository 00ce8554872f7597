"""The head all-to-all (Ulysses style) between Megatron's sbhd layout and the ring's layout, as autograd ops.

Notation
    hp  head-parallel size     c  zigzag chunk length = s_local / 2     H  heads of a tensor, Hl = H / hp
    S   tokens of the context rank after the all-to-all = 2 * hp * c (its 2*hp chunks in ascending global order)
    d_i head dim of tensor i    D  the head dims of one group's tensors summed (K and V: dk + dv)
    F   values per token of all groups sent to one head rank = sum over groups of Hl * D

to_heads:   tensors [2c, b, H_i, d_i] (this rank's zigzag shard, all heads) -> one [b, S, Hl, D] per group of n
            consecutive tensors with equal head counts (its head group's tokens), the group's tensors concatenated
            per head along the last dim: K and V come out as the ring's block, [b, S, Hl, dk + dv], whatever their
            widths, with no padding. q, K and V travel in ONE all-to-all.
to_tokens:  groups [b, S, Hl, D] and the widths (d_i) of each group's tensors -> tensors [2c, b, H, d_i] (the
            inverse, also one all-to-all).
Each is the other's backward. As an all-to-all, each direction copies the data twice, once into the send buffer and
once out of the receive buffer (hp = 1 sends nothing: views, and one concatenating copy for a group of n > 1), at
every batch size and on every backend (a point-to-point variant for batch 1 on gloo measured no faster:
docs/benchmarks.md).

Head ranks follow the placement (:class:`~megatron_2d.layout.topology.RankPlace`), which need not be the group's rank
order (``cp_rank_lists`` not ascending): the collective's slices are reordered to head ranks.

``order`` sorts the units as received (by head rank, then zigzag half) into ascending order; a unit is a chunk of c
tokens, or, for packed documents (``per_token``), a single token (Megatron's zigzag, so that each document's
tokens are contiguous and ascending for the ring). None keeps the received order (hp = 1, and the packed documents
layout, which is built in ring order).

:class:`HeadAllGather` moves a tensor shared by every head (MLA's latent) the same way: all-gathered over the head
group into the same ascending token order, its gradient summed back (the reverse all-to-all, summed).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .kept_forward import KeptForward, Point
from .transport.comm import CommCounter, all_gather_counted, all_to_all_counted, to_device

Widths = tuple[int, ...]  # the head dims of one group's tensors, in order


def ascending_order(received_keys: Sequence[int]) -> np.ndarray:
    """The order that sorts units received with these sort keys: ascending unit i is received unit order[i]."""
    return np.argsort(np.asarray(received_keys, dtype=np.int64), kind="stable")


def _group_starts(grouping: Sequence[int]) -> list[int]:
    return [sum(grouping[:i]) for i in range(len(grouping))]


def _slabs(buf: torch.Tensor, heads: Sequence[int], widths: Sequence[Widths]) -> list[torch.Tensor]:
    """Views [..., Hl, D] of ``buf`` [..., F], one per group of ``heads[g]`` heads of ``sum(widths[g])`` values."""
    out, offset = [], 0
    for hl, ws in zip(heads, widths):
        size = hl * sum(ws)
        out.append(buf[..., offset : offset + size].unflatten(-1, (hl, sum(ws))))
        offset += size
    return out


def _parts(slab: torch.Tensor, widths: Widths) -> list[torch.Tensor]:
    """Views of ``slab`` [..., D] cut along the last dim into the group's tensors of ``widths``."""
    return list(torch.split(slab, list(widths), dim=-1))


def group_widths(xs: Sequence[torch.Tensor], grouping: Sequence[int]) -> list[Widths]:
    """The head dims of each group's tensors."""
    return [tuple(x.shape[-1] for x in xs[i : i + n]) for i, n in zip(_group_starts(grouping), grouping)]


def _all_to_all_by_head(
    send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter, head_of_group: tuple[int, ...] | None
) -> torch.Tensor:
    """all_to_all over dim 0 of ``send`` [hp, ...] indexed by HEAD rank: slice h goes to head rank h, slice h of
    the result comes from head rank h. The collective indexes by group rank, the ascending order of the global
    ranks (``new_group`` sorts them); where the head ranks run in another order (``cp_rank_lists`` not ascending),
    ``head_of_group`` [g] is the head rank of group rank g and the slices are reordered around the collective."""
    if head_of_group is None:
        return all_to_all_counted(send, group, counter)
    recv = all_to_all_counted(torch.stack([send[h] for h in head_of_group]), group, counter)
    return torch.stack([recv[g] for g in _group_of_head(head_of_group)])


def _group_of_head(head_of_group: tuple[int, ...]) -> tuple[int, ...]:
    """The group rank of each head rank (the inverse of ``head_of_group``)."""
    return tuple(sorted(range(len(head_of_group)), key=head_of_group.__getitem__))


def to_heads(
    xs: Sequence[torch.Tensor],
    grouping: Sequence[int],
    hp: int,
    order: torch.Tensor | None,
    unit: int,
    group: dist.ProcessGroup | None,
    counter: CommCounter,
    head_of_group: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """Tensors [2c, b, H_i, d_i] -> one [b, S, H_i/hp, D] per group of ``grouping`` (n consecutive tensors of
    equal head count each, concatenated per head), through one all-to-all."""
    two_c, b = xs[0].shape[:2]
    starts = _group_starts(grouping)
    if group is None:  # hp = 1: this rank's own tokens
        groups = [xs[i] if n == 1 else torch.cat(xs[i : i + n], dim=-1) for i, n in zip(starts, grouping)]
        tokens = [x.transpose(0, 1) for x in groups]  # [b, S, H, D]
    else:
        widths = group_widths(xs, grouping)
        heads = [xs[i].shape[2] // hp for i in starts]
        send = xs[0].new_empty(hp, two_c, b, sum(h * sum(w) for h, w in zip(heads, widths)))  # [hp (dst), 2c, b, F]
        for i, n, slab, ws in zip(starts, grouping, _slabs(send, heads, widths), widths):
            for x, dst in zip(xs[i : i + n], _parts(slab, ws)):  # dst [hp, 2c, b, Hl, d_i]
                dst.copy_(x.view(two_c, b, hp, -1, x.shape[-1]).permute(2, 0, 1, 3, 4))
        recv = _all_to_all_by_head(send, group, counter, head_of_group)  # [hp (src), 2c, b, F]
        tokens = [
            slab.permute(2, 0, 1, 3, 4).flatten(1, 2)  # [b, S (received), Hl, D]
            for slab in _slabs(recv, heads, widths)
        ]
    return [_ascending(y, order, unit) for y in tokens]


def _ascending(y: torch.Tensor, order: torch.Tensor | None, unit: int) -> torch.Tensor:
    """[b, S, ...] in received order (any strides) -> contiguous, in ascending order (unit i of the result is unit
    order[i] of y); no copy when y is already contiguous and needs no sorting."""
    if order is None:
        return y.contiguous()
    return y.unflatten(1, (y.shape[1] // unit, unit)).index_select(1, order).flatten(1, 2)


def to_tokens(
    ys: Sequence[torch.Tensor],
    widths: Sequence[Widths],
    hp: int,
    order: torch.Tensor | None,
    unit: int,
    group: dist.ProcessGroup | None,
    counter: CommCounter,
    head_of_group: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """Groups [b, S, Hl, D] -> their tensors [2c, b, Hl*hp, d_i] (contiguous), cut by ``widths``; inverse of
    :func:`to_heads` with the same ``order``."""
    b, S = ys[0].shape[:2]
    two_c = S // hp
    if group is None:  # hp = 1: views where the layout allows
        outs = []
        for y, ws in zip(ys, widths):
            if order is not None:
                y = _into_received(torch.empty_like(y), y, order, unit)
            outs += [part.transpose(0, 1).contiguous() for part in _parts(y, ws)]  # [S, b, H, d_i]
        return outs
    heads = [y.shape[2] for y in ys]
    send = ys[0].new_empty(hp, two_c, b, sum(h * sum(w) for h, w in zip(heads, widths)))  # [hp (dst), 2c, b, F]
    for y, slab in zip(ys, _slabs(send, heads, widths)):
        _into_received(slab.permute(2, 0, 1, 3, 4).flatten(1, 2), y, order, unit)  # S (received) = hp * 2c
    recv = _all_to_all_by_head(send, group, counter, head_of_group)  # [hp (src), 2c, b, F]
    outs = []
    for y, slab, ws in zip(ys, _slabs(recv, heads, widths), widths):  # slab [hp (src), 2c, b, Hl, D]
        outs += [
            part.permute(1, 2, 0, 3, 4).reshape(two_c, b, hp * y.shape[2], part.shape[-1]).contiguous()
            for part in _parts(slab, ws)
        ]  # [2c, b, H, d_i]
    return outs


def _into_received(dst: torch.Tensor, y: torch.Tensor, order: torch.Tensor | None, unit: int) -> torch.Tensor:
    """Write y [b, S, ...] (ascending order) into dst (same shape, any strides) in received order: unit order[i] of
    dst is unit i of y (a plain copy when ``order`` is None). Returns dst."""
    units = (y.shape[1] // unit, unit)
    if order is None:
        dst.copy_(y)
    else:
        dst.unflatten(1, units).index_copy_(1, order, y.unflatten(1, units))
    return dst


class Direction(enum.Enum):
    """Which way the head all-to-all goes."""

    TO_HEADS = Point.TO_HEADS  # tensors [2c, b, H, d_i] -> groups [b, S, H/hp, D]
    TO_TOKENS = Point.TO_TOKENS  # groups [b, S, H/hp, D] -> tensors [2c, b, H, d_i]


@dataclass(frozen=True)
class HeadRoute:
    """Everything the head all-to-all needs besides the tensors, built once per call signature and cached with the
    ring context in the call plan (:mod:`megatron_2d.call.plan`)."""

    head_parallel_size: int
    order: torch.Tensor | None  # unit index (as received) of each ascending position (a device tensor)
    group: dist.ProcessGroup | None
    counter: CommCounter
    per_token: bool = False  # order permutes single tokens (packed documents), not chunks
    head_of_group: tuple[int, ...] | None = None  # head rank of each group rank, where the two differ

    @classmethod
    def build(
        cls,
        hp: int,
        order,
        group,
        counter: CommCounter,
        device,
        per_token: bool = False,
        head_ranks: Sequence[int] | None = None,
    ) -> HeadRoute:
        """From ``order`` (ascending unit i is unit order[i] as received, see :func:`ascending_order`: a numpy array
        or a CPU LongTensor made ahead, e.g. by a PackedSharding) or None (the ring takes the units in the order
        received). The order goes to the device once, pinned and non-blocking: no host-device synchronisation.
        ``head_ranks``: the global ranks of the head group by head rank (the placement's order; default the group's
        own order)."""
        host = None if order is None else order.numpy() if isinstance(order, torch.Tensor) else np.asarray(order)
        if host is not None and np.array_equal(host, np.arange(len(host))):
            order = None
        if isinstance(order, np.ndarray):
            order = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
        as_tensor = None if order is None else to_device(order, torch.device(device))
        if group is None:
            return cls(hp, as_tensor, None, counter, per_token)
        by_group = tuple(dist.get_process_group_ranks(group))  # global ranks by group rank (ascending)
        peers = by_group if head_ranks is None else tuple(head_ranks)
        head_of_group = tuple(peers.index(r) for r in by_group)
        return cls(
            hp,
            as_tensor,
            group,
            counter,
            per_token,
            None if head_of_group == tuple(range(hp)) else head_of_group,
        )

    def unit(self, tokens: int) -> int:
        """Tokens per permuted unit for a tensor of ``tokens`` tokens on this rank (before the all-to-all)."""
        return 1 if self.per_token else tokens // 2

    def to_heads(self, xs: Sequence[torch.Tensor], grouping: Sequence[int]) -> list[torch.Tensor]:
        return to_heads(
            xs,
            grouping,
            self.head_parallel_size,
            self.order,
            self.unit(xs[0].shape[0]),
            self.group,
            self.counter,
            self.head_of_group,
        )

    def to_tokens(self, ys: Sequence[torch.Tensor], widths: Sequence[Widths]) -> list[torch.Tensor]:
        unit = self.unit(ys[0].shape[1] // self.head_parallel_size)
        return to_tokens(
            ys, widths, self.head_parallel_size, self.order, unit, self.group, self.counter, self.head_of_group
        )

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[2c, b, F] (a tensor every head shares) -> [b, S, F], every head rank's tokens in ascending order."""
        if self.group is None:
            return _ascending(x.transpose(0, 1), self.order, self.unit(x.shape[0]))
        gathered = all_gather_counted(x, self.group, self.counter)  # [hp (src) * 2c, b, F]
        gathered = gathered.unflatten(0, (self.head_parallel_size, x.shape[0]))  # [hp (src group rank), 2c, b, F]
        if self.head_of_group is not None:  # by head rank, as the order expects
            gathered = gathered[list(_group_of_head(self.head_of_group))]
        return _ascending(gathered.permute(2, 0, 1, 3).flatten(1, 2), self.order, self.unit(x.shape[0]))

    def gather_backward(self, dy: torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`gather`: dy [b, S, F] -> [2c, b, F], summed over the head group."""
        two_c = dy.shape[1] // self.head_parallel_size
        if self.group is None:
            return _into_received(torch.empty_like(dy), dy, self.order, self.unit(two_c)).transpose(0, 1)
        send = dy.new_empty(self.head_parallel_size, two_c, dy.shape[0], dy.shape[2])  # [hp (dst), 2c, b, F]
        _into_received(send.permute(2, 0, 1, 3).flatten(1, 2), dy, self.order, self.unit(two_c))
        return _all_to_all_by_head(send, self.group, self.counter, self.head_of_group).sum(0)  # [2c, b, F]


@dataclass(frozen=True)
class HeadCall:
    """One call of the head all-to-all: the cached :class:`HeadRoute` and, under Selective Checkpoint++, the call's
    record (:class:`megatron_2d.kept_forward.KeptForward`, at points "to_heads" / "to_tokens" / "gather"; None for a
    plain call), which the caller's options carry (:attr:`megatron_2d.call.options.AttentionOptions.kept`)."""

    route: HeadRoute
    kept: KeptForward | None = None


class HeadAllToAll(torch.autograd.Function):
    """The head all-to-all in ``direction`` over several tensors at once; its backward is the reverse all-to-all.

    TO_HEADS: ``tensors`` [2c, b, H_i, d_i], ``grouping`` their group sizes -> one [b, S, H_i/hp, D] per group.
    TO_TOKENS: ``tensors`` groups [b, S, Hl, D], ``grouping`` each group's widths (None: one tensor per group) ->
    their tensors [2c, b, H, d_i].
    With ``call.kept`` (Selective Checkpoint++'s record of the call) a replayed all-to-all returns the kept
    result and sends nothing; its backward is unchanged."""

    @staticmethod
    def forward(ctx, call: HeadCall, direction: Direction, grouping, *tensors: torch.Tensor):
        route, kept = call.route, call.kept
        ctx.route, ctx.direction = route, direction
        to_heads = direction is Direction.TO_HEADS
        if to_heads:
            ctx.widths = group_widths(tensors, grouping)
        else:
            ctx.widths = [(t.shape[-1],) for t in tensors] if grouping is None else [tuple(w) for w in grouping]
        replayed = kept.replay(direction.value) if kept is not None else None
        if replayed is not None:
            return replayed
        out = tuple(route.to_heads(tensors, grouping) if to_heads else route.to_tokens(tensors, ctx.widths))
        if kept is not None:
            kept.record(direction.value, out)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grads = [g.contiguous() for g in grads]
        if ctx.direction is Direction.TO_HEADS:
            back = ctx.route.to_tokens(grads, ctx.widths)
        else:
            back = ctx.route.to_heads(grads, [len(w) for w in ctx.widths])
        return (None, None, None, *back)


class HeadAllGather(torch.autograd.Function):
    """A tensor shared by every head, [2c, b, F] -> [b, S, F] over the head group (all-gather); backward sums the
    head ranks' gradients of each token (the reverse all-to-all, summed). ``call.kept``: as
    :class:`HeadAllToAll`'s (point "gather")."""

    @staticmethod
    def forward(ctx, call: HeadCall, x: torch.Tensor) -> torch.Tensor:
        route, kept = call.route, call.kept
        ctx.route = route
        replayed = kept.replay(Point.GATHER) if kept is not None else None
        if replayed is not None:
            return replayed[0]
        out = route.gather(x)
        if kept is not None:
            kept.record(Point.GATHER, (out,))
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return None, ctx.route.gather_backward(dy.contiguous())
