"""PyTorch's cuDNN fused attention on CUDA (fp16/bf16): cuDNN's Hopper and Blackwell kernels without TE.

``torch.ops.aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` (``aten/src/ATen/native/transformers/
cuda/attention.cu``, ``attention_backward.cu``, graphs in ``aten/src/ATen/native/cudnn/MHA.cpp``), as this kernel
calls them:

    dense    q/k/v [b, h, s, d] (our [b, s, h, d] transposed: cuDNN takes the strides), K/V heads serving query-head
             groups (GQA), d_qk != d_v allowed; out in q's layout, lse [b, h, s_q, 1] fp32; is_causal is cuDNN's
             causal mask, aligned top-left (``set_causal_mask``), so it is only passed on square pieces, where
             every alignment agrees. The backward builds its graph for s_q = max_q, s_kv = max_k, and infers the
             layouts of out, dout and lse from q's (contiguous [b, h, s_q, 1] for lse): every tensor goes in
             contiguous.
    varlen   cum_seq_q / cum_seq_k given (int32, on the device): q/k/v THD [total, h, d], out [total_q, h, dv],
             lse [total_q, h, 1]; causal per sequence, top-left. The backward builds its graph for
             s_q = query.size(2), s_kv = key.size(2) (not max_q / max_k), so a sequence longer than the head dim
             is outside it: pieces that long run their backward dense (:meth:`varlen_backward_limit`).

No sliding window is exposed by these ops (attn_bias would be a materialised [s_q, s_k] mask that skips no work), so
a band runs as the pieces of :mod:`megatron_2d.kernels.pieces`, batched into varlen launches
(:mod:`megatron_2d.kernels.piece_kernel`). Head dims: a multiple of 8, at most 128 before Hopper and 256 from sm90
(cuDNN's support matrix for the backward). The ops' schemas, and cuDNN >= 9.0 on CUDA, are checked when the kernel
is built.
"""

from __future__ import annotations

import torch

from ..layout.choices import Kernel
from .base import KERNELS
from .piece_kernel import PieceKernel

FORWARD_ARGS = (
    "query",
    "key",
    "value",
    "attn_bias",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "compute_log_sumexp",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
    "scale",
)
BACKWARD_ARGS = (
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "philox_seed",
    "philox_offset",
    "attn_bias",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "scale",
)


def _ops():
    return torch.ops.aten._cudnn_attention_forward.default, torch.ops.aten._cudnn_attention_backward.default


MIN_CUDNN = 90000
"""cuDNN 9.0: the first with SDPA training on Hopper (and the ragged layouts the varlen launches use)."""


def check_cudnn() -> None:
    """Refuse a CUDA PyTorch without cuDNN 9 (its attention ops would fail at the first call)."""
    if not torch.cuda.is_available():
        return  # CPU: the stand-in (megatron_2d_dev.torch_cudnn_cpu) plays the ops
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < MIN_CUDNN:
        raise ImportError(f"PyTorch's cuDNN attention needs cuDNN >= 9.0; this torch {torch.__version__} has {version}")


def check_schemas() -> None:
    """Refuse a PyTorch whose cuDNN attention ops lack an argument this kernel passes (by name and position)."""
    for op, expected in zip(_ops(), (FORWARD_ARGS, BACKWARD_ARGS)):
        names = tuple(a.name for a in op._schema.arguments)
        if names[: len(expected)] != expected:
            raise ImportError(
                f"torch {torch.__version__}: {op._schema.name} takes {names}, the torch_cudnn kernel passes {expected}"
            )


def max_head_dim(capability: tuple[int, int]) -> int:
    """cuDNN's largest training head dim on a device of ``capability`` (support matrix, backward column)."""
    return 256 if capability >= (9, 0) else 128


def device_capability() -> tuple[int, int]:
    """The current CUDA device's compute capability; (9, 0) without CUDA (the CPU stand-in plays a Hopper)."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else (9, 0)


def cudnn_head_dim_problem(head_dim: int, capability: tuple[int, int]) -> str | None:
    """Why cuDNN's fused attention cannot train with ``head_dim`` on ``capability`` (None if it can)."""
    limit = max_head_dim(capability)
    if head_dim % 8 == 0 and 0 < head_dim <= limit:
        return None
    return (
        f"head dim {head_dim} is not supported by cuDNN's fused attention on sm{capability[0]}{capability[1]} "
        f"(a multiple of 8, at most {limit})"
    )


@KERNELS.register
class TorchCudnnKernel(PieceKernel):
    """``aten::_cudnn_attention_forward`` / ``_backward``: dense launches, and varlen ones for pieces."""

    name = Kernel.TORCH_CUDNN

    def __init__(self) -> None:
        check_schemas()
        check_cudnn()
        super().__init__()
        self._philox: dict = {}  # device -> (seed, offset): read by the backward only with dropout

    def head_dim_problem(self, head_dim: int) -> str | None:
        return cudnn_head_dim_problem(head_dim, device_capability())

    def varlen_backward_limit(self, head_dim: int) -> int | None:
        return head_dim

    def _rng(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._philox:
            self._philox[device] = (torch.empty((), dtype=torch.int64, device=device),) * 2
        return self._philox[device]

    def dense_forward(self, q, k, v, causal, scale):
        forward, _ = _ops()
        b, sq, h = q.shape[:3]
        out, lse = forward(
            *(x.transpose(1, 2) for x in (q, k, v)),
            None,
            None,
            None,
            sq,
            k.shape[1],
            True,
            0.0,
            causal,
            False,
            scale=scale,
        )[:2]  # out [b, h, s_q, dv] in q's layout, lse [b, h, s_q, 1]
        return out.transpose(1, 2), lse.view(b, h, sq)

    def dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        _, backward = _ops()
        grads = backward(
            *(x.transpose(1, 2) for x in (dout, q, k, v, out)),
            lse.unsqueeze(-1),  # [b, h, s_q, 1]
            *self._rng(q.device),
            None,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            scale=scale,
        )
        return tuple(g.transpose(1, 2) for g in grads)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        forward, _ = _ops()
        out, lse = forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.view(q.shape[0], q.shape[1]).t()  # lse [total_q, h, 1] -> [h, total_q]

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        _, backward = _ops()
        return backward(
            dout,
            q,
            k,
            v,
            out,
            lse.t().contiguous().unsqueeze(-1),  # [h, total_q] -> [total_q, h, 1]
            *self._rng(q.device),
            None,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            scale=scale,
        )
