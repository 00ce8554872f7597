"""flash-attn 2 on CUDA (fp16/bf16), imported lazily; GQA handled natively by the kernel.

Many calls on one block (packed documents: one per pair of same-document runs) go to flash-attn's varlen kernel,
one launch per mask kind: the calls' query rows and key columns are gathered into packed [total, h, d] tensors
with ``cu_seqlens``, and the outputs / log-sum-exp / gradients are cut back per call.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .base import BlockKernel


def _flash_attn_interface():
    from flash_attn import flash_attn_interface  # lazy: GPU-only dependency

    return flash_attn_interface


def flash_attn_available() -> bool:
    """True when flash-attn imports (it needs CUDA)."""
    try:
        _flash_attn_interface()
        return True
    except Exception:  # ImportError, or a broken CUDA build
        return False


def flash_mask(band, sq: int, sk: int):
    """(causal, (window_left, window_right)) for flash-attn from a trimmed band (masks align bottom-right)."""
    if band is None:
        return False, (-1, -1)
    if band.is_causal_square(sq, sk):
        return True, (-1, -1)
    return False, band.flash_window(sq, sk)


@dataclass(frozen=True)
class VarlenGroup:
    """Calls with one flash mask, batched into one varlen launch (index tensors built once per plan)."""

    calls: Tuple[Any, ...]
    q_index: torch.Tensor          # [total_q] local query rows, call by call
    k_index: torch.Tensor          # [total_k] key columns of the block (from first_key), call by call
    cu_q: torch.Tensor             # [n + 1] int32
    cu_k: torch.Tensor
    q_offsets: Tuple[int, ...]     # the same offsets as Python ints, to cut results
    k_offsets: Tuple[int, ...]
    causal: bool
    window: Tuple[int, int]

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.q_offsets[:-1], self.q_offsets[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.k_offsets[:-1], self.k_offsets[1:]))


def varlen_groups(calls: Sequence[Any], first_key: int, device) -> Tuple[List[VarlenGroup], List[Any]]:
    """(varlen groups of two or more calls sharing a flash mask, the calls left to run alone)."""
    by_mask: Dict[Tuple, List[Any]] = defaultdict(list)
    for call in calls:
        by_mask[flash_mask(call.band, call.q_end - call.q_start, call.k_end - call.k_start)].append(call)
    groups, alone = [], []
    for (causal, window), members in by_mask.items():
        if len(members) < 2:
            alone.extend(members)
            continue
        q_off, k_off, q_idx, k_idx = [0], [0], [], []
        for c in members:
            q_idx.extend(range(c.q_start, c.q_end))
            k_idx.extend(range(c.k_start - first_key, c.k_end - first_key))
            q_off.append(len(q_idx))
            k_off.append(len(k_idx))
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)    # noqa: E731
        as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=device)    # noqa: E731
        groups.append(VarlenGroup(tuple(members), as_long(q_idx), as_long(k_idx), as_int(q_off), as_int(k_off),
                                  tuple(q_off), tuple(k_off), causal, window))
    return groups, alone


def packed_lse(lse: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """Varlen log-sum-exp as [h, total_q]: flash-attn >= 2.5 returns that; older 2.x returned [n, h, max_seqlen]
    (each sequence padded), cut back to its rows here."""
    if lse.dim() == 2:
        return lse
    return torch.cat([lse[i, :, :b - a] for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))], dim=1)


def padded_lse(lse: torch.Tensor, offsets: Sequence[int], max_len: int) -> torch.Tensor:
    """[h, total_q] -> [n, h, max_seqlen] (the older varlen backward's layout), zero padded."""
    out = lse.new_zeros((len(offsets) - 1, lse.shape[0], max_len))
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        out[i, :, :b - a] = lse[:, a:b]
    return out


class FlashAttn2Kernel(BlockKernel):
    """flash-attn 2 forward via its public ``flash_attn_func`` (returning lse) and its backward entry point.

    The private backward's signature changed across releases (``window_size`` vs ``window_size_left/right``,
    ``softcap``), so its arguments are bound by name. Bands become flash-attn's ``window_size`` (>= 2.3).
    Calls must come trimmed (:meth:`megatron_2d.band.Band.trim`): flash-attn returns lse = +inf for a row that sees
    no key, which the log-sum-exp merge would turn into NaN; trimmed calls have no such row.
    """

    name = "flash_attn2"

    def __init__(self) -> None:
        self._fa = _flash_attn_interface()
        self._bwd_params = set(inspect.signature(self._fa._flash_attn_backward).parameters)
        self._varlen = hasattr(self._fa, "flash_attn_varlen_func") and hasattr(self._fa, "_flash_attn_varlen_backward")
        self._varlen_bwd_params = (set(inspect.signature(self._fa._flash_attn_varlen_backward).parameters)
                                   if self._varlen else set())
        self._groups: Dict[Tuple, Tuple[List[VarlenGroup], List[Any]]] = {}
        self._padded_varlen_lse = False       # the installed flash-attn's varlen lse layout, seen in forward

    def _grouped(self, calls, first_key: int, device):
        """Varlen groups of one block's calls, built on first use (plans are fixed per layer and batch)."""
        key = (tuple(calls), first_key, device)
        if key not in self._groups:
            self._groups[key] = varlen_groups(calls, first_key, device)
        return self._groups[key]

    def forward_calls(self, q, k, v, calls, first_key, scale):
        if not self._varlen or q.shape[0] != 1 or len(calls) < 2:
            return super().forward_calls(q, k, v, calls, first_key, scale)
        groups, alone = self._grouped(calls, first_key, q.device)
        results = super().forward_calls(q, k, v, alone, first_key, scale)
        for g in groups:
            qp, kp, vp = q[0].index_select(0, g.q_index), k[0].index_select(0, g.k_index), \
                v[0].index_select(0, g.k_index)                                   # [total, h, d]
            extra = {} if g.window == (-1, -1) else {"window_size": g.window}
            out, lse, _ = self._fa.flash_attn_varlen_func(
                qp, kp, vp, g.cu_q, g.cu_k, g.max_q, g.max_k, dropout_p=0.0, softmax_scale=scale,
                causal=g.causal, return_attn_probs=True, **extra)                # out [total_q, h, d]
            self._padded_varlen_lse = lse.dim() == 3
            lse = packed_lse(lse, g.q_offsets)                                    # [h, total_q]
            for c, a, b in zip(g.calls, g.q_offsets[:-1], g.q_offsets[1:]):
                results.append((c, out[a:b].unsqueeze(0), lse[:, a:b].unsqueeze(0).float()))
        return results

    def backward_calls(self, dout, q, k, v, out, lse, calls, first_key, scale):
        if not self._varlen or q.shape[0] != 1 or len(calls) < 2:
            return super().backward_calls(dout, q, k, v, out, lse, calls, first_key, scale)
        groups, alone = self._grouped(calls, first_key, q.device)
        results = super().backward_calls(dout, q, k, v, out, lse, alone, first_key, scale)
        for g in groups:
            rows = lambda x: x[0].index_select(0, g.q_index)                      # noqa: E731
            qp, dp, op = rows(q), rows(dout), rows(out)
            kp, vp = k[0].index_select(0, g.k_index), v[0].index_select(0, g.k_index)
            lp = lse[0].index_select(1, g.q_index).contiguous()                     # [h, total_q]
            if self._padded_varlen_lse:
                lp = padded_lse(lp, g.q_offsets, g.max_q)
            dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
            kwargs: Dict[str, Any] = dict(
                dout=dp, q=qp, k=kp, v=vp, out=op, softmax_lse=lp, dq=dq, dk=dk, dv=dv, cu_seqlens_q=g.cu_q,
                cu_seqlens_k=g.cu_k, max_seqlen_q=g.max_q, max_seqlen_k=g.max_k, dropout_p=0.0,
                softmax_scale=scale, causal=g.causal, alibi_slopes=None, deterministic=False, rng_state=None,
                softcap=0.0, **self._window_kwargs(g.window, self._varlen_bwd_params))
            self._fa._flash_attn_varlen_backward(**{k_: v_ for k_, v_ in kwargs.items()
                                                    if k_ in self._varlen_bwd_params})
            for c, qa, qb, ka, kb in zip(g.calls, g.q_offsets[:-1], g.q_offsets[1:], g.k_offsets[:-1],
                                         g.k_offsets[1:]):
                results.append((c, dq[qa:qb].unsqueeze(0), dk[ka:kb].unsqueeze(0), dv[ka:kb].unsqueeze(0)))
        return results

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, band, scale):
        causal, window = flash_mask(band, q.shape[1], k.shape[1])
        extra = {} if window == (-1, -1) else {"window_size": window}
        out, lse, _ = self._fa.flash_attn_func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True, **extra)
        return out, lse.float()

    def _window_kwargs(self, window, params=None) -> Dict[str, Any]:
        if "window_size" in (self._bwd_params if params is None else params):
            return {"window_size": window}
        return {"window_size_left": window[0], "window_size_right": window[1]}

    def backward(self, dout, q, k, v, out, lse, band, scale):
        causal, window = flash_mask(band, q.shape[1], k.shape[1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs: Dict[str, Any] = dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False,
            rng_state=None, **self._window_kwargs(window))
        if "softcap" in self._bwd_params:
            kwargs["softcap"] = 0.0
        self._fa._flash_attn_backward(**{k_: v_ for k_, v_ in kwargs.items() if k_ in self._bwd_params})
        return dq, dk, dv
