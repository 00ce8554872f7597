"""Zigzag ring attention over one context group, on a K/V transport, as one autograd Function.

Notation (all local to one rank, after the head all-to-all)
    b  batch      S  tokens of this context rank (2*hp chunks of c tokens, ascending global order)
    h  query heads of this rank       g  K/V heads of this rank (h divisible by g)
    dk query/key head dim             dv value head dim (MLA: dk 192, dv 128; otherwise dk = dv)
Tensors: q [b, S, h, dk]; out [b, S, h, dv]; the block that travels, kv [b, S, g, dk + dv] (K and V side by side on
the last dim: :func:`split_kv` gives their views, and dK/dV riders have the same format); lse [b, h, S] and every
accumulator in the accumulator dtype (fp32; fp64 for fp64 inputs); sinks [h] (one logit per query head).

An ``expander`` (:class:`KVExpander`) makes the ring carry something else than K/V: a block [b, S, ...] from which
every step computes (k, v) with differentiable torch ops and ``params`` (MLA's latent ring: the compressed KV and
the rope key, up-projected with this rank's heads of the up-projection weight). Backward then sends the block's
gradient home instead of dK/dV and returns the gradients of ``params``, summed over every block this rank saw.

Sinks (gpt-oss, Megatron's softmax_type "learnable" / "off-by-one") add exp(sink_h) to every row's softmax
denominator: once the transport has visited every block, lse' = logaddexp(lse, sink) and out' = out *
exp(lse - lse'). The kernels' backward with (out', lse') is then exact for q, k, v, and
d sink_h = -sum over rows of exp(sink_h - lse') * (dout . out') (the sink's value vector is zero).

The max logit (``max_logit`` True, QK-clip): max_logit [h], the max of scale * q . k over every pair this rank's
calls see, from every block the transport brought (:meth:`~megatron_2d.kernels.base.BlockKernel.
forward_calls_with_max`), in the accumulator dtype; not a differentiable output. Sinks are not q . k logits and stay
out of it, as in Transformer Engine (its max is taken before the sink column joins the scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .kept_forward import KeptForward, Point
from .kernels import BlockKernel
from .kernels.base import accumulator_dtype
from .kernels.merge import merge_attention_
from .layout.block_calls import BlockCall
from .transport.base import Partials, Transport, gather_partials


def split_kv(block: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (k [..., key_dim], v [..., rest]) of a K/V block (or rider) [..., key_dim + value_dim]."""
    return block[..., :key_dim], block[..., key_dim:]


class KVExpander(Protocol):
    """(k [b, keys, g, dk], v [b, keys, g, dv]) from a travelling block [b, keys, ...] and parameters, by
    differentiable torch ops (see the module docstring)."""

    value_dim: int

    def __call__(self, block: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class RingContext:
    """Everything the ring needs besides the tensors."""

    transport: Transport
    kernel: BlockKernel
    calls: dict[int, tuple[BlockCall, ...]]  # source context rank -> kernel calls against its K/V block
    scale: float
    rider_dtype: torch.dtype  # dtype of the dK/dV partials that travel (see attention_2d)
    key_spans: dict[int, tuple[int, int]] = field(init=False, repr=False)
    """source -> [first, last) keys its calls read (an expander expands only those)."""

    def __post_init__(self) -> None:
        self.key_spans = {
            src: (min(c.k_start for c in calls), max(c.k_end for c in calls))
            for src, calls in self.calls.items()
            if calls
        }


def apply_sinks_(out_acc: torch.Tensor, lse_acc: torch.Tensor, sinks: torch.Tensor) -> None:
    """Add one extra logit per head (sinks [h]) to every row's softmax: rescale out [b, S, h, d], update lse."""
    sink = sinks.to(lse_acc.dtype).view(1, -1, 1)  # [1, h, 1]
    new_lse = torch.logaddexp(lse_acc, sink)  # [b, h, S]
    out_acc.mul_(torch.exp(lse_acc - new_lse).transpose(1, 2).unsqueeze(-1))
    lse_acc.copy_(new_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h] from this rank's rows: -sum_rows exp(sink - lse) * (dout . out)."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [b, S, h] -> [b, h, S]
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)  # [b, h, S]
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


@dataclass
class _Expansion:
    """How one call of the ring turns blocks into (k, v): views of a K/V block, or an expander's output (of the
    keys the block's calls read only), and the way back from the kernels' (dk, dv) to the block's gradient."""

    key_dim: int
    expander: KVExpander | None
    params: Sequence[torch.Tensor]
    spans: dict[int, tuple[int, int]]
    param_grads: list[torch.Tensor] = field(default_factory=list)  # summed over blocks, accumulator dtype

    def keys(self, block: torch.Tensor, source: int, first_key: int, grad: bool = False):
        """(k, v, their first key, the expander's graph when ``grad``, else None)."""
        if self.expander is None:
            return (*split_kv(block, self.key_dim), first_key, None)
        lo, hi = self.spans[source]
        part = block[:, lo - first_key : hi - first_key]
        if not grad:
            return (*self.expander(part, *self.params), lo, None)
        with torch.enable_grad():
            leaf = part.detach().requires_grad_(True)
            params = [p.detach().requires_grad_(True) for p in self.params]
            k, v = self.expander(leaf, *params)
        return k.detach(), v.detach(), lo, (leaf, params, k, v, lo)

    def partials(self, kernel_partials, graph) -> Partials:
        """The kernels' partial (dk, dv) of one block as the block's partial gradients; through an expander (its
        ``graph``), one partial over the expanded keys, and its parameters' gradients added to ``param_grads``."""
        if graph is None:
            return [(call.k_start, call.k_end, (dk, dv)) for call, dk, dv in kernel_partials]
        leaf, params, k, v, lo = graph
        dkv = torch.empty(
            *k.shape[:-1], k.shape[-1] + v.shape[-1], dtype=accumulator_dtype(k.dtype), device=k.device
        )  # [b, keys, g, dk + dv]
        gather_partials(dkv, [(call.k_start, call.k_end, (dk, dv)) for call, dk, dv in kernel_partials], lo)
        d_block, *d_params = torch.autograd.grad((k, v), (leaf, *params), split_kv(dkv.to(k.dtype), k.shape[-1]))
        if not self.param_grads:
            self.param_grads.extend(
                torch.zeros(p.shape, dtype=accumulator_dtype(p.dtype), device=p.device) for p in params
            )
        for acc, grad in zip(self.param_grads, d_params):
            acc.add_(grad)
        return [(lo, lo + leaf.shape[1], (d_block,))]


def _forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor | None,
    rc: RingContext,
    expansion: _Expansion,
    max_logit: bool = False,
):
    """The ring's forward: (out [b, S, h, dv] in q's dtype, lse [b, h, S] in the accumulator dtype, max_logit [h]
    in the accumulator dtype, or None unless ``max_logit``)."""
    b, S, h, dk = q.shape
    dv = kv.shape[-1] - dk if expansion.expander is None else expansion.expander.value_dim
    acc = accumulator_dtype(q.dtype)
    max_acc = torch.full((h,), float("-inf"), dtype=acc, device=q.device) if max_logit else None
    # the first kernel call's results when it covers every row (the own block without a window), else zeros
    accumulators: list[torch.Tensor] = []  # [out_acc [b, S, h, dv], lse_acc [b, h, S]]

    def start() -> None:
        if not accumulators:
            accumulators.extend(
                (
                    torch.zeros(b, S, h, dv, dtype=acc, device=q.device),
                    torch.full((b, h, S), float("-inf"), dtype=acc, device=q.device),
                )
            )

    def compute(block, source: int, first_key: int) -> None:
        if not rc.calls[source]:
            return
        k, v, first_key, _ = expansion.keys(block, source, first_key)
        if max_acc is None:
            results = rc.kernel.forward_calls(q, k, v, rc.calls[source], first_key, rc.scale)
        else:
            results, block_max = rc.kernel.forward_calls_with_max(q, k, v, rc.calls[source], first_key, rc.scale)
            torch.maximum(max_acc, block_max, out=max_acc)
        for call, out_blk, lse_blk in results:
            if not accumulators and (call.q_start, call.q_end) == (0, S):
                accumulators.extend((out_blk.to(acc), lse_blk.to(acc)))  # adopted, not copied
            else:
                start()
                rows = slice(call.q_start, call.q_end)
                merge_attention_(accumulators[0][:, rows], accumulators[1][:, :, rows], out_blk, lse_blk)

    rc.transport.run(kv, compute)
    start()  # (no call at all: nothing visible)
    out_acc, lse_acc = accumulators
    if sinks is not None:
        apply_sinks_(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc, max_acc


@dataclass(frozen=True)
class RingCall:
    """One call of the ring: the cached :class:`RingContext` and what varies per call. ``kept``: Selective
    Checkpoint++'s record of the call (:class:`megatron_2d.kept_forward.KeptForward`, point "ring"; None for a plain
    call), which the caller's options carry (:attr:`megatron_2d.call.options.AttentionOptions.kept`); ``max_logit``:
    also return the max logit; ``expander``: what makes each step's (k, v) from the travelling block (None: the
    block is K and V side by side)."""

    context: RingContext
    kept: KeptForward | None = None
    max_logit: bool = False
    expander: KVExpander | None = None


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale, masked [+ sinks]) v over the whole context group; exact forward and backward.

    ``kv`` is the block that travels: K and V side by side (``call.expander`` None), or the expander's input, which
    then makes each step's (k, v) with ``params`` (see the module docstring). With ``call.kept`` a replayed ring
    returns the kept out and lse without running the transport or the kernels, and its backward starts from them.
    Returns (out, max_logit [h] or None): the max when ``call.max_logit`` and the ring ran (a replay gives None: the
    reduced max is kept at the call's "max_logit" point)."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        kv: torch.Tensor,
        sinks: torch.Tensor | None,
        call: RingCall,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rc, kept, expander = call.context, call.kept, call.expander
        replayed = kept.replay(Point.RING) if kept is not None else None
        local_max = None
        if replayed is not None:
            out, lse = replayed
        else:
            expansion = _Expansion(q.shape[-1], expander, params, rc.key_spans)
            out, lse, local_max = _forward(q, kv, sinks, rc, expansion, call.max_logit)
            if kept is not None:
                kept.record(Point.RING, (out, lse))
        ctx.save_for_backward(q, kv, out, lse, sinks, *params)
        ctx.rc, ctx.expander = rc, expander
        if local_max is not None:
            ctx.mark_non_differentiable(local_max)
        return out, local_max

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _d_max_logit=None):
        q, kv, out, lse, sinks, *params = ctx.saved_tensors
        rc: RingContext = ctx.rc
        expansion = _Expansion(q.shape[-1], ctx.expander, params, rc.key_spans)
        dout = dout.contiguous()
        kernel_dout, kernel_out = rc.kernel.backward_inputs(dout, out)
        dq_acc: list[torch.Tensor] = []  # the first call's dq when it covers every row, else zeros

        def compute(block, source: int, first_key: int) -> Partials:
            if not rc.calls[source]:
                return []
            k, v, k_first, graph = expansion.keys(block, source, first_key, grad=True)
            kernel_partials = []
            for call, dq, dk, dv in rc.kernel.backward_calls(
                kernel_dout, q, k, v, kernel_out, lse, rc.calls[source], k_first, rc.scale
            ):
                if not dq_acc and (call.q_start, call.q_end) == (0, q.shape[1]):
                    dq_acc.append(dq.to(lse.dtype))  # adopted, not copied
                else:
                    if not dq_acc:
                        dq_acc.append(torch.zeros(q.shape, dtype=lse.dtype, device=q.device))
                    dq_acc[0][:, call.q_start : call.q_end].add_(dq)
                kernel_partials.append((call, dk, dv))
            return expansion.partials(kernel_partials, graph)

        dkv = rc.transport.run(kv, compute, dkv_dtype=rc.rider_dtype)
        dq = dq_acc[0] if dq_acc else torch.zeros_like(q)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[2] else None
        d_params = [g.to(p.dtype) for p, g in zip(params, expansion.param_grads)] or [None] * len(params)
        return (dq.to(q.dtype), dkv.to(kv.dtype), dsinks, None, *d_params)
