"""Every context rank of a 2D layout in one process: the op's ring attention with the calls of cp > 1 on one device.

The head all-to-all and the ring only move data; what runs on the device is the block kernels on each context
rank's calls, the log-sum-exp merges, the sinks and the dK/dV accumulation. :func:`loopback_attention` plays each
context rank r in turn with a :class:`LoopbackTransport` that feeds ``compute`` every source's K/V block, as the
Double-Ring or the neighbour exchange would deliver them, and files each block's dK/dV partial in a mailbox (in
the rider dtype, as riders accumulate); a rank's dK/dV is the sum of what every rank filed for it. Each virtual
rank computes all heads (the head split only partitions them), so any (hp, cp, w, placement) layout, sliding
windows and packed documents (PackedSharding over virtual groups) run on one GPU (tools/gpu_smoke.py).

    out, dq, dk, dv, dsinks = loopback_attention(q, k, v, dout, Layout2D(8, 2, 2), causal=True, kernel=kernel)

q [b, T, hq, dk], k [b, T, hkv, dk], v [b, T, hkv, dv], dout [b, T, hq, dv] in the global order (packed: b = 1,
T the packed stream). Blocks and riders are the op's: K and V side by side, [b, S, hkv, dk + dv].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from ..attention import rider_dtype
from ..groups import Groups2D
from ..kernels import BlockKernel
from ..layout.band import SlidingWindow
from ..layout.block_calls import context_calls, context_chunks
from ..layout.choices import DkvCommDtype, PackingMode, check_dkv_comm_dtype
from ..layout.topology import Layout2D, place_all_ranks
from ..packed_sharding import PackedSharding
from ..ring_attention import RingAttention, RingCall, RingContext
from ..transport.base import ComputeFn, gather_partials


class LoopbackTransport:
    """Context rank ``rank``'s transport in a one-process run: every source block, directly (see the module); a
    :class:`~megatron_2d.transport.base.Transport` whose backward returns zeros (the dK/dV are in the mailbox)."""

    traffic_kinds: ClassVar[tuple[str, ...]] = ()  # one process: nothing is sent

    def __init__(
        self,
        rank: int,
        blocks: Sequence[torch.Tensor],
        mailbox: dict[int, list[torch.Tensor]],
        ring_keys: int | None = None,
    ) -> None:
        self.rank, self.blocks, self.mailbox, self.ring_keys = rank, blocks, mailbox, ring_keys

    def run(self, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        for src, block in enumerate(self.blocks):
            block = kv if src == self.rank else block
            if self.ring_keys is not None and src != self.rank:
                block = block[:, : self.ring_keys]  # only the ring prefix travels
            partials = compute(block, src, 0)
            if dkv_dtype is not None:
                buffer = torch.empty(block.shape, dtype=dkv_dtype, device=block.device)
                self.mailbox[src].append(gather_partials(buffer, partials))
        # the rank's own dK/dV is assembled from the mailbox once every rank has run
        return None if dkv_dtype is None else torch.zeros(kv.shape, dtype=dkv_dtype, device=kv.device)


def virtual_groups(layout: Layout2D, cp_index: int) -> Groups2D:
    """The Groups2D of one rank of ``layout`` without process groups (calls and PackedSharding need only places)."""
    place = place_all_ranks(layout, [list(range(layout.cp_size))], layout.cp_size)[cp_index]
    return Groups2D(layout, place, None, None, None, None, None)


def _token_indices(layout: Layout2D, tokens: int, packing: PackedSharding | None) -> list[np.ndarray]:
    """Per context rank, the global token of each row of its ring layout (-1: padding)."""
    if packing is not None:
        return [np.asarray(view) for view in packing.views]
    c = tokens // (2 * layout.cp_size)
    return [
        np.concatenate([np.arange(x * c, (x + 1) * c) for x in context_chunks(layout, r)])
        for r in range(layout.context_size)
    ]


def _gather(x: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """Rows ``index`` of x [b, T, ...] along dim 1, zeros where index is -1."""
    idx = torch.from_numpy(index).to(x.device)
    out = x.index_select(1, idx.clamp(min=0))
    return out.masked_fill((idx < 0).view(1, -1, *([1] * (x.dim() - 2))), 0)


def _scatter(rows: Sequence[torch.Tensor], indices: Sequence[np.ndarray], like: torch.Tensor) -> torch.Tensor:
    """The global [b, T, ...] tensor from each rank's rows (padding dropped); every token appears once."""
    out = torch.zeros_like(like)
    for x, index in zip(rows, indices):
        idx = torch.from_numpy(index).to(x.device)
        keep = idx >= 0
        out[:, idx[keep]] = x[:, keep].to(out.dtype)
    return out


def loopback_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    layout: Layout2D,
    kernel: BlockKernel,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    cu_seqlens=None,
    packing_mode: str = PackingMode.ZIGZAG,
):
    """(out, dq, dk, dv, dsinks) of the whole sequence, every context rank of ``layout`` run in turn (module
    docstring). ``cu_seqlens``: packed documents in ``packing_mode``; the tensors are then the packed stream."""
    check_dkv_comm_dtype(dkv_comm_dtype)
    b, T, hq, d = q.shape
    cp = layout.context_size
    scale = d**-0.5 if scale is None else scale
    packing, ring_keys = None, None
    if cu_seqlens is not None:
        packing = PackedSharding(cu_seqlens, virtual_groups(layout, 0), mode=packing_mode)
        sliding = SlidingWindow.of(window, causal, packing.max_document_length)
        ring_keys = packing.ring_tokens if packing.ring_tokens < packing.views.shape[1] else None
    else:
        sliding = SlidingWindow.of(window, causal, T)
        group_calls = context_calls(layout, T // (2 * layout.cp_size), causal, sliding)
    indices = _token_indices(layout, T, packing)
    kv_rows = [torch.cat([_gather(k, i), _gather(v, i)], dim=-1) for i in indices]  # [b, S, hkv, dk + dv] per rank
    kernel = kernel.for_head_dims(d, v.shape[-1])
    mailbox: dict[int, list[torch.Tensor]] = defaultdict(list)
    outs, dqs, dsinks = [], [], []
    for r in range(cp):
        if packing is not None:
            calls = PackedSharding(cu_seqlens, virtual_groups(layout, layout.index_of(0, r)), mode=packing_mode).calls(
                causal, sliding
            )
        else:
            calls = {src: group_calls.calls[(r, src)] for src in range(cp)}
        rc = RingContext(
            transport=LoopbackTransport(r, kv_rows, mailbox, ring_keys),
            kernel=kernel,
            calls=calls,
            scale=scale,
            rider_dtype=rider_dtype(q.dtype, dkv_comm_dtype),
        )
        qr = _gather(q, indices[r]).requires_grad_(True)
        kvr = kv_rows[r].detach().requires_grad_(True)
        sr = None if sinks is None else sinks.detach().clone().requires_grad_(True)
        out, _ = RingAttention.apply(qr, kvr, sr, RingCall(rc))
        out.backward(_gather(dout, indices[r]))
        outs.append(out.detach())
        dqs.append(qr.grad)
        if sr is not None:
            dsinks.append(sr.grad)
    dkvs = []
    for r in range(cp):
        total = torch.zeros(kv_rows[r].shape, dtype=mailbox[r][0].dtype, device=q.device)
        for part in mailbox[r]:
            total[:, : part.shape[1]] += part
        dkvs.append(total)
    dk, dv = ([x[..., :d] for x in dkvs], [x[..., d:] for x in dkvs])  # K | V side by side
    return (
        _scatter(outs, indices, dout),
        _scatter(dqs, indices, q),
        _scatter(dk, indices, k),
        _scatter(dv, indices, v),
        sum(dsinks) if dsinks else None,
    )
