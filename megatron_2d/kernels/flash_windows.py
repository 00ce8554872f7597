"""What the flash kernels (flash-attn 2 and PyTorch's copy of it) share: head dims, and bands as their windows.

Both run a mask as (causal, (window_left, window_right)), aligned to the block's bottom-right corner, through the
same C++ (``flash_api.cpp``), which changes some windows on blocks with more queries than keys
(:func:`megatron_2d.layout.band.flash_expressible`). :class:`FlashWindowKernel` therefore runs a call as the boxes of
:func:`megatron_2d.layout.band.flash_boxes`: one launch when its window is kept as given, else one per box. The boxes
split the call's rows, so each row's out and lse come from one launch (no merge); their dK/dV add up over keys.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from ..layout.band import Band, Trimmed, flash_boxes
from .base import BlockKernel, accumulator_dtype

MAX_HEAD_DIM = 256


def flash_head_dim_problem(head_dim: int) -> str | None:
    """Why flash-attn 2's kernels (and PyTorch's copy of them) cannot take ``head_dim`` (None if they can): its
    backward needs a multiple of 8 (the forward pads, the backward refuses), and at most 256."""
    if head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM:
        return None
    padded = head_dim + (-head_dim) % 8
    return (
        f"head dim {head_dim} is not supported by the flash kernels (a multiple of 8, at most {MAX_HEAD_DIM}"
        + (f"; pad to {padded}" if 0 < padded <= MAX_HEAD_DIM else "")
        + ")"
    )


def flash_mask(band: Band | None, sq: int, sk: int) -> tuple[bool, tuple[int, int]]:
    """(causal, (window_left, window_right)) of one box from :func:`~megatron_2d.layout.band.flash_boxes` (raises
    ValueError for a band the flash kernels would run otherwise, see :meth:`Band.flash_window`)."""
    if band is None:
        return False, (-1, -1)
    if band.is_causal_square(sq, sk):
        return True, (-1, -1)
    return False, band.flash_window(sq, sk)


def _whole(boxes, sq: int, sk: int, band: Band | None) -> bool:
    """Whether ``boxes`` is the one box of the whole sq x sk block with ``band``: the call runs as given."""
    return len(boxes) == 1 and boxes[0] == Trimmed(0, sq, 0, sk, band)


def flash_calls(calls: Sequence) -> list:
    """The calls of one block as the flash kernels run them: each call, or where its window would not be kept,
    its boxes (:func:`~megatron_2d.layout.band.flash_boxes`) as calls of the same type, in block coordinates."""
    runnable = []
    for call in calls:
        sq, sk = call.q_end - call.q_start, call.k_end - call.k_start
        boxes = flash_boxes(call.band, sq, sk)
        if _whole(boxes, sq, sk, call.band):
            runnable.append(call)
            continue
        runnable += [
            type(call)(
                call.q_start + b.q_start,
                call.q_start + b.q_end,
                call.k_start + b.k_start,
                call.k_start + b.k_end,
                b.band,
            )
            for b in boxes
        ]
    return runnable


class FlashWindowKernel(BlockKernel):
    """A flash kernel: subclasses launch one box with its (causal, window); forward and backward here run a call
    as its boxes."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def head_dim_problem(self, head_dim: int) -> str | None:
        return flash_head_dim_problem(head_dim)

    @abc.abstractmethod
    def forward_box(self, q, k, v, causal: bool, window: tuple[int, int], scale: float):
        """One launch: (out [b, s_q, h_q, d] in q's dtype, lse [b, h_q, s_q] fp32)."""

    @abc.abstractmethod
    def backward_box(self, dout, q, k, v, out, lse, causal: bool, window: tuple[int, int], scale: float):
        """One launch: (dq, dk, dv) in the inputs' dtype, from the final out and lse of the box's rows."""

    def forward(self, q, k, v, band, scale):
        sq, sk = q.shape[1], k.shape[1]
        boxes = flash_boxes(band, sq, sk)
        if _whole(boxes, sq, sk, band):
            return self.forward_box(q, k, v, *flash_mask(band, sq, sk), scale)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=torch.float32, device=q.device)
        for b in boxes:
            rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
            out[:, rows], lse[:, :, rows] = self.forward_box(
                q[:, rows], k[:, keys], v[:, keys], *flash_mask(b.band, b.q_end - b.q_start, b.k_end - b.k_start), scale
            )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, band, scale):
        sq, sk = q.shape[1], k.shape[1]
        boxes = flash_boxes(band, sq, sk)
        if _whole(boxes, sq, sk, band):
            return self.backward_box(
                dout.contiguous(), q, k, v, out, lse.contiguous(), *flash_mask(band, sq, sk), scale
            )
        acc = accumulator_dtype(q.dtype)
        dq = q.new_zeros(q.shape)  # each row in one box
        dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))  # boxes share keys: fp32
        for b in boxes:
            rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
            g = self.backward_box(
                dout[:, rows].contiguous(),
                q[:, rows],
                k[:, keys],
                v[:, keys],
                out[:, rows],
                lse[:, :, rows].contiguous(),
                *flash_mask(b.band, b.q_end - b.q_start, b.k_end - b.k_start),
                scale,
            )
            dq[:, rows] = g[0]
            dk[:, keys] += g[1]
            dv[:, keys] += g[2]
        return dq, dk, dv
