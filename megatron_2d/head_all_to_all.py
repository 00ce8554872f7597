"""The head all-to-all (Ulysses style) between Megatron's sbhd layout and the ring's layout, as autograd ops.

Notation
    hp  head-parallel size     c  zigzag chunk length = s_local / 2     H  heads of the tensor, Hl = H / hp
    S   tokens of the context rank after the exchange = 2 * hp * c (its 2*hp chunks in ascending global order)

to_heads:   [2c, b, H, d] (this rank's zigzag shard, all heads)   -> [b, S, Hl, d] (its head group's tokens)
to_tokens:  [b, S, Hl, d]                                         -> [2c, b, H, d]   (the inverse)
Each is the other's backward. ``order`` sorts the chunks as received (by head rank, then zigzag half). Packed
documents (S = hp * t_local slots, received head rank by head rank) sort single tokens instead (``per_token``:
Megatron's zigzag, so that each document's tokens are contiguous and ascending for the ring), or keep the
received order (None: the documents layout, built in ring order).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .comm import CommCounter, all_to_all_counted


def _exchange(buf: torch.Tensor, group: Optional[dist.ProcessGroup], counter: CommCounter) -> torch.Tensor:
    return buf if group is None else all_to_all_counted(buf, group, counter)


def to_heads(x: torch.Tensor, hp: int, order: Optional[torch.Tensor], group, counter: CommCounter,
             per_token: bool = False) -> torch.Tensor:
    """[2c, b, H, d] -> [b, S, H/hp, d]."""
    two_c, b, H, d = x.shape
    c, Hl = two_c // 2, H // hp
    send = x.view(two_c, b, hp, Hl, d).permute(2, 0, 1, 3, 4).contiguous()  # [hp(dst), 2c, b, Hl, d]
    recv = _exchange(send, group, counter)                                   # [hp(src), 2c, b, Hl, d]
    if order is None or per_token:
        tokens = recv.permute(2, 0, 1, 3, 4).reshape(b, hp * two_c, Hl, d)  # [b, S (received), Hl, d]
        return tokens if order is None else tokens.index_select(1, order)   # [b, S (ring order), Hl, d]
    chunks = recv.view(2 * hp, c, b, Hl, d).permute(2, 0, 1, 3, 4)           # [b, 2hp(received), c, Hl, d]
    return chunks.index_select(1, order).view(b, 2 * hp * c, Hl, d)         # [b, S (ascending), Hl, d]


def to_tokens(y: torch.Tensor, hp: int, inverse: Optional[torch.Tensor], group,
              counter: CommCounter, per_token: bool = False) -> torch.Tensor:
    """[b, S, Hl, d] -> [2c, b, Hl*hp, d]; inverse of :func:`to_heads` (``inverse`` undoes its ``order``)."""
    b, S, Hl, d = y.shape
    two_c = S // hp
    if per_token and inverse is not None:
        y, inverse = y.index_select(1, inverse), None                        # [b, S (received), Hl, d]
    if inverse is None:
        send = y.reshape(b, hp, two_c, Hl, d).permute(1, 2, 0, 3, 4).contiguous()  # [hp(dst), 2c, b, Hl, d]
    else:
        chunks = y.reshape(b, 2 * hp, two_c // 2, Hl, d).permute(1, 2, 0, 3, 4)  # [2hp (ascending), c, b, Hl, d]
        send = chunks.index_select(0, inverse).view(hp, two_c, b, Hl, d)         # [hp(dst), 2c, b, Hl, d]
    recv = _exchange(send, group, counter)                                   # [hp(src head rank), 2c, b, Hl, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(two_c, b, hp * Hl, d).contiguous()  # [2c, b, H, d]


class Direction(enum.Enum):
    """Which way the head all-to-all goes."""

    TO_HEADS = "to_heads"        # [2c, b, H, d] -> [b, S, H/hp, d]
    TO_TOKENS = "to_tokens"      # [b, S, H/hp, d] -> [2c, b, H, d]

    @property
    def reverse(self) -> "Direction":
        return Direction.TO_TOKENS if self is Direction.TO_HEADS else Direction.TO_HEADS


@dataclass(frozen=True)
class HeadExchange:
    """Everything the head all-to-all needs besides the tensor, built once per (groups, device)."""

    head_parallel_size: int
    order: Optional[torch.Tensor]     # received chunk index -> ascending position (a device tensor); None: keep
    inverse: Optional[torch.Tensor]   # its inverse permutation
    group: Optional[dist.ProcessGroup]
    counter: CommCounter
    per_token: bool = False           # order/inverse permute single tokens (packed documents), not chunks

    @classmethod
    def build(cls, hp: int, received: Optional[Sequence[int]], group, counter: CommCounter,
              device, per_token: bool = False) -> "HeadExchange":
        """From the sort keys of the chunks (or, ``per_token``, of the tokens) in the order the all-to-all delivers
        them (one host-to-device copy, here only); None: the ring takes the tokens in the order received."""
        if received is None:
            return cls(hp, None, None, group, counter, per_token)
        order = sorted(range(len(received)), key=received.__getitem__)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        as_tensor = lambda idx: torch.tensor(idx, dtype=torch.long, device=device)  # noqa: E731
        return cls(hp, as_tensor(order), as_tensor(inverse), group, counter, per_token)

    def apply(self, x: torch.Tensor, direction: Direction) -> torch.Tensor:
        if direction is Direction.TO_HEADS:
            return to_heads(x, self.head_parallel_size, self.order, self.group, self.counter, self.per_token)
        return to_tokens(x, self.head_parallel_size, self.inverse, self.group, self.counter, self.per_token)


class HeadAllToAll(torch.autograd.Function):
    """The head all-to-all in ``direction``, whose backward is the exchange in the reverse direction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, direction: Direction, exchange: HeadExchange) -> torch.Tensor:
        ctx.direction, ctx.exchange = direction, exchange
        return exchange.apply(x, direction)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.apply(grad.contiguous(), ctx.direction.reverse), None, None
