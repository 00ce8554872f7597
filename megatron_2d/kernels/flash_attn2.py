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


def flash_mask(band, sq: int, sk: int):
    """(causal, (window_left, window_right)) for flash-attn from a trimmed band (masks align bottom-right)."""
    if band is None:
        return False, (-1, -1)
    if band.is_causal_square(sq, sk):
        return True, (-1, -1)
    return False, band.flash_window(sq, sk)


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

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, band, scale):
        causal, window = flash_mask(band, q.shape[1], k.shape[1])
        extra = {} if window == (-1, -1) else {"window_size": window}
        out, lse, _ = self._fa.flash_attn_func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True, **extra)
        return out, lse.float()

    def _window_kwargs(self, window) -> Dict[str, Any]:
        if "window_size" in self._bwd_params:
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
