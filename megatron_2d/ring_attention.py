"""Zigzag ring attention over one context group, on a K/V transport, as one autograd Function.

Notation (all local to one rank, after the head all-to-all)
    b  batch      S  tokens of this context rank (2*hp chunks of c tokens, ascending global order)
    h  query heads of this rank       g  K/V heads of this rank (h divisible by g)      d  head dim
Tensors: q, out [b, S, h, d]; kv [2, b, S, g, d] (K and V stacked: the block the ring sends); lse [b, h, S] and
every accumulator in the accumulator dtype (fp32; fp64 for fp64 inputs); sinks [h] (one logit per query head).

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


def _ring_block(kv: torch.Tensor, rc: RingContext):
    """(the block that travels, ``run``'s extra arguments). A ring that carries only a key prefix (packed
    documents) sends a copy of just that prefix and computes the own block on the whole ``kv``."""
    keys = getattr(rc.transport, "ring_keys", None)
    if rc.transport.cp > 1 and keys is not None and keys < kv.shape[2]:
        return kv[:, :, :keys].contiguous(), {"own": kv}
    return kv, {}


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale, masked [+ sinks]) v over the whole context group; exact forward and backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, sinks: Optional[torch.Tensor],
                rc: RingContext) -> torch.Tensor:
        b, S, h, d = q.shape
        acc = accumulator_dtype(q.dtype)
        # the first kernel call's results when it covers every row (the own block without a window), else zeros
        accumulators: List[torch.Tensor] = []                      # [out_acc [b, S, h, d], lse_acc [b, h, S]]

        def start() -> None:
            if not accumulators:
                accumulators.extend((torch.zeros(b, S, h, d, dtype=acc, device=q.device),
                                     torch.full((b, h, S), float("-inf"), dtype=acc, device=q.device)))

        def compute(block, source: int, first_key: int) -> None:
            for call, out_blk, lse_blk in rc.kernel.forward_calls(q, block[0], block[1], rc.plans[source],
                                                                  first_key, rc.scale):
                if not accumulators and (call.q_start, call.q_end) == (0, S):
                    accumulators.extend((out_blk.to(acc), lse_blk.to(acc)))      # adopted, not copied
                else:
                    start()
                    rows = slice(call.q_start, call.q_end)
                    merge_attention_(accumulators[0][:, rows], accumulators[1][:, :, rows], out_blk, lse_blk)

        block, own = _ring_block(kv, rc)                           # [2, b, S (or the ring prefix), g, d]
        rc.transport.run(block, compute, **own)
        start()                                                    # (no call at all: nothing visible)
        out_acc, lse_acc = accumulators
        if sinks is not None:
            apply_sinks_(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse_acc, sinks)
        ctx.rc = rc
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, kv, out, lse, sinks = ctx.saved_tensors
        rc: RingContext = ctx.rc
        dout = dout.contiguous()
        dq_acc: List[torch.Tensor] = []          # the first call's dq when it covers every row, else zeros

        def compute(block, source: int, first_key: int) -> List[Tuple[int, int, torch.Tensor, torch.Tensor]]:
            partials = []
            for call, dq, dk, dv in rc.kernel.backward_calls(dout, q, block[0], block[1], out, lse,
                                                             rc.plans[source], first_key, rc.scale):
                if not dq_acc and (call.q_start, call.q_end) == (0, q.shape[1]):
                    dq_acc.append(dq.to(lse.dtype))                # adopted, not copied
                else:
                    if not dq_acc:
                        dq_acc.append(torch.zeros(q.shape, dtype=lse.dtype, device=q.device))
                    dq_acc[0][:, call.q_start:call.q_end].add_(dq)
                partials.append((call.k_start, call.k_end, dk, dv))
            return partials

        block, own = _ring_block(kv, rc)                           # [2, b, S (or the ring prefix), g, d]
        dkv = rc.transport.run(block, compute, dkv_dtype=rc.rider_dtype, **own)
        dq = dq_acc[0] if dq_acc else torch.zeros_like(q)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[2] else None
        return dq.to(q.dtype), dkv.to(kv.dtype), dsinks, None
