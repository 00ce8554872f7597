"""flash-attn 2 on CUDA (fp16/bf16), imported lazily; GQA handled natively by the kernel.

Forward: the public ``flash_attn_func`` / ``flash_attn_varlen_func`` (``return_attn_probs=True`` gives the lse).
Backward: the private ``_flash_attn_backward`` / ``_flash_attn_varlen_backward``, whose parameters moved across
releases (``window_size`` until 2.6, ``window_size_left/right`` from 2.7; ``softcap`` from 2.6) and which from 2.7
are ``torch.library`` custom ops: their own signature reads ``(*args, **kwargs)``, so the parameter names are read
from the function behind the op (``_init_fn``). A release whose backward needs a parameter this kernel does not
fill is refused when the kernel is built (at kernel selection), naming the release.

A call whose band flash-attn's C++ would run as another window (a block with more queries than keys) runs as the
boxes of :func:`megatron_2d.layout.band.flash_boxes` (:mod:`megatron_2d.kernels.flash_windows`), dense and varlen alike.

Many calls on one block (packed documents: one per pair of same-document runs) go to flash-attn's varlen kernel,
one launch per mask kind: the calls' query rows and key columns are gathered into packed [total, h, d] tensors
with ``cu_seqlens``, and the outputs / log-sum-exp / gradients are cut back per call. The index tensors of a block
are built on the host (numpy) and reach the device in one non-blocking copy from pinned memory: no host sync.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layout.choices import Kernel
from .base import KERNELS, to_device_once
from .flash_windows import FlashWindowKernel, flash_calls, flash_mask

_GROUP_CACHE = 256  # blocks whose varlen index tensors are kept (a packed batch has one per context rank)


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


def flash_attn_version() -> str:
    import flash_attn

    return str(getattr(flash_attn, "__version__", "unknown"))


def undecorated(fn):
    """The Python function behind a torch custom op (``CustomOpDef._init_fn``); ``fn`` itself otherwise."""
    return getattr(fn, "_init_fn", fn)


# What the kernel gives a private backward, by flash-attn's parameter names. The last group are features it keeps
# off (their neutral values); a release without such a parameter lacks the feature, so leaving it out loses nothing.
_MATH = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal")
_VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_WINDOW = ("window_size", "window_size_left", "window_size_right")
_NEUTRAL = {
    "dropout_p": 0.0,
    "softcap": 0.0,
    "alibi_slopes": None,
    "deterministic": False,
    "rng_state": None,
    "zero_tensors": False,
}


class PrivateBackward:
    """One of flash-attn's private backward functions, called by keyword with the installed release's names."""

    def __init__(self, interface, name: str, varlen: bool, version: str) -> None:
        self._fn = getattr(interface, name)
        params = inspect.signature(undecorated(self._fn)).parameters
        needed = _MATH + (_VARLEN if varlen else ())
        filled = set(needed) | set(_WINDOW) | set(_NEUTRAL)
        missing = [p for p in needed if p not in params]
        unknown = [p for p, spec in params.items() if p not in filled and spec.default is inspect.Parameter.empty]
        self._split_window = "window_size_left" in params and "window_size_right" in params
        if not self._split_window and "window_size" not in params:
            missing.append("window_size (or window_size_left/right)")
        if missing or unknown:
            raise ImportError(
                f"flash-attn {version}: {name}{inspect.signature(undecorated(self._fn))} "
                + (f"lacks {missing}" if missing else "")
                + (" and " if missing and unknown else "")
                + (f"needs {unknown}, which megatron_2d's flash_attn2 kernel does not fill" if unknown else "")
                + "; supported: flash-attn 2.5 to 2.8"
            )
        self._neutral = {p: v for p, v in _NEUTRAL.items() if p in params}

    def __call__(self, window: tuple[int, int], **values) -> None:
        """Run the backward (it writes dq, dk, dv in place); ``values`` holds every parameter in ``_MATH``
        (and ``_VARLEN`` for the varlen function)."""
        if self._split_window:
            values["window_size_left"], values["window_size_right"] = window
        else:
            values["window_size"] = window
        self._fn(**values, **self._neutral)


@dataclass(frozen=True)
class VarlenGroup:
    """Calls with one flash mask, batched into one varlen launch (index tensors built once per list of calls)."""

    calls: tuple[Any, ...]
    q_index: torch.Tensor  # [total_q] local query rows, call by call
    k_index: torch.Tensor  # [total_k] key columns of the block (from first_key), call by call
    cu_q: torch.Tensor  # [n + 1] int32
    cu_k: torch.Tensor
    q_offsets: tuple[int, ...]  # the same offsets as Python ints, to cut results
    k_offsets: tuple[int, ...]
    causal: bool
    window: tuple[int, int]

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.q_offsets[:-1], self.q_offsets[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.k_offsets[:-1], self.k_offsets[1:]))


def _ranges(starts: Sequence[int], ends: Sequence[int]) -> np.ndarray:
    """The concatenation of range(a, b) for each pair, as int64."""
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(starts, ends)])


def varlen_groups(calls: Sequence[Any], first_key: int, device) -> tuple[list[VarlenGroup], list[Any]]:
    """(varlen groups of two or more calls sharing a flash mask, the calls left to run alone). Every index tensor
    of the block comes from one host buffer in one copy (:func:`~megatron_2d.kernels.base.to_device_once`)."""
    by_mask: dict[tuple, list[Any]] = defaultdict(list)
    for call in calls:
        by_mask[flash_mask(call.band, call.q_end - call.q_start, call.k_end - call.k_start)].append(call)
    alone = [c for members in by_mask.values() if len(members) < 2 for c in members]
    batched = [(mask, members) for mask, members in by_mask.items() if len(members) >= 2]
    pieces, layout = [], []  # host arrays, and per group the lengths of its four pieces
    for _, members in batched:
        q_idx = _ranges([c.q_start for c in members], [c.q_end for c in members])
        k_idx = _ranges([c.k_start - first_key for c in members], [c.k_end - first_key for c in members])
        q_off = np.cumsum([0] + [c.q_end - c.q_start for c in members], dtype=np.int64)
        k_off = np.cumsum([0] + [c.k_end - c.k_start for c in members], dtype=np.int64)
        pieces += [q_idx, k_idx, q_off, k_off]
        layout.append((q_off, k_off))
    if not batched:
        return [], alone
    flat = to_device_once(np.concatenate(pieces), device)  # one host-to-device copy per block
    parts = iter(torch.split(flat, [len(p) for p in pieces]))
    groups = []
    for ((causal, window), members), (q_off, k_off) in zip(batched, layout):
        q_index, k_index, cu_q, cu_k = next(parts), next(parts), next(parts), next(parts)
        groups.append(
            VarlenGroup(
                tuple(members),
                q_index,
                k_index,
                cu_q.to(torch.int32),
                cu_k.to(torch.int32),
                tuple(q_off.tolist()),
                tuple(k_off.tolist()),
                causal,
                window,
            )
        )
    return groups, alone


def packed_lse(lse: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """Varlen log-sum-exp as [h, total_q]: flash-attn >= 2.6 returns that; older 2.x returned [n, h, max_seqlen]
    (each sequence padded), cut back to its rows here."""
    if lse.dim() == 2:
        return lse
    return torch.cat([lse[i, :, : b - a] for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))], dim=1)


def padded_lse(lse: torch.Tensor, offsets: Sequence[int], max_len: int) -> torch.Tensor:
    """[h, total_q] -> [n, h, max_seqlen] (the older varlen backward's layout), zero padded."""
    out = lse.new_zeros((len(offsets) - 1, lse.shape[0], max_len))
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        out[i, :, : b - a] = lse[:, a:b]
    return out


@KERNELS.register
class FlashAttn2Kernel(FlashWindowKernel):
    """flash-attn 2: forward through its public functions (returning lse), backward through its private ones.

    Bands become flash-attn's ``window_size`` (>= 2.3), split where it would not keep them. Calls must come trimmed
    (:meth:`megatron_2d.layout.band.Band.trim`): flash-attn returns lse = +inf for a row that sees no key, which the
    log-sum-exp merge would turn into NaN; trimmed calls have no such row.
    """

    name = Kernel.FLASH_ATTN2
    missing_package = "flash-attn is not installed"

    @classmethod
    def available(cls) -> bool:
        return flash_attn_available()

    def __init__(self) -> None:
        self._fa = _flash_attn_interface()
        self.version = flash_attn_version()
        self._backward = PrivateBackward(self._fa, "_flash_attn_backward", varlen=False, version=self.version)
        self._varlen = hasattr(self._fa, "flash_attn_varlen_func") and hasattr(self._fa, "_flash_attn_varlen_backward")
        self._varlen_backward = (
            PrivateBackward(self._fa, "_flash_attn_varlen_backward", varlen=True, version=self.version)
            if self._varlen
            else None
        )
        self._groups: OrderedDict[tuple, tuple[list[VarlenGroup], list[Any]]] = OrderedDict()
        self._padded_varlen_lse = False  # the installed flash-attn's varlen lse layout, seen in forward

    def _grouped(self, calls, first_key: int, device):
        """Varlen groups of one block's calls (as :func:`~megatron_2d.kernels.flash_windows.flash_calls` splits
        them), built on first use (calls are fixed per layer and batch) and kept for the last ``_GROUP_CACHE``
        blocks (a new packed batch brings new calls)."""
        key = (tuple(calls), first_key, device)
        if key in self._groups:
            self._groups.move_to_end(key)
        else:
            self._groups[key] = varlen_groups(flash_calls(calls), first_key, device)
            if len(self._groups) > _GROUP_CACHE:
                self._groups.popitem(last=False)
        return self._groups[key]

    def forward_calls(self, q, k, v, calls, first_key, scale):
        if not self._varlen or q.shape[0] != 1 or len(calls) < 2:
            return super().forward_calls(q, k, v, calls, first_key, scale)
        groups, alone = self._grouped(calls, first_key, q.device)
        results = super().forward_calls(q, k, v, alone, first_key, scale)
        for g in groups:
            qp, kp, vp = (
                q[0].index_select(0, g.q_index),
                k[0].index_select(0, g.k_index),
                v[0].index_select(0, g.k_index),
            )  # [total, h, d]
            out, lse, _ = self._fa.flash_attn_varlen_func(
                qp,
                kp,
                vp,
                g.cu_q,
                g.cu_k,
                g.max_q,
                g.max_k,
                dropout_p=0.0,
                softmax_scale=scale,
                causal=g.causal,
                window_size=g.window,
                return_attn_probs=True,
            )  # out [total_q, h, d]
            self._padded_varlen_lse = lse.dim() == 3
            lse = packed_lse(lse, g.q_offsets)  # [h, total_q]
            for c, a, b in zip(g.calls, g.q_offsets[:-1], g.q_offsets[1:]):
                results.append((c, out[a:b].unsqueeze(0), lse[:, a:b].unsqueeze(0).float()))
        return results

    def backward_calls(self, dout, q, k, v, out, lse, calls, first_key, scale):
        if not self._varlen or q.shape[0] != 1 or len(calls) < 2:
            return super().backward_calls(dout, q, k, v, out, lse, calls, first_key, scale)
        groups, alone = self._grouped(calls, first_key, q.device)
        results = super().backward_calls(dout, q, k, v, out, lse, alone, first_key, scale)
        for g in groups:
            qp, dp, op = (x[0].index_select(0, g.q_index) for x in (q, dout, out))  # the group's query rows
            kp, vp = k[0].index_select(0, g.k_index), v[0].index_select(0, g.k_index)
            lp = lse[0].index_select(1, g.q_index).contiguous()  # [h, total_q]
            if self._padded_varlen_lse:
                lp = padded_lse(lp, g.q_offsets, g.max_q)
            dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
            self._varlen_backward(
                g.window,
                dout=dp,
                q=qp,
                k=kp,
                v=vp,
                out=op,
                softmax_lse=lp,
                dq=dq,
                dk=dk,
                dv=dv,
                cu_seqlens_q=g.cu_q,
                cu_seqlens_k=g.cu_k,
                max_seqlen_q=g.max_q,
                max_seqlen_k=g.max_k,
                softmax_scale=scale,
                causal=g.causal,
            )
            for c, qa, qb, ka, kb in zip(g.calls, g.q_offsets[:-1], g.q_offsets[1:], g.k_offsets[:-1], g.k_offsets[1:]):
                results.append((c, dq[qa:qb].unsqueeze(0), dk[ka:kb].unsqueeze(0), dv[ka:kb].unsqueeze(0)))
        return results

    def forward_box(self, q, k, v, causal, window, scale):
        out, lse, _ = self._fa.flash_attn_func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=True
        )
        return out, lse.float()

    def backward_box(self, dout, q, k, v, out, lse, causal, window, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(
            window,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=scale,
            causal=causal,
        )
        return dq, dk, dv
