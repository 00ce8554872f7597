"""Zigzag ring attention over one context group, on the Double-Ring loop, as one autograd Function.

Notation (all local to one rank, after the head all-to-all)
    b  batch      S  tokens of this context rank (2*hp chunks of c tokens, ascending global order)
    h  query heads of this rank       g  K/V heads of this rank (h divisible by g)      d  head dim
Tensors: q, out [b, S, h, d]; k, v [b, S, g, d]; lse [b, h, S] fp32; packed K/V blocks [2, b, S, g, d].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .block_plan import BlockCall, plan_block
from .double_ring import DoubleRing
from .kernels import BlockKernel
from .merge import merge_attention_


@dataclass
class RingContext:
    """Everything the ring needs besides the tensors: built per call by :func:`megatron_2d.attention_2d`."""

    ring: DoubleRing
    kernel: BlockKernel
    plans: Dict[int, List[BlockCall]]   # source context rank -> kernel calls against its K/V block
    scale: float


def make_plans(groups, context_rank: int, chunk_len: int, causal: bool) -> Dict[int, List[BlockCall]]:
    """The kernel calls of this context rank against every context rank's K/V."""
    mine = groups.context_chunks(context_rank)
    return {src: plan_block(mine, groups.context_chunks(src), chunk_len, causal)
            for src in range(groups.context_size)}


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale [+ causal mask]) v over the whole context group; exact forward and backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rc: RingContext) -> torch.Tensor:
        b, S, h, d = q.shape
        out_acc = torch.zeros(b, S, h, d, dtype=torch.float32, device=q.device)
        lse_acc = torch.full((b, h, S), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                                   # [2, b, S, g, d]

        def compute(block: torch.Tensor, source: int) -> None:
            for call in rc.plans[source]:
                rows = slice(call.q_start, call.q_end)
                out_blk, lse_blk = rc.kernel.forward(q[:, rows], block[0, :, :call.kv_len],
                                                     block[1, :, :call.kv_len], call.causal, rc.scale)
                merge_attention_(out_acc[:, rows], lse_acc[:, :, rows], out_blk, lse_blk)

        rc.ring.run(kv, compute)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.rc = rc
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        rc: RingContext = ctx.rc
        dout = dout.contiguous()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                                   # [2, b, S, g, d]
        rider = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)

        def compute(block: torch.Tensor, source: int) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
            partials = []
            for call in rc.plans[source]:
                rows = slice(call.q_start, call.q_end)
                dq, dk, dv = rc.kernel.backward(
                    dout[:, rows], q[:, rows], block[0, :, :call.kv_len], block[1, :, :call.kv_len],
                    out[:, rows], lse[:, :, rows], call.causal, rc.scale)
                dq_acc[:, rows].add_(dq)
                partials.append((call.kv_len, dk, dv))
            return partials

        dkv = rc.ring.run(kv, compute, rider=rider)
        return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
