"""torch's CPU flash-attention kernel (with log-sum-exp and a matching backward)."""

from __future__ import annotations

from typing import Tuple

import torch

from .base import BlockKernel, repeat_kv_heads, sum_kv_head_groups


class CpuFlashKernel(BlockKernel):
    """``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward; K/V heads expanded for GQA."""

    name = "cpu_flash"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu"

    def forward(self, q, k, v, causal, scale) -> Tuple[torch.Tensor, torch.Tensor]:
        hq = q.shape[2]
        k, v = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        # [b, s, h, d] -> [b, h, s, d] views; the kernel's output keeps [b, s, h, d] memory order.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[2], k.shape[2]
        k_rep, v_rep = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [b, s, h, d] <-> [b, h, s, d]
        lse = lse.to(torch.float64) if q.dtype == torch.float64 else lse
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout), t(q), t(k_rep), t(v_rep), t(out), lse, 0.0, causal, scale=scale)
        return t(dq), sum_kv_head_groups(t(dk), hkv), sum_kv_head_groups(t(dv), hkv)
