"""The one interface between the ring loop and local attention kernels.

Layouts (the ring loop never sees a kernel's own signature or layout):
    q, dq              [b, s_q, h_q, dk]  (any strides with a contiguous last dim)
    out, dout          [b, s_q, h_q, dv]
    k, dk              [b, s_k, h_kv, dk] h_kv divides h_q (GQA: query head j uses K/V head j // (h_q / h_kv))
    v, dv              [b, s_k, h_kv, dv] dv may differ from dk (MLA: 192 / 128); kernels that need equal head dims
                                          (``needs_equal_head_dims``) get V padded by :class:`PaddedValueKernel`
    lse                [b, h_q, s_q]      softmax log-sum-exp (natural log) of the scaled scores, in
                                          ``accumulator_dtype(q.dtype)`` (fp32; fp64 for fp64 inputs)

``band`` (:class:`megatron_2d.layout.band.Band`, local top-left coordinates) says which keys each query sees:
None = all, ``Band(None, 0)`` on a square block = causal. Calls come trimmed (:meth:`Band.trim`): no query row is
fully masked.

The max logit (QK-clip): :meth:`BlockKernel.forward_calls_with_max` returns a block's results and max_logit [h_q]
(accumulator dtype), the max of scale * q . k over the calls' visible pairs: by default :meth:`forward_calls` and a
separate pass (:mod:`megatron_2d.kernels.max_logit`); a kernel whose launches return it overrides the method.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..layout.band import Band
from ..layout.choices import Kernel
from ..layout.registry import Registry
from .max_logit import calls_max_logit

if TYPE_CHECKING:
    from ..layout.block_calls import BlockCall


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where out/lse/dq/dK/dV accumulate: fp32, or fp64 for fp64 inputs (so fp64 stays fp64-accurate)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def band_mask(band: Band, sq: int, sk: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [sq, sk]: 0 where ``band`` lets query i see key j, -inf elsewhere."""
    offset = torch.arange(sk, device=device).unsqueeze(0) - torch.arange(sq, device=device).unsqueeze(1)  # j - i
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if band.lo is not None:
        hidden |= offset < band.lo
    if band.hi is not None:
        hidden |= offset > band.hi
    return torch.zeros(sq, sk, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


class BlockKernel(abc.ABC):
    """Attention over one (Q block, K/V block) pair, returning the log-sum-exp so blocks can be merged."""

    name: str = "abstract"
    """The kernel's :class:`~megatron_2d.layout.choices.Kernel` (its key in :data:`KERNELS`)."""
    needs_equal_head_dims: bool = True
    """Whether q, k and v must share their head dim (flash kernels); :meth:`for_head_dims` then pads V."""
    missing_package: ClassVar[str | None] = None
    """What it means when the optional package the kernel runs does not import (None: it runs on torch alone)."""

    @classmethod
    def available(cls) -> bool:
        """Whether the kernel can be built here: its optional package imports (True without one)."""
        return True

    def for_head_dims(self, key_dim: int, value_dim: int) -> BlockKernel:
        """This kernel for keys of ``key_dim`` and values of ``value_dim``: itself, or wrapped so that V is padded
        to the key dim when it needs equal head dims."""
        if value_dim == key_dim or not self.needs_equal_head_dims:
            return self
        if value_dim > key_dim:
            raise ValueError(
                f"value head dim {value_dim} exceeds the query/key head dim {key_dim}: the {self.name} "
                f"kernel needs equal head dims and pads V up to the key dim only"
            )
        return PaddedValueKernel(self, key_dim, value_dim)

    def backward_inputs(self, dout: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dout, out) as :meth:`backward_calls` takes them, made once per backward pass (identity here)."""
        return dout, out

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (out [b, s_q, h_q, d] in q's dtype, lse [b, h_q, s_q] in the accumulator dtype)."""

    @abc.abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        band: Band | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients (dq, dk, dv) of this block given the FINAL merged ``out`` and ``lse`` of the query rows."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs on ``device`` with ``dtype``."""
        return True

    def head_dim_problem(self, head_dim: int) -> str | None:
        """Why this kernel cannot take q/k/v of head dim ``head_dim`` (None if it can). A caller that pads the
        head dim (e.g. V to Q/K's) asks with the padded dim."""
        return None

    def forward_calls(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        calls: Sequence[BlockCall],
        first_key: int,
        scale: float,
    ) -> list[tuple[BlockCall, torch.Tensor, torch.Tensor]]:
        """Every call of one block: [(call, out rows, lse rows)]; ``k``/``v`` hold the block's keys from
        ``first_key`` on. One kernel call per BlockCall here; kernels with a batched (varlen) form override, and
        may return a call as calls on disjoint parts of its rows (the flash kernels, where their window would not
        keep its band: :func:`~megatron_2d.kernels.flash_windows.flash_calls`)."""
        return [
            (
                c,
                *self.forward(
                    q[:, c.q_start : c.q_end],
                    k[:, c.k_start - first_key : c.k_end - first_key],
                    v[:, c.k_start - first_key : c.k_end - first_key],
                    c.band,
                    scale,
                ),
            )
            for c in calls
        ]

    def forward_calls_with_max(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        calls: Sequence[BlockCall],
        first_key: int,
        scale: float,
    ) -> tuple[list[tuple[BlockCall, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """(:meth:`forward_calls`' results, max_logit [h_q] over the calls' visible pairs, in the accumulator
        dtype): here a separate pass over the block (:func:`~megatron_2d.kernels.max_logit.calls_max_logit`)."""
        results = self.forward_calls(q, k, v, calls, first_key, scale)
        return results, calls_max_logit(q, k, calls, first_key, scale, accumulator_dtype(q.dtype))

    def backward_calls(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        calls: Sequence[BlockCall],
        first_key: int,
        scale: float,
    ) -> list[tuple[BlockCall, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Gradients of every call of one block: [(call, dq rows, dk keys, dv keys)] (see forward_calls); ``dout``
        and ``out`` as :meth:`backward_inputs` returned them."""
        results = []
        for c in calls:
            rows, keys = slice(c.q_start, c.q_end), slice(c.k_start - first_key, c.k_end - first_key)
            results.append(
                (
                    c,
                    *self.backward(
                        dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows], c.band, scale
                    ),
                )
            )
        return results

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class PaddedValueKernel(BlockKernel):
    """A kernel that needs equal head dims, for V narrower than Q/K (MLA), as Transformer Engine runs flash-attn:
    V is zero-padded to the key dim once per block (and dout, out once per backward pass, see
    :meth:`backward_inputs`), the output and dV are cut back. The padding is exact: its output columns are zero,
    so dP = dout V^T and delta = rowsum(dout * out) are unchanged."""

    def __init__(self, inner: BlockKernel, key_dim: int, value_dim: int) -> None:
        self.inner, self.key_dim, self.value_dim = inner, key_dim, value_dim
        self.name = inner.name

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, self.key_dim - self.value_dim))  # [..., dv] -> [..., dk]

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.inner.supports(device, dtype)

    def backward_inputs(self, dout, out):
        return self.inner.backward_inputs(self._pad(dout), self._pad(out))

    def forward(self, q, k, v, band, scale):
        out, lse = self.inner.forward(q, k, self._pad(v), band, scale)
        return out[..., : self.value_dim], lse

    def backward(self, dout, q, k, v, out, lse, band, scale):
        dq, dk, dv = self.inner.backward(self._pad(dout), q, k, self._pad(v), self._pad(out), lse, band, scale)
        return dq, dk, dv[..., : self.value_dim]

    def _cut(self, results):
        """The inner kernel's per-call results with the output cut back to V's width."""
        return [(call, out[..., : self.value_dim], lse) for call, out, lse in results]

    def forward_calls(self, q, k, v, calls, first_key, scale):
        return self._cut(self.inner.forward_calls(q, k, self._pad(v), calls, first_key, scale))

    def forward_calls_with_max(self, q, k, v, calls, first_key, scale):
        results, max_logit = self.inner.forward_calls_with_max(q, k, self._pad(v), calls, first_key, scale)
        return self._cut(results), max_logit

    def backward_calls(self, dout, q, k, v, out, lse, calls, first_key, scale):
        """``dout`` and ``out`` come padded (:meth:`backward_inputs`)."""
        return [
            (call, dq, dk, dv[..., : self.value_dim])
            for call, dq, dk, dv in self.inner.backward_calls(
                dout, q, k, self._pad(v), out, lse, calls, first_key, scale
            )
        ]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: V {self.value_dim} padded to {self.key_dim}>"


def repeat_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, s, h_q, d], each K/V head repeated for its group of query heads."""
    groups = num_q_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def sum_kv_head_groups(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[b, s, h_q, d] -> [b, s, h_kv, d]: the gradient of :func:`repeat_kv_heads`."""
    b, s, hq, d = dx.shape
    groups = hq // num_kv_heads
    return dx if groups == 1 else dx.view(b, s, num_kv_heads, groups, d).sum(dim=3)


def to_device_once(host: np.ndarray, device) -> torch.Tensor:
    """A 1-D int64 host array on ``device`` without a host sync: written into a (pinned, on CUDA) host buffer
    through its numpy view, then one non-blocking copy (the caching host allocator keeps the pinned block until
    the copy is done). No tensor is made from Python data, so the no-sync guards of tests/test_hot_path.py pass."""
    device = torch.device(device)
    buffer = torch.empty(len(host), dtype=torch.int64, pin_memory=device.type == "cuda")
    buffer.numpy()[:] = host
    return buffer if device.type == "cpu" else buffer.to(device, non_blocking=True)


KERNELS: Registry[type[BlockKernel]] = Registry("attention kernel", Kernel, BlockKernel, key="name")
"""Kernel -> its :class:`BlockKernel` class, each registered by ``@KERNELS.register`` in its module."""
