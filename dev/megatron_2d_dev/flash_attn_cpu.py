"""A CPU stand-in for flash-attn 2's Python API, so that code written against flash-attn runs on CPU ranks.

Its users: ring-flash-attn's rings in the benchmarks (tools/bench_compare.py, tools/bench_packed.py):
ring-flash-attn 0.1.8 imports ``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``
and calls them by keyword, introspecting their signature; the benchmarks also run it in fp32/fp64, which the real
package refuses. And yunchang's USP in tools/bench_compare.py, which picks the call convention by
``flash_attn.__version__``: installed for it with ``version=FLASH_ATTN_2_7_VERSION``.
:func:`flash_attn_stand_in` installs it. Our own flash_attn2 kernel is tested through the REAL
flash-attn releases instead (:mod:`megatron_2d_dev.flash_attn_package`, tests/test_flash_attn_releases.py);
the math below is shared with that package's CPU extension.

What it reproduces (read from flash-attn's flash_attn/flash_attn_interface.py and its docstrings):
    * layouts: q, out, dout, dq [b, s_q, h_q, d]; k, v, dk, dv [b, s_k, h_kv, d], h_kv dividing h_q (query head j
      uses K/V head j // (h_q / h_kv)); varlen: [total, h, d] with int32 ``cu_seqlens`` of batch + 1 entries;
    * softmax_lse: fp32, natural log of the row sums of exp(scaled scores); [b, h_q, s_q] for the padded functions,
      [h_q, total_q] for the varlen ones; a row with no visible key gets out = 0 and lse = +inf (so that the
      backward's exp(s - lse) is 0 there);
    * softmax_d returned by the private backward: rowsum(dout * out), fp32, [b, h_q, round_up(s_q, 128)] (padded)
      or [h_q, total_q + 128 * b] (varlen), the padding left at 0;
    * masks: ``causal`` aligned to the BOTTOM-RIGHT corner; ``window_size`` = (left, right), -1 meaning unbounded:
      query i sees keys j with i + s_k - s_q - left <= j <= i + s_k - s_q + right; causal forces right = 0;
    * ``softcap`` > 0: scores become softcap * tanh(scale * q.k / softcap) (and lse is of those);
    * ``softmax_scale`` None means 1/sqrt(d); ``flash_attn_func(..., return_attn_probs=True)`` returns
      (out, softmax_lse, S_dmask) with S_dmask an empty tensor when dropout is 0;
    * only fp16 and bf16 (flash-attn refuses anything else), unless the module is built with strict_dtypes=False
      (the benchmarks and ring-flash-attn's own tests run it in fp32/fp64 too);
    * the private backward writes dq, dk, dv in place (views allowed).

The API is flash-attn 2.7's (torch custom ops there): private functions with window_size_left / window_size_right
ints; forward returns (out_padded, softmax_lse, S_dmask, rng_state), backward returns softmax_d; varlen functions.

Not implemented (raise NotImplementedError): dropout, ALiBi, paged K/V (block_table), the kv-cache functions.

    with flash_attn_stand_in():
        zigzag = load_ring_flash_attn_module("zigzag_ring_flash_attn")
    out = zigzag.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch

from megatron_2d.kernels import CpuFlashKernel
from megatron_2d.kernels.base import repeat_kv_heads, sum_kv_head_groups
from megatron_2d.layout.band import Band

_KERNEL = CpuFlashKernel()
_PRIVATE_PACKAGE = "_ring_flash_attn_core"
STAND_IN_VERSION = "0.0.0+megatron_2d.cpu_stand_in"
FLASH_ATTN_2_7_VERSION = "2.7.4.post1+megatron_2d.cpu_stand_in"
"""A ``__version__`` for callers that pick flash-attn's call convention by version: yunchang 0.6.4 compares
``flash_attn.__version__ < '2.6.3'`` and calls the pre-2.6.3 API below it; the stand-in's API is 2.7's."""
STAND_IN_MARK = "_megatron_2d_cpu_stand_in"
_UNBOUNDED = (-1, -1)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _refuse_unsupported(dropout_p, alibi_slopes) -> None:
    """Raise NotImplementedError naming the first option this stand-in does not implement."""
    if dropout_p:
        raise NotImplementedError(f"CPU flash_attn stand-in: dropout_p={dropout_p} (only 0 is supported)")
    if alibi_slopes is not None:
        raise NotImplementedError("CPU flash_attn stand-in: alibi_slopes are not supported")


def _check_dtypes(strict: bool, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"CPU flash_attn stand-in: q, k, v must share a dtype, got {sorted(map(str, dtypes))}")
    if strict and tensors[0].dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type (CPU stand-in of flash-attn 2)")


def kernel_window(causal: bool, left: int, right: int, seqlen_k: int) -> tuple[bool, int, int]:
    """(causal, left, right) as flash-attn's C++ hands a mask to its CUDA kernels: ``csrc/flash_attn/flash_api.cpp``
    of flash-attn 2.5.8, 2.6.3, 2.7.4.post1 and 2.8.3, and PyTorch's copy
    (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``), read there:

        mha_fwd, mha_bwd                  window_size_left/right >= seqlen_k become -1; is_causal sets right = 0
        mha_varlen_fwd, mha_varlen_bwd    the same against max_seqlen_k (the call's argument, not each sequence's)
        set_params_fprop (both)           is_causal = left < 0 && right == 0; then a side < 0 becomes seqlen_k
                                          (varlen: max_seqlen_k) when the other side is >= 0

    ``seqlen_k``: the block's key count, or a varlen call's max_seqlen_k. Returned as :func:`flash_forward` takes
    it: (True, -1, -1) for the causal mask, (False, -1, -1) for none, else (False, left, right), both >= 0 (the
    kernels' local mask, on each sequence's own lengths). mha_fwd's ``seqlen_q == 1`` turns causal off, which
    changes no mask of one query row, so it is left out."""
    left = -1 if left >= seqlen_k else left
    right = 0 if causal else (-1 if right >= seqlen_k else right)
    if left < 0 and right == 0:
        return True, -1, -1
    if left < 0 and right < 0:
        return False, -1, -1
    return False, seqlen_k if left < 0 else left, seqlen_k if right < 0 else right


def _visible(s_q: int, s_k: int, causal: bool, left: int, right: int, device) -> torch.Tensor | None:
    """[s_q, s_k] bool mask of visible keys (None: all), flash-attn's bottom-right aligned convention."""
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = torch.arange(s_q, device=device).unsqueeze(1) + (s_k - s_q)  # query i's aligned key position
    j = torch.arange(s_k, device=device).unsqueeze(0)
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


FAST_BACKWARD_PAIRS = 128 * 128
"""The (query, key) pairs from which the backward takes torch's CPU flash kernel too (below, its fixed cost is
more than the einsum's: docs/testing.md)."""


def _fast_path(q, k, causal, left, right, softcap, backward: bool = False) -> bool:
    """torch's CPU flash kernel does plain (or top-left causal) attention: use it where that is the same thing
    (the backward on blocks of :data:`FAST_BACKWARD_PAIRS` pairs or more)."""
    plain = softcap == 0.0 and (left, right) == _UNBOUNDED and (not causal or q.shape[1] == k.shape[1])
    return plain and (not backward or q.shape[1] * k.shape[1] >= FAST_BACKWARD_PAIRS)


def _scores(q, k, scale, softcap, mask):
    """Scaled (and soft-capped) scores [b, h, s_q, s_k] in fp32 (fp64 for fp64 inputs), hidden keys at -inf."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[2] // k.shape[2]
    k = k.to(acc).repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def flash_forward(q, k, v, scale, causal, left, right, softcap):
    """(out [b, s_q, h, d] in q's dtype, lse [b, h, s_q] fp32)."""
    if _fast_path(q, k, causal, left, right, softcap):
        out, lse = _KERNEL.forward(q, k, v, Band(None, 0) if causal else None, scale)
        return out, lse.float()  # flash-attn's lse is fp32 always
    s = _scores(q, k, scale, softcap, _visible(q.shape[1], k.shape[1], causal, left, right, q.device))
    lse = torch.logsumexp(s, dim=-1)  # -inf for empty rows
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # empty rows: 0
    rep = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype).repeat_interleave(rep, dim=2))
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash-attn: +inf for empty rows
    return out.to(q.dtype), lse.float()


def flash_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap):
    """(dq, dk, dv) in the inputs' dtype, from the final out and lse (flash-attn recomputes P from lse), in closed
    form: no autograd, so that it also runs inside a torch custom op's kernel, where autograd is off."""
    if _fast_path(q, k, causal, left, right, softcap, backward=True):
        return _KERNEL.backward(dout, q, k, v, out, lse, Band(None, 0) if causal else None, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[2], k.shape[2]
    s = _scores(q, k, scale, softcap, _visible(q.shape[1], k.shape[1], causal, left, right, q.device))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # [b, h, s_q, s_k]; lse = +inf rows: 0
    do, k_rep, v_rep = dout.to(acc), repeat_kv_heads(k.to(acc), hq), repeat_kv_heads(v.to(acc), hq)
    # the softmax's own gradient uses rowsum(dout * out) with the FINAL out, as flash-attn's backward does
    delta = (do * out.to(acc)).sum(-1).transpose(1, 2).unsqueeze(-1)  # [b, h, s_q, 1]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v_rep) - delta)  # d(loss)/d(scores)
    if softcap > 0:  # scores = softcap * tanh(raw / softcap)
        ds = ds * (1 - (s.masked_fill(torch.isneginf(s), 0.0) / softcap) ** 2)
    ds = ds * scale  # raw = scale * q.k
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep)
    dk = sum_kv_head_groups(torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc)), hkv)
    dv = sum_kv_head_groups(torch.einsum("bhqk,bqhd->bkhd", p, do), hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _softmax_d(dout, out, padded_len: int):
    """rowsum(dout * out) [b, h, s] fp32, zero-padded to ``padded_len`` rows."""
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return torch.nn.functional.pad(d, (0, padded_len - d.shape[-1])).contiguous()


def _write_grads(dq, dk, dv, grads) -> None:
    if dq is None or dk is None or dv is None:
        raise ValueError("CPU flash_attn stand-in: dq, dk and dv output buffers are required")
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)


def _varlen_split(x, cu):
    """[total, h, d] -> list of [1, s_i, h, d] per sequence of ``cu_seqlens``."""
    cu = cu.tolist()
    return [x[a:b].unsqueeze(0) for a, b in zip(cu[:-1], cu[1:])]


def _build_api(strict_dtypes: bool) -> types.SimpleNamespace:
    """The stand-in's functions (see the module docstring)."""

    def scale_of(q, softmax_scale):
        return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)

    def fwd_core(q, k, v, dropout_p, softmax_scale, causal, left, right, softcap, alibi_slopes):
        _refuse_unsupported(dropout_p, alibi_slopes)
        _check_dtypes(strict_dtypes, q, k, v)
        out, lse = flash_forward(q, k, v, scale_of(q, softmax_scale), causal, left, right, softcap)
        return out.contiguous(), lse.contiguous()

    def bwd_core(
        dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, left, right, softcap, alibi_slopes
    ):
        _refuse_unsupported(dropout_p, alibi_slopes)
        _check_dtypes(strict_dtypes, q, k, v)
        grads = flash_backward(
            dout, q, k, v, out, lse.contiguous(), scale_of(q, softmax_scale), causal, left, right, softcap
        )
        _write_grads(dq, dk, dv, grads)
        return _softmax_d(dout, out, _round_up(q.shape[1], 128))

    def _flash_attn_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    ):
        out, lse = fwd_core(
            q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes
        )
        return out, lse, torch.empty((0,), dtype=q.dtype), None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    ):
        return bwd_core(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
        )

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
    ):
        if block_table is not None or leftpad_k is not None or seqused_k is not None:
            raise NotImplementedError("CPU flash_attn stand-in: block_table / leftpad_k / seqused_k")
        outs, lses = [], []
        for qi, ki, vi in zip(
            _varlen_split(q, cu_seqlens_q), _varlen_split(k, cu_seqlens_k), _varlen_split(v, cu_seqlens_k)
        ):
            o, l = fwd_core(
                qi, ki, vi, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes
            )
            outs.append(o[0])
            lses.append(l[0])  # [h, s_i]
        return (
            torch.cat(outs).contiguous(),
            torch.cat(lses, dim=1).contiguous(),
            torch.empty((0,), dtype=q.dtype),
            None,
        )

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    ):
        if dq is None or dk is None or dv is None:
            raise ValueError("CPU flash_attn stand-in: dq, dk and dv output buffers are required")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        ds = []
        for n in range(len(cq) - 1):
            rq, rk = slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])
            sub = [x[r].unsqueeze(0) for x, r in ((dout, rq), (q, rq), (k, rk), (v, rk), (out, rq))]
            lse = softmax_lse[:, rq].unsqueeze(0)
            d = bwd_core(
                *sub,
                lse,
                dq[rq].unsqueeze(0),
                dk[rk].unsqueeze(0),
                dv[rk].unsqueeze(0),
                dropout_p,
                softmax_scale,
                causal,
                window_size_left,
                window_size_right,
                softcap,
                alibi_slopes,
            )
            ds.append(d[0, :, : cq[n + 1] - cq[n]])
        total = q.shape[0] + 128 * (len(cq) - 1)
        d = torch.cat(ds, dim=1)
        return torch.nn.functional.pad(d, (0, total - d.shape[1])).contiguous()

    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        return _public(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        out, lse, s_dmask, _ = _flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size[0],
            window_size[1],
            softcap,
            alibi_slopes,
            False,
            block_table,
        )
        return (out, lse, s_dmask) if return_attn_probs else out

    def _public(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs):
        """flash_attn_func's forward (no autograd here: the wrapper under test calls the backward itself)."""
        out, lse = fwd_core(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes
        )
        return (out, lse, torch.empty((0,), dtype=q.dtype)) if return_attn_probs else out

    ns = types.SimpleNamespace(
        flash_attn_func=flash_attn_func,
        flash_attn_varlen_func=flash_attn_varlen_func,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )
    ns._flash_attn_forward = _flash_attn_forward
    ns._flash_attn_backward = _flash_attn_backward
    return ns


def flash_attn_modules(
    strict_dtypes: bool = True, version: str = STAND_IN_VERSION
) -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh ``flash_attn`` and ``flash_attn.flash_attn_interface`` modules of the stand-in, for sys.modules;
    ``version`` is the package's ``__version__`` (e.g. :data:`FLASH_ATTN_2_7_VERSION`)."""
    api = _build_api(strict_dtypes)
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.__doc__ = "CPU stand-in of flash-attn's API (megatron_2d_dev.flash_attn_cpu); not flash-attn."
    for name, fn in vars(api).items():
        if callable(fn):
            setattr(interface, name, fn)
    package = types.ModuleType("flash_attn")
    package.__doc__ = interface.__doc__
    package.__path__ = []  # a package, so "import flash_attn.flash_attn_interface" resolves
    package.__version__ = version
    setattr(package, STAND_IN_MARK, True)
    package.flash_attn_interface = interface
    package.flash_attn_func = interface.flash_attn_func
    if hasattr(interface, "flash_attn_varlen_func"):
        package.flash_attn_varlen_func = interface.flash_attn_varlen_func
    return package, interface


# At module level, any float dtype: what ring-flash-attn (and its tests) call.
_CURRENT = _build_api(strict_dtypes=False)
_flash_attn_forward = _CURRENT._flash_attn_forward
_flash_attn_backward = _CURRENT._flash_attn_backward
_flash_attn_varlen_forward = _CURRENT._flash_attn_varlen_forward
_flash_attn_varlen_backward = _CURRENT._flash_attn_varlen_backward
flash_attn_func = _CURRENT.flash_attn_func
flash_attn_varlen_func = _CURRENT.flash_attn_varlen_func


def _stand_in_modules(version: str = STAND_IN_VERSION) -> tuple[types.ModuleType, types.ModuleType]:
    """The modules :func:`flash_attn_stand_in` installs: any float dtype, whose private functions are this
    module's own (so callers can check identity)."""
    package, interface = flash_attn_modules(strict_dtypes=False, version=version)
    for name in (
        "_flash_attn_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
        "flash_attn_func",
        "flash_attn_varlen_func",
    ):
        setattr(interface, name, globals()[name])
    return package, interface


def real_flash_attn_present() -> bool:
    """True when an installed flash_attn (not this stand-in) can be imported by name."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return not getattr(module, STAND_IN_MARK, False)
    return importlib.util.find_spec("flash_attn") is not None


def install_flash_attn_stand_in(version: str = STAND_IN_VERSION) -> bool:
    """Put the stand-in into ``sys.modules`` for the rest of this process; returns whether it was installed.
    ``version``: the package's ``__version__`` (see :data:`FLASH_ATTN_2_7_VERSION`).

    Does nothing (returns False) when the real flash_attn is importable or CUDA is available: on a GPU the real
    kernels must be used, never this one. Meant for forked benchmark ranks; tests prefer :func:`flash_attn_stand_in`.
    """
    if real_flash_attn_present() or torch.cuda.is_available():
        return False
    package, interface = _stand_in_modules(version)
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface
    return True


@contextlib.contextmanager
def flash_attn_stand_in(version: str = STAND_IN_VERSION) -> Iterator[bool]:
    """Install the stand-in for the duration of the block (see :func:`install_flash_attn_stand_in`, ``version``
    likewise); yields whether it was installed. Modules imported inside the block keep their references to the
    stand-in functions (and to the package, whose ``__version__`` they may read later)."""
    installed = install_flash_attn_stand_in(version)
    try:
        yield installed
    finally:
        if installed:
            sys.modules.pop("flash_attn.flash_attn_interface", None)
            sys.modules.pop("flash_attn", None)


def load_ring_flash_attn_module(name: str = "zigzag_ring_flash_attn") -> types.ModuleType:
    """Import one module of ring-flash-attn (e.g. ``zigzag_ring_flash_attn``) without its package ``__init__``.

    ring-flash-attn 0.1.8's ``__init__`` imports its HuggingFace adapter, which imports ``transformers``; the ring
    modules themselves need only torch, flash_attn's kernels and the package's ``utils``. The module is loaded
    under a private package name (``_ring_flash_attn_core``), so ``import ring_flash_attn`` elsewhere is unaffected.
    flash_attn (real, or the stand-in) must be importable while this runs. Raises ImportError naming the fix when
    ring-flash-attn is not installed.
    """
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "ring-flash-attn is not installed: pip install ring-flash-attn (it is listed in requirements-dev.txt)"
        )
    package: types.ModuleType | None = sys.modules.get(_PRIVATE_PACKAGE)
    if package is None:
        package = types.ModuleType(_PRIVATE_PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        package.__doc__ = "ring-flash-attn's ring modules, loaded without the package __init__ (see flash_attn_cpu)"
        sys.modules[_PRIVATE_PACKAGE] = package
    return importlib.import_module(f"{_PRIVATE_PACKAGE}.{name}")
