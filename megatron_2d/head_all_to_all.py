"""The head all-to-all (Ulysses style) between Megatron's sbhd layout and the ring's layout, as autograd ops.

Notation
    hp  head-parallel size     c  zigzag chunk length = s_local / 2     H  heads of the tensor, Hl = H / hp
    S   tokens of the context rank after the exchange = 2 * hp * c (its 2*hp chunks in ascending global order)

to_heads:   [2c, b, H, d] (this rank's zigzag shard, all heads)   -> [b, S, Hl, d] (its head group's tokens)
to_tokens:  [b, S, Hl, d]                                         -> [2c, b, H, d]   (the inverse)
Each is the other's backward. ``order`` sorts the chunks as received (by head rank, then zigzag half).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .comm import CommCounter, head_all_to_all


def _exchange(buf: torch.Tensor, group: Optional[dist.ProcessGroup], counter: CommCounter) -> torch.Tensor:
    return buf if group is None else head_all_to_all(buf, group, counter)


def to_heads(x: torch.Tensor, hp: int, order: torch.Tensor, group, counter: CommCounter) -> torch.Tensor:
    """[2c, b, H, d] -> [b, S, H/hp, d]."""
    two_c, b, H, d = x.shape
    c, Hl = two_c // 2, H // hp
    send = x.view(two_c, b, hp, Hl, d).permute(2, 0, 1, 3, 4).contiguous()  # [hp(dst), 2c, b, Hl, d]
    recv = _exchange(send, group, counter)                                   # [hp(src), 2c, b, Hl, d]
    chunks = recv.view(2 * hp, c, b, Hl, d).permute(2, 0, 1, 3, 4)           # [b, 2hp(received), c, Hl, d]
    return chunks.index_select(1, order).view(b, 2 * hp * c, Hl, d)         # [b, S (ascending), Hl, d]


def to_tokens(y: torch.Tensor, hp: int, order: torch.Tensor, group, counter: CommCounter) -> torch.Tensor:
    """[b, S, Hl, d] -> [2c, b, Hl*hp, d]; inverse of :func:`to_heads`."""
    b, S, Hl, d = y.shape
    c = S // (2 * hp)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    chunks = y.reshape(b, 2 * hp, c, Hl, d).permute(1, 2, 0, 3, 4)          # [2hp (ascending), c, b, Hl, d]
    send = chunks.index_select(0, inverse)                                   # [2hp(received) = hp*2, c, b, Hl, d]
    recv = _exchange(send.view(hp, 2 * c, b, Hl, d), group, counter)         # [hp(src head rank), 2c, b, Hl, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(2 * c, b, hp * Hl, d).contiguous()  # [2c, b, H, d]


class HeadAllToAll(torch.autograd.Function):
    """``to_heads`` (or ``to_tokens`` when ``heads_to_tokens``) whose backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, heads_to_tokens: bool, hp: int, order, group, counter):
        ctx.args = (not heads_to_tokens, hp, order, group, counter)
        fn = to_tokens if heads_to_tokens else to_heads
        return fn(x, hp, order, group, counter)

    @staticmethod
    def backward(ctx, grad):
        back_to_tokens, hp, order, group, counter = ctx.args
        fn = to_tokens if back_to_tokens else to_heads
        return fn(grad.contiguous(), hp, order, group, counter), None, None, None, None, None
