"""Run the CUDA-only block kernels on CPU, for tests and ``tools/gpu_smoke.py --dry-run`` (never at import).

    with torch_flash_on_cpu():          # TorchFlashKernel on CPU tensors
        ...
    with kernel_on_cpu(FlashAttn2Kernel):   # after flash_attn_package.load_release(...)
        ...

:func:`torch_flash_on_cpu` registers CPU kernels for ``aten::_flash_attention_forward`` and its backward (the real
schemas, through the real dispatcher), computed as PyTorch's copy of flash-attn's C++ computes them
(``aten/src/ATen/native/transformers/cuda/attention.cu`` and ``flash_attn/flash_api.cpp``): a window side passed as
None is -1; dense calls (cum_seq None) go to ``mha_fwd`` / ``mha_bwd``, whose window is normalised against s_k,
varlen calls to ``mha_varlen_fwd`` / ``mha_varlen_bwd``, normalised against max_k
(:func:`megatron_2d_dev.flash_attn_cpu.kernel_window`, the rule shared with the flash-attn releases' CPU
extension); masks align bottom-right on each sequence's own lengths, K/V heads serve query-head groups, lse is fp32
([b, h, s_q] dense, [h, total_q] varlen) and +inf on a row that sees no key. Its checks are the CUDA code's: fp16/bf16,
head dim a multiple of 8 and at most 256, K/V heads dividing the query heads, int32 cum_seq. The math is that of
the flash-attn stand-in (:func:`~megatron_2d_dev.flash_attn_cpu.flash_forward` / ``flash_backward``). Both
contexts also let the kernel class accept CPU devices.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from megatron_2d.kernels.torch_flash import TorchFlashKernel

from .flash_attn_cpu import flash_backward, flash_forward, kernel_window

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check(query, key, value, cum_seq_q, cum_seq_k) -> None:
    if query.dtype not in _FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError("query and key must have the same dtype")
    d = query.shape[-1]
    if d % 8:
        raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!")
    if d > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if query.shape[-2] % key.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if (cum_seq_q is None) != (cum_seq_k is None):
        raise RuntimeError("cum_seq_q and cum_seq_k must both be given (varlen) or both be None (dense)")
    if cum_seq_q is not None:
        if cum_seq_q.dtype != torch.int32 or cum_seq_k.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        if cum_seq_q.numel() < 2:
            raise RuntimeError("batch size must be positive")


def _window(is_causal, window_size_left, window_size_right, seqlen_k) -> tuple[bool, int, int]:
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    return kernel_window(bool(is_causal), left, right, int(seqlen_k))


def _sequences(cum_seq_q, cum_seq_k) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence of a varlen call (host reads: this stand-in's own)."""
    cq, ck = cum_seq_q.tolist(), cum_seq_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    _check(query, key, value, cum_seq_q, cum_seq_k)
    if dropout_p or return_debug_mask or seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("CPU stand-in: dropout, debug mask, seqused_k, ALiBi and paged K/V are not emulated")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch._C.DisableTorchFunction(), _disable_current_modes():  # compiled code to its callers
        if cum_seq_q is None:  # mha_fwd
            causal, left, right = _window(is_causal, window_size_left, window_size_right, key.shape[1])
            out, lse = flash_forward(query, key, value, scale, causal, left, right, 0.0)
        else:  # mha_varlen_fwd: one window for the call, normalised against max_k
            causal, left, right = _window(is_causal, window_size_left, window_size_right, max_k)
            out, lse = torch.empty_like(query), torch.empty(query.shape[1], query.shape[0])
            for rq, rk in _sequences(cum_seq_q, cum_seq_k):
                o, s = flash_forward(
                    *(x[r].unsqueeze(0) for x, r in ((query, rq), (key, rk), (value, rk))),
                    scale,
                    causal,
                    left,
                    right,
                    0.0,
                )
                out[rq], lse[:, rq] = o[0], s[0]
        rng_state = torch.zeros(2, dtype=torch.uint64)
        return out, lse.contiguous(), rng_state, torch.zeros((), dtype=torch.uint64), query.new_empty(0)


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    _check(query, key, value, cum_seq_q, cum_seq_k)
    if dropout_p:
        raise NotImplementedError("CPU stand-in: dropout is not emulated")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        if cum_seq_q is None:  # mha_bwd
            if logsumexp.shape != (query.shape[0], query.shape[2], query.shape[1]):
                raise RuntimeError(
                    f"logsumexp {tuple(logsumexp.shape)} is not [b, h, s_q] of query {tuple(query.shape)}"
                )
            causal, left, right = _window(is_causal, window_size_left, window_size_right, key.shape[1])
            return flash_backward(grad_out, query, key, value, out, logsumexp, scale, causal, left, right, 0.0)
        causal, left, right = _window(is_causal, window_size_left, window_size_right, max_k)  # mha_varlen_bwd
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for rq, rk in _sequences(cum_seq_q, cum_seq_k):
            g = flash_backward(
                *(x[r].unsqueeze(0) for x, r in ((grad_out, rq), (query, rq), (key, rk), (value, rk), (out, rq))),
                logsumexp[:, rq].unsqueeze(0).contiguous(),
                scale,
                causal,
                left,
                right,
                0.0,
            )
            dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


@contextlib.contextmanager
def kernel_on_cpu(kernel_class, dtypes=_FLASH_DTYPES) -> Iterator[None]:
    """Let ``kernel_class`` accept CPU devices (with ``dtypes``) as it accepts CUDA, for the duration."""
    original = kernel_class.supports
    kernel_class.supports = lambda self, device, dtype: device.type in ("cpu", "cuda") and dtype in dtypes
    try:
        yield
    finally:
        kernel_class.supports = original


@contextlib.contextmanager
def torch_flash_on_cpu() -> Iterator[collections.Counter]:
    """CPU kernels for PyTorch's CUDA flash ops, and TorchFlashKernel accepting CPU, for the duration; yields a
    Counter of the launches of each op ("forward", "backward")."""
    launches: collections.Counter = collections.Counter()

    def counted(name, fn):
        def kernel(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)

        return kernel

    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", counted("forward", _forward), "CPU")
    library.impl("_flash_attention_backward", counted("backward", _backward), "CPU")
    try:
        with kernel_on_cpu(TorchFlashKernel):
            yield launches
    finally:
        library._destroy()
