"""CPU kernels for PyTorch's cuDNN attention ops, so that the torch_cudnn kernel runs on CPU (tests, dry runs).

    with torch_cudnn_on_cpu() as launches:      # TorchCudnnKernel on CPU tensors; launches counts each op
        ...

:func:`torch_cudnn_on_cpu` registers CPU kernels for ``aten::_cudnn_attention_forward`` and
``aten::_cudnn_attention_backward`` (the real schemas, through the real dispatcher), computing what PyTorch's CUDA
code computes (``aten/src/ATen/native/transformers/cuda/attention.cu``, ``attention_backward.cu`` and the graphs of
``aten/src/ATen/native/cudnn/MHA.cpp``) and refusing what that code does not define:

    dense (cum_seq None)  q/k/v 4-D [b, h, s, d]; out in q's stride order, lse [b, h, s_q, 1] fp32. The backward's
                          graph is built for (max_q, max_k), which must be q's and k's lengths, and takes out, dout
                          and lse in the layouts it infers from q (out/dout in q's stride order, each packed; lse
                          contiguous), q/k/v non-overlapping and dense (dq/dk/dv are ``empty_like`` them, written
                          with their strides)
    varlen (cum_seq)      q/k/v THD [total, h, d], int32 cum_seq of b + 1 entries; out [total_q, h, dv],
                          lse [total_q, h, 1]. A sequence longer than the graph's s_q / s_kv is refused: the
                          forward builds it for (max_q, max_k), the backward for (query.size(2), key.size(2))
    both                  fp16/bf16, K/V heads dividing the query heads, head dims multiples of 8 and at most 256,
                          is_causal aligned top-left (per sequence in varlen); no attn_bias or dropout (not emulated)

The math is torch's CPU flash kernel (:class:`~megatron_2d.kernels.cpu_flash.CpuFlashKernel`, V padded to q's head
dim) with the top-left causal band ``Band(None, 0)`` or none.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import _disable_current_modes

from megatron_2d.kernels.cpu_flash import CpuFlashKernel
from megatron_2d.kernels.torch_cudnn import TorchCudnnKernel
from megatron_2d.kernels.torch_math import TorchMathKernel
from megatron_2d.layout.band import Band

from .torch_flash_cpu import kernel_on_cpu


def _math(query, value):
    """torch's CPU flash kernel for these head dims (V zero-padded to q's head dim, exact), or explicit scores when
    V's is the larger."""
    dk, dv = query.shape[-1], value.shape[-1]
    return TorchMathKernel() if dv > dk else CpuFlashKernel().for_head_dims(dk, dv)


def _check(query, key, value, heads_dim: int) -> None:
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"cuDNN SDPA takes fp16 or bf16, got {query.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError("cuDNN SDPA: query, key and value must share their dtype")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.shape[-1] % 8 or x.shape[-1] > 256:
            raise RuntimeError(f"cuDNN SDPA: {name} head dim {x.shape[-1]} is not a multiple of 8 at most 256")
    if query.shape[heads_dim] % key.shape[heads_dim] or key.shape[heads_dim] != value.shape[heads_dim]:
        raise RuntimeError("cuDNN SDPA: K/V heads must divide the query heads")


def _refuse(attn_bias, dropout_p) -> None:
    if attn_bias is not None or dropout_p:
        raise NotImplementedError("CPU stand-in of cuDNN SDPA: attn_bias and dropout are not emulated")


def _band(is_causal: bool) -> Band | None:
    return Band(None, 0) if is_causal else None  # cuDNN's causal mask: top-left


def _packed_strides(sizes, order_of) -> tuple[int, ...]:
    """Strides of a tensor of ``sizes`` packed in the stride order of ``order_of`` (MHA.cpp's matching layout)."""
    order = sorted(range(len(sizes)), key=lambda d: order_of.stride(d))
    strides, step = [0] * len(sizes), 1
    for d in order:
        strides[d] = step
        step *= sizes[d]
    return tuple(strides)


def _same_layout(x: torch.Tensor, strides) -> bool:
    return all(s == t for n, s, t in zip(x.shape, x.stride(), strides) if n > 1)


def _sequences(cum_seq) -> list[slice]:
    c = cum_seq.tolist()  # host read: this stand-in's own (cuDNN reads them on the device)
    return [slice(c[i], c[i + 1]) for i in range(len(c) - 1)]


def _check_varlen(query, key, cum_seq_q, cum_seq_k, s_q: int, s_kv: int, which: str):
    if query.dim() != 3 or key.dim() != 3:
        raise RuntimeError("cuDNN SDPA varlen: q/k/v must be THD [total, h, d]")
    if cum_seq_k is None or cum_seq_q.dtype != torch.int32 or cum_seq_k.dtype != torch.int32:
        raise RuntimeError("cuDNN SDPA varlen: cum_seq_q and cum_seq_k must both be int32")
    if cum_seq_q.numel() != cum_seq_k.numel() or cum_seq_q.numel() < 2:
        raise RuntimeError("cuDNN SDPA varlen: cum_seq_q and cum_seq_k need the same b + 1 >= 2 entries")
    rows, keys = _sequences(cum_seq_q), _sequences(cum_seq_k)
    longest_q, longest_k = max(r.stop - r.start for r in rows), max(r.stop - r.start for r in keys)
    if longest_q > s_q or longest_k > s_kv:
        raise RuntimeError(
            f"cuDNN SDPA varlen {which}: the graph is built for sequences of at most {s_q} queries and {s_kv} keys "
            f"(attention{'_backward' if which == 'backward' else ''}.cu), got {longest_q} and {longest_k}"
        )
    return rows, keys


def _forward(
    query,
    key,
    value,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    _refuse(attn_bias, dropout_p)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        if cum_seq_q is None:  # dense: [b, h, s, d]
            _check(query, key, value, 1)
            if query.dim() != 4:
                raise RuntimeError("cuDNN SDPA dense: q/k/v must be [b, h, s, d]")
            out, lse = _math(query, value).forward(
                *(x.transpose(1, 2) for x in (query, key, value)), _band(is_causal), scale
            )
            b, h, sq, dv = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
            o = torch.empty_strided((b, h, sq, dv), _packed_strides((b, h, sq, dv), query), dtype=query.dtype)
            o.copy_(out.transpose(1, 2))
            stats = lse.float().reshape(b, h, sq, 1).contiguous()
            cum_q = cum_k = None
        else:
            _check(query, key, value, 1)
            rows, keys = _check_varlen(query, key, cum_seq_q, cum_seq_k, int(max_q), int(max_k), "forward")
            o = query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))
            stats = torch.empty(query.shape[0], query.shape[1], 1)
            for rq, rk in zip(rows, keys):
                out, lse = _math(query, value).forward(
                    query[rq][None], key[rk][None], value[rk][None], _band(is_causal), scale
                )
                o[rq], stats[rq, :, 0] = out[0], lse[0].float().t()
            cum_q, cum_k = cum_seq_q, cum_seq_k
        seed = offset = torch.zeros((), dtype=torch.int64)
        return o, stats, cum_q, cum_k, int(max_q), int(max_k), seed, offset, None


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    _refuse(attn_bias, dropout_p)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        if cum_seq_q is None:
            _check(query, key, value, 1)
            b, h, sq, _ = query.shape
            if (int(max_q), int(max_k)) != (sq, key.shape[2]):
                raise RuntimeError(
                    f"cuDNN SDPA dense backward: the graph is built for (max_q, max_k) = {(max_q, max_k)}, but q and k "
                    f"hold {sq} and {key.shape[2]} tokens"
                )
            for name, x in (("query", query), ("key", key), ("value", value)):
                if not is_non_overlapping_and_dense_or_false(x):
                    raise RuntimeError(f"cuDNN SDPA dense backward: {name} is not dense (d{name[0]} takes its strides)")
            for name, x in (("out", out), ("grad_out", grad_out)):
                if not _same_layout(x, _packed_strides(tuple(x.shape), query)):
                    raise RuntimeError(f"cuDNN SDPA dense backward: {name} is not in q's layout {x.stride()}")
            if logsumexp.numel() != b * h * sq or not logsumexp.is_contiguous() or logsumexp.dtype != torch.float32:
                raise RuntimeError(
                    f"cuDNN SDPA dense backward: logsumexp must be contiguous fp32 [b, h, s_q, 1], got "
                    f"{tuple(logsumexp.shape)} {logsumexp.dtype}"
                )
            grads = _math(query, value).backward(
                *(x.transpose(1, 2) for x in (grad_out, query, key, value, out)),
                logsumexp.reshape(b, h, sq),
                _band(is_causal),
                scale,
            )
            return tuple(torch.empty_like(x).copy_(g.transpose(1, 2)) for x, g in zip((query, key, value), grads))
        _check(query, key, value, 1)
        rows, keys = _check_varlen(query, key, cum_seq_q, cum_seq_k, query.shape[2], key.shape[2], "backward")
        if logsumexp.shape[:2] != query.shape[:2] or not logsumexp.is_contiguous():
            raise RuntimeError(
                f"cuDNN SDPA varlen backward: logsumexp must be contiguous [total_q, h, 1], got "
                f"{tuple(logsumexp.shape)}"
            )
        dq, dk, dv = (torch.empty_like(x) for x in (query, key, value))
        for rq, rk in zip(rows, keys):
            g = _math(query, value).backward(
                *(x[r][None] for x, r in ((grad_out, rq), (query, rq), (key, rk), (value, rk), (out, rq))),
                logsumexp[rq, :, 0].t()[None].contiguous(),
                _band(is_causal),
                scale,
            )
            dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


@contextlib.contextmanager
def torch_cudnn_on_cpu() -> Iterator[collections.Counter]:
    """CPU kernels for PyTorch's cuDNN attention ops and TorchCudnnKernel accepting CPU, for the duration; yields a
    Counter of launches: "dense forward", "varlen forward", "dense backward", "varlen backward"."""
    launches: collections.Counter = collections.Counter()

    def counted(name, fn):
        def kernel(*args, **kwargs):
            launches[f"{'dense' if args[4 if name == 'forward' else 9] is None else 'varlen'} {name}"] += 1
            return fn(*args, **kwargs)

        return kernel

    library = torch.library.Library("aten", "IMPL")
    library.impl("_cudnn_attention_forward", counted("forward", _forward), "CPU")
    library.impl("_cudnn_attention_backward", counted("backward", _backward), "CPU")
    try:
        with kernel_on_cpu(TorchCudnnKernel):
            yield launches
    finally:
        library._destroy()
