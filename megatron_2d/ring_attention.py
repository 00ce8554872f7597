"""Zigzag ring attention over one context group, on a K/V transport, as one autograd Function.

Notation (all local to one rank, after the head all-to-all)
    b  batch      S  tokens of this context rank (2*hp chunks of c tokens, ascending global order)
    h  query heads of this rank       g  K/V heads of this rank (h divisible by g)      d  head dim
Tensors: q, out [b, S, h, d]; k, v [b, S, g, d]; lse [b, h, S] and every accumulator in the accumulator dtype
(fp32; fp64 for fp64 inputs); packed K/V blocks [2, b, S, g, d]; sinks [h] (one logit per query head).

Sinks (gpt-oss, Megatron's softmax_type "learnable" / "off-by-one") add exp(sink_h) to every row's softmax
denominator: once the transport has visited every block, lse' = logaddexp(lse, sink) and out' = out *
exp(lse - lse'). The kernels' backward with (out', lse') is then exact for q, k, v, and
d sink_h = -sum over rows of exp(sink_h - lse') * (dout . out') (the sink's value vector is zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

from .block_plan import BlockCall
from .double_ring import DoubleRing
from .kernels import BlockKernel
from .kernels.base import accumulator_dtype
from .merge import merge_attention_
from .neighbour_exchange import NeighbourExchange


@dataclass
class RingContext:
    """Everything the ring needs besides the tensors."""

    transport: Union[DoubleRing, NeighbourExchange]
    kernel: BlockKernel
    plans: Dict[int, Tuple[BlockCall, ...]]   # source context rank -> kernel calls against its K/V block
    scale: float
    rider_dtype: torch.dtype                  # dtype of the dK/dV partials that travel (see attention_2d)


def apply_sinks_(out_acc: torch.Tensor, lse_acc: torch.Tensor, sinks: torch.Tensor) -> None:
    """Add one extra logit per head (sinks [h]) to every row's softmax: rescale out [b, S, h, d], update lse."""
    sink = sinks.to(lse_acc.dtype).view(1, -1, 1)                   # [1, h, 1]
    new_lse = torch.logaddexp(lse_acc, sink)                         # [b, h, S]
    out_acc.mul_(torch.exp(lse_acc - new_lse).transpose(1, 2).unsqueeze(-1))
    lse_acc.copy_(new_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h] from this rank's rows: -sum_rows exp(sink - lse) * (dout . out)."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)    # [b, S, h] -> [b, h, S]
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)          # [b, h, S]
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def _pack(k: torch.Tensor, v: torch.Tensor, rc: RingContext):
    """(the block that travels, ``run``'s extra arguments). K and V go as one [2, b, keys, g, d] block; a single
    context rank sends nothing (no copy then); a ring that carries only a key prefix (packed documents) packs
    just that prefix and computes the own block on k and v themselves."""
    if rc.transport.cp == 1:
        return (k, v), {}
    keys = getattr(rc.transport, "ring_keys", None)
    if keys is not None and keys < k.shape[1]:
        return torch.stack([k[:, :keys], v[:, :keys]]), {"own": (k, v)}
    return torch.stack([k, v]), {}


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale, masked [+ sinks]) v over the whole context group; exact forward and backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                rc: RingContext) -> torch.Tensor:
        b, S, h, d = q.shape
        acc = accumulator_dtype(q.dtype)
        # filled by the first kernel call when it covers every row (the own block without a window), else zeroed
        out_acc = torch.empty(b, S, h, d, dtype=acc, device=q.device)
        lse_acc = torch.empty((b, h, S), dtype=acc, device=q.device)
        kv, own = _pack(k, v, rc)                                  # [2, b, S (or the ring prefix), g, d]
        fresh = [True]

        def start() -> None:
            if fresh[0]:
                out_acc.zero_()
                lse_acc.fill_(float("-inf"))
                fresh[0] = False

        def compute(block, source: int, first_key: int) -> None:
            for call, out_blk, lse_blk in rc.kernel.forward_calls(q, block[0], block[1], rc.plans[source],
                                                                  first_key, rc.scale):
                rows = slice(call.q_start, call.q_end)
                if fresh[0] and (call.q_start, call.q_end) == (0, S):
                    out_acc.copy_(out_blk)
                    lse_acc.copy_(lse_blk)
                    fresh[0] = False
                else:
                    start()
                    merge_attention_(out_acc[:, rows], lse_acc[:, :, rows], out_blk, lse_blk)

        rc.transport.run(kv, compute, **own)
        start()                                                    # (no call at all: nothing visible)
        if sinks is not None:
            apply_sinks_(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc, sinks)
        ctx.rc = rc
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        rc: RingContext = ctx.rc
        dout = dout.contiguous()
        dq_acc = torch.empty(q.shape, dtype=lse.dtype, device=q.device)   # filled like out_acc in forward
        kv, own = _pack(k, v, rc)                                  # [2, b, S (or the ring prefix), g, d]
        rider = torch.zeros((2, *k.shape), dtype=rc.rider_dtype, device=q.device)
        fresh = [True]

        def compute(block, source: int, first_key: int) -> List[Tuple[int, int, torch.Tensor, torch.Tensor]]:
            partials = []
            for call, dq, dk, dv in rc.kernel.backward_calls(dout, q, block[0], block[1], out, lse,
                                                             rc.plans[source], first_key, rc.scale):
                if fresh[0] and (call.q_start, call.q_end) == (0, q.shape[1]):
                    dq_acc.copy_(dq)
                else:
                    if fresh[0]:
                        dq_acc.zero_()
                    dq_acc[:, call.q_start:call.q_end].add_(dq)
                fresh[0] = False
                partials.append((call.k_start, call.k_end, dk, dv))
            return partials

        dkv = rc.transport.run(kv, compute, rider=rider, **own)
        if fresh[0]:
            dq_acc.zero_()
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None
