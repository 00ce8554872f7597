"""A plain torch kernel (matmul + softmax in fp32, fp64 for fp64) on CPU: a reference for the flash kernels.

It materialises the [b, h, s_q, s_k] score matrix of one block, which does not fit at long-context block sizes,
so it runs on CPU only and is never chosen automatically (CUDA has the flash kernels, flash_attn2 and torch_flash).
"""

from __future__ import annotations

import torch

from ..layout.choices import Kernel
from .base import KERNELS, BlockKernel, accumulator_dtype, band_mask, repeat_kv_heads, sum_kv_head_groups


def _scores(q, k, band, scale):
    """Scaled scores [b, h, s_q, s_k] in the accumulator dtype, keys outside ``band`` at -inf."""
    acc = accumulator_dtype(q.dtype)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc)) * scale
    if band is not None:
        s = s + band_mask(band, s.shape[-2], s.shape[-1], acc, s.device)
    return s


@KERNELS.register
class TorchMathKernel(BlockKernel):
    """Exact attention with explicit scores; forward and backward are the textbook formulas."""

    name = Kernel.TORCH_MATH
    needs_equal_head_dims = False

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu"

    def forward(self, q, k, v, band, scale):
        hq = q.shape[2]
        k, v = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        s = _scores(q, k, band, scale)  # [b, h, sq, sk]
        lse = torch.logsumexp(s, dim=-1)  # [b, h, sq]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype))
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, band, scale):
        hq, hkv = q.shape[2], k.shape[2]
        k_rep, v_rep = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        s = _scores(q, k_rep, band, scale)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # [b, h, sq, sk]
        do = dout.to(acc)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, v_rep.to(acc))
        delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [b, sq, h] -> [b, h, sq]
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep.to(acc))
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
        return (dq.to(q.dtype), sum_kv_head_groups(dk, hkv).to(k.dtype), sum_kv_head_groups(dv, hkv).to(v.dtype))
