"""Transformer Engine's fused attention (cuDNN) on CUDA (fp16/bf16): the kernel stock Megatron CP runs per ring step.

``transformer_engine.pytorch.cpp_extensions.fused_attn_fwd`` / ``fused_attn_bwd``, the calls TE's own
``context_parallel.py`` makes for each step, on its ``F16_arbitrary_seqlen`` backend (cuDNN's flash kernels):

    dense    qkv_layout "bshd_bshd_bshd", masks "no_mask" / "causal" (window (-1, 0), TE's form for causal), full
             cu_seqlens; out [b, s_q, h, dv]; aux tensors [softmax stats [b, h, s_q, 1] fp32 (the natural-log
             log-sum-exp of the scaled scores), rng_state]
    varlen   qkv_layout "thd_thd_thd", masks "padding" / "padding_causal": out [total_q, h, dv]; the stats are
             [total_q, h, 1] or, as older TE / cuDNN lay THD stats out, [n, h, max_seqlen_q, 1] (padded per
             sequence): the layout a forward returns is kept and given back to the backward

Parameters moved across releases (2.5 to 2.20: ``softmax_type`` from 2.8, ``bottom_right_diagonal`` from 2.12,
``dqkv_dtype`` dropped and ``o_format`` / ``do_format`` / ``dqkv_layout`` added by 2.20); the kernel passes each by
keyword where the installed release has it, and a release whose functions need a parameter it does not fill is
refused when the kernel is built. Causal masks go only to square pieces (every diagonal alignment agrees there),
bands run as pieces (:mod:`megatron_2d.kernels.piece_kernel`), and sinks never reach the kernel (the ring adds them
once, after its merge), so softmax_type stays "vanilla". Head dims: cuDNN's (:func:`~megatron_2d.kernels.
torch_cudnn.cudnn_head_dim_problem`), d_qk != d_v allowed.

The max logit (QK-clip): from 2.9 on ``fused_attn_fwd(return_max_logit=True)`` returns cuDNN's per-row max reduced to
[h] (in O's dtype), which the kernel takes per launch (``launch_max_logit``); a THD launch whose max comes back per
padded sequence ([h, 1] from 2.12 with an older cuDNN, padded rows included) gives none, and the block then takes the
separate pass (:mod:`megatron_2d.kernels.max_logit`), as releases before 2.9 always do.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ..layout.choices import Kernel
from .base import KERNELS, to_device_once
from .piece_kernel import PieceKernel
from .torch_cudnn import cudnn_head_dim_problem, device_capability


def _te():
    """(fused_attn module, transformer_engine_torch), imported lazily (GPU-only dependency)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    return fused_attn, tex


def te_version() -> str:
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "unknown"))


def te_fused_available() -> bool:
    """True when Transformer Engine's fused attention imports (it needs CUDA and TE's compiled extension)."""
    try:
        _te()
        return True
    except Exception:  # ImportError, a missing shared object, a broken CUDA build
        return False


_FILLED = {  # parameters the kernel passes (or leaves at a neutral default), by function
    "fwd": {
        "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "fake_dtype",
        "fused_attention_backend", "attn_scale", "dropout", "qkv_layout", "o_format", "attn_mask_type",
        "window_size", "return_max_logit",
    },
    "bwd": {
        "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o", "fake_dtype",
        "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend", "attn_scale", "dropout", "qkv_layout",
        "o_format", "do_format", "dqkv_layout", "attn_mask_type", "window_size", "deterministic",
    },
}  # fmt: skip


def _thd_rows(cu_q: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position in it) of each of ``total_q`` packed rows, on the device (no host read)."""
    rows = torch.arange(total_q, device=cu_q.device)
    seq = torch.searchsorted(cu_q[1:].long(), rows, right=True)
    return seq, rows - cu_q.long()[seq]


class TeFunction:
    """fused_attn_fwd or fused_attn_bwd of the installed release, called by keyword with the parameters it has."""

    def __init__(self, fn, which: str, version: str) -> None:
        self._fn = fn
        self.params = inspect.signature(fn).parameters
        required = [p for p, s in self.params.items() if s.default is inspect.Parameter.empty]
        missing = [p for p in required if p not in _FILLED[which]]
        if missing:
            raise ImportError(
                f"Transformer Engine {version}: {fn.__name__}{inspect.signature(fn)} needs {missing}, which "
                f"megatron_2d's te_fused kernel does not fill; supported: TE 2.5 to 2.20"
            )

    def __call__(self, **values):
        return self._fn(**{name: value for name, value in values.items() if name in self.params})


@KERNELS.register
class TeFusedKernel(PieceKernel):
    """TE's fused_attn_fwd / fused_attn_bwd (F16_arbitrary_seqlen): dense launches, and THD ones for pieces."""

    name = Kernel.TE_FUSED
    missing_package = "Transformer Engine is not importable"

    @classmethod
    def available(cls) -> bool:
        return te_fused_available()

    def __init__(self) -> None:
        fused_attn, self._tex = _te()
        self.version = te_version()
        super().__init__()
        self._fwd = TeFunction(fused_attn.fused_attn_fwd, "fwd", self.version)
        self._bwd = TeFunction(fused_attn.fused_attn_bwd, "bwd", self.version)
        self._backend = fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
        self.launch_max_logit = "return_max_logit" in self._fwd.params  # TE 2.9 and later
        self._rng: dict = {}  # device -> the forward's rng_state, which the backward takes back (unread: no dropout)
        self._full_cu: dict = {}  # (batch, s, device) -> cu_seqlens of a dense batch
        self._padded_thd_stats = False  # the THD stats layout the installed TE / cuDNN returned, seen in forward

    def head_dim_problem(self, head_dim: int) -> str | None:
        return cudnn_head_dim_problem(head_dim, device_capability())

    def _dtype(self, dtype: torch.dtype):
        return self._tex.DType.kBFloat16 if dtype == torch.bfloat16 else self._tex.DType.kFloat16

    def _cu(self, batch: int, s: int, device) -> torch.Tensor:
        key = (batch, s, device)
        if key not in self._full_cu:
            self._full_cu[key] = to_device_once(np.arange(0, (batch + 1) * s, s), device).to(torch.int32)
        return self._full_cu[key]

    @staticmethod
    def _mask(causal: bool, varlen: bool) -> tuple[str, tuple[int, int]]:
        if varlen:
            return ("padding_causal", (-1, 0)) if causal else ("padding", (-1, -1))
        return ("causal", (-1, 0)) if causal else ("no_mask", (-1, -1))

    def _common(self, fmt: str, q, scale, causal, varlen):
        mask, window = self._mask(causal, varlen)
        layout = f"{fmt}_{fmt}_{fmt}"
        return dict(
            fake_dtype=q.dtype,
            fused_attention_backend=self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=layout,
            o_format=fmt,
            do_format=fmt,
            dqkv_layout=layout,
            attn_mask_type=mask,
            window_size=window,
        )

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, fmt, causal, scale, max_logit=False):
        """(out, softmax stats) of one launch; with ``max_logit`` a third item, TE's max logit [h] or None where it
        came back otherwise shaped (see the module)."""
        out, aux, *returned = self._fwd(
            is_training=True,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_k,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=q,
            k=k,
            v=v,
            return_max_logit=max_logit,
            **self._common(fmt, q, scale, causal, fmt == "thd"),
        )
        self._rng[q.device] = aux[1]
        if not max_logit:
            return out, aux[0]
        return out, aux[0], returned[0] if returned[0].dim() == 1 else None

    def _backward(self, dout, q, k, v, out, stats, cu_q, cu_k, max_q, max_k, fmt, causal, scale):
        if q.device not in self._rng:  # a backward before any forward in this process: take a forward's rng_state
            self._forward(q[:1, :1], k[:1, :1], v[:1, :1], *(self._cu(1, 1, q.device),) * 2, 1, 1, "bshd", False, 1.0)
        grads = self._bwd(
            max_seqlen_q=max_q,
            max_seqlen_kv=max_k,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=q,
            k=k,
            v=v,
            o=out,
            d_o=dout,
            dqkv_dtype=self._dtype(q.dtype),
            aux_ctx_tensors=[stats, self._rng[q.device]],
            deterministic=False,
            **self._common(fmt, q, scale, causal, fmt == "thd"),
        )
        return tuple(grads[:3])

    def dense_forward(self, q, k, v, causal, scale, max_logit=False):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        out, stats, *m = self._forward(q, k, v, self._cu(b, sq, q.device), self._cu(b, sk, q.device), sq, sk,
                                       "bshd", causal, scale, max_logit)  # fmt: skip
        return out, stats.view(b, q.shape[2], sq), *m  # stats [b, h, s_q, 1] -> [b, h, s_q]

    def dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q, cu_k = self._cu(b, sq, q.device), self._cu(b, sk, q.device)
        return self._backward(dout, q, k, v, out, lse.unsqueeze(-1), cu_q, cu_k, sq, sk, "bshd", causal, scale)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, max_logit=False):
        out, stats, *m = self._forward(q, k, v, cu_q, cu_k, max_q, max_k, "thd", causal, scale, max_logit)
        self._padded_thd_stats = stats.dim() == 4
        if self._padded_thd_stats:  # [n, h, max_q, 1], each sequence's rows first: back to [h, total_q]
            seq, pos = _thd_rows(cu_q, q.shape[0])
            lse = stats[seq, :, pos, 0].t()
        else:
            lse = stats.view(q.shape[0], q.shape[1]).t()  # [total_q, h, 1] -> [h, total_q]
        return out, lse, *m

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        if self._padded_thd_stats:
            seq, pos = _thd_rows(cu_q, q.shape[0])
            stats = lse.new_zeros((cu_q.shape[0] - 1, lse.shape[0], max_q, 1))
            stats[seq, :, pos, 0] = lse.t()  # [n, h, max_q, 1]
        else:
            stats = lse.t().contiguous().unsqueeze(-1)  # [total_q, h, 1]
        return self._backward(dout, q, k, v, out, stats, cu_q, cu_k, max_q, max_k, "thd", causal, scale)
