"""Run the CUDA-only block kernels on CPU, for tests and ``tools/gpu_smoke.py --dry-run`` (never at import).

    with torch_flash_on_cpu():          # TorchFlashKernel on CPU tensors
        ...
    with kernel_on_cpu(FlashAttn2Kernel):   # after flash_attn_package.load_release(...)
        ...

:func:`torch_flash_on_cpu` registers CPU kernels for ``aten::_scaled_dot_product_flash_attention`` and its backward
(the real schemas, through the real dispatcher) computed by torch's CPU flash kernel, with the CUDA kernel's
checks (fp16/bf16, head dim a multiple of 8 and at most 256) and its outputs (lse fp32 [b, h, s], placeholders for
cum_seq / philox). ``is_causal`` on a non-square block is refused (the CUDA kernel would align it bottom-right; the
torch_flash kernel never asks for it). Both contexts also let the kernel class accept CPU devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..kernels.torch_flash import TorchFlashKernel

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check(query, key, is_causal) -> None:
    if query.dtype not in _FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    d = query.shape[-1]
    if d % 8 or d > 256:
        raise RuntimeError(f"head dim {d}: the flash kernel takes a multiple of 8, at most 256")
    if query.shape[1] % key.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if is_causal and query.shape[2] != key.shape[2]:
        raise NotImplementedError("CPU stand-in: is_causal on a non-square block is not emulated")


def _forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _check(query, key, is_causal)
    if dropout_p or return_debug_mask:
        raise NotImplementedError("CPU stand-in: dropout and the debug mask are not emulated")
    rep = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(rep, dim=1) for x in (key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    empty = query.new_empty(0, dtype=torch.int32)
    return (
        out,
        lse.float(),
        empty,
        empty.clone(),
        query.shape[2],
        key.shape[2],
        query.new_zeros(2, dtype=torch.int64),
        query.new_empty(0, dtype=torch.int64),
        query.new_empty(0),
    )


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
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    _check(query, key, is_causal)
    if (max_q, max_k) != (query.shape[2], key.shape[2]):
        raise RuntimeError(
            f"max_q/max_k {(max_q, max_k)} differ from the sequence lengths {(query.shape[2], key.shape[2])}"
        )
    hkv, rep = key.shape[1], query.shape[1] // key.shape[1]
    key_rep, value_rep = (x.repeat_interleave(rep, dim=1) for x in (key, value))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key_rep, value_rep, out, logsumexp, 0.0, is_causal, scale=scale
    )
    b, _, sk, d = dk.shape
    return dq, dk.view(b, hkv, rep, sk, d).sum(2), dv.view(b, hkv, rep, sk, d).sum(2)


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
def torch_flash_on_cpu() -> Iterator[None]:
    """CPU kernels for PyTorch's CUDA flash ops, and TorchFlashKernel accepting CPU, for the duration."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", _forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", _backward, "CPU")
    try:
        with kernel_on_cpu(TorchFlashKernel):
            yield
    finally:
        library._destroy()
