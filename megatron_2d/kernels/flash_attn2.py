"""flash-attn 2 on CUDA (fp16/bf16), imported lazily; GQA handled natively by the kernel."""

from __future__ import annotations

import inspect
from typing import Any, Dict

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


class FlashAttn2Kernel(BlockKernel):
    """flash-attn 2 forward via its public ``flash_attn_func`` (returning lse) and its backward entry point.

    The private backward's signature changed across releases (``window_size`` vs ``window_size_left/right``,
    ``softcap``), so its arguments are bound by name.
    """

    name = "flash_attn2"

    def __init__(self) -> None:
        self._fa = _flash_attn_interface()
        self._bwd_params = set(inspect.signature(self._fa._flash_attn_backward).parameters)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale):
        out, lse, _ = self._fa.flash_attn_func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse.float()

    def _window_kwargs(self) -> Dict[str, Any]:
        if "window_size" in self._bwd_params:
            return {"window_size": (-1, -1)}
        return {"window_size_left": -1, "window_size_right": -1}

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs: Dict[str, Any] = dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False,
            rng_state=None, **self._window_kwargs())
        if "softcap" in self._bwd_params:
            kwargs["softcap"] = 0.0
        self._fa._flash_attn_backward(**{k_: v_ for k_, v_ in kwargs.items() if k_ in self._bwd_params})
        return dq, dk, dv
