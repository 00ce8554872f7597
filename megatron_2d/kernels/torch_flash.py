"""PyTorch's own flash-attention kernel on CUDA (fp16/bf16): the GPU kernel when flash-attn is not installed.

``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` are PyTorch's copy of flash-attn 2
(``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``): [b, s, h, d] tensors, K/V heads shared by
query-head groups (GQA) in the kernel, the log-sum-exp returned, and ``window_size_left`` / ``window_size_right``
in flash-attn's bottom-right convention. So a banded call is one launch with its window, as with flash-attn
(:class:`~megatron_2d.kernels.flash_windows.FlashWindowKernel`), split only where their shared C++ would run
another window (:func:`megatron_2d.layout.band.flash_boxes`).

The ops' schemas are checked when the kernel is built: a PyTorch whose ops take other arguments is refused at
kernel selection, naming its version.
"""

from __future__ import annotations

import torch

from ..layout.choices import Kernel
from .base import KERNELS
from .flash_windows import FlashWindowKernel

FORWARD_ARGS = (
    "query",
    "key",
    "value",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
    "scale",
    "window_size_left",
    "window_size_right",
)
BACKWARD_ARGS = (
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "rng_state",
    "unused",
    "scale",
    "window_size_left",
    "window_size_right",
)


def _ops():
    return torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default


def _check_schemas() -> None:
    """Refuse a PyTorch whose flash ops lack an argument this kernel passes (by name; later optional arguments,
    such as the forward's seqused_k and block_table, are left at their defaults)."""
    for op, expected in zip(_ops(), (FORWARD_ARGS, BACKWARD_ARGS)):
        names = tuple(a.name for a in op._schema.arguments)
        if names[: len(expected)] != expected:
            raise ImportError(
                f"torch {torch.__version__}: {op._schema.name} takes {names}, the torch_flash kernel passes {expected}"
            )


@KERNELS.register
class TorchFlashKernel(FlashWindowKernel):
    """``aten::_flash_attention_forward`` and its backward, one launch per box (dense: cum_seq None)."""

    name = Kernel.TORCH_FLASH

    def __init__(self) -> None:
        _check_schemas()
        self._rng: tuple | None = None  # the forward's (rng_state, unused), which the backward takes back

    def forward_box(self, q, k, v, causal, window, scale):
        forward, _ = _ops()
        out, lse, rng_state, unused, _ = forward(
            q,
            k,
            v,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            False,
            scale=scale,
            window_size_left=window[0],
            window_size_right=window[1],
        )  # out [b, s_q, h_q, d], lse [b, h_q, s_q] fp32
        self._rng = (rng_state, unused)
        return out, lse

    def _no_dropout_rng(self, q: torch.Tensor) -> tuple:
        """The forward's rng outputs, which the backward takes back (unread without dropout)."""
        if self._rng is None:
            self.forward_box(q[:1, :1, :1], q[:1, :1, :1], q[:1, :1, :1], False, (-1, -1), 1.0)
        return self._rng

    def backward_box(self, dout, q, k, v, out, lse, causal, window, scale):
        _, backward = _ops()
        rng_state, unused = self._no_dropout_rng(q)
        return backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            rng_state,
            unused,
            scale=scale,
            window_size_left=window[0],
            window_size_right=window[1],
        )
