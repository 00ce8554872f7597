"""What the cuDNN-based kernels (torch_cudnn, te_fused) share: a call run whole, or as batched varlen pieces.

Their launches know two masks, none and the causal square (:mod:`megatron_2d.kernels.pieces`). So a call is

    one dense launch        no band, or the causal square: the unpacked zigzag ring's calls
    pieces, batched         any other band, and every call of a batch-1 block with several (packed documents):
                            the calls' pieces go to at most two varlen launches (one per mask; an anti-causal
                            square runs as a causal one, its rows and keys gathered in reverse), every batch row

Varlen tensors are gathered from the block (``index_select``) into packed ``[total, h, d]`` tensors with cumulative
sequence lengths; index tensors of a block are built on the host and reach the device in one non-blocking copy
(:func:`~megatron_2d.kernels.base.to_device_once`), and are kept for the last ``_GROUP_CACHE`` blocks.

A subclass supplies the four launches (:meth:`PieceKernel.dense_forward` and ``dense_backward`` on [b, s, h, d],
``varlen_forward`` and ``varlen_backward`` on THD) and may bound what its varlen backward takes
(:meth:`PieceKernel.varlen_backward_limit`): longer pieces' backward then runs one dense launch each. A subclass
whose forward launches return the max logit sets ``launch_max_logit``: the block's max is then the max of its
launches' (a launch that cannot say returns None for it, and the block takes the separate pass).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import BlockKernel, PaddedValueKernel, accumulator_dtype, to_device_once
from .max_logit import calls_max_logit
from .merge import merge_attention_
from .pieces import Piece, band_pieces, whole_block_mask

_GROUP_CACHE = 256


@dataclass(frozen=True)
class PieceCall:
    """A piece as the ring sees a call: rows [q_start, q_end) and keys [k_start, k_end) of the block."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    band: object = None


@dataclass(frozen=True)
class VarlenGroup:
    """Pieces of one mask kind (causal: causal and anti squares) in one varlen launch, every batch row of each
    piece a sequence (piece-major), with their gather indices into the flattened [b * s, h, d] block."""

    pieces: tuple[Piece, ...]
    causal: bool
    q_index: torch.Tensor  # [total_q] rows of the flattened queries, sequence by sequence (anti: reversed)
    k_index: torch.Tensor  # [total_k] rows of the flattened keys (from first_key)
    cu_q: torch.Tensor  # [n + 1] int32
    cu_k: torch.Tensor
    q_offsets: tuple[int, ...]  # per piece: where its b sequences start in total_q (and total_q last)
    k_offsets: tuple[int, ...]
    max_q: int
    max_k: int


def _ranges(starts: Sequence[int], ends: Sequence[int], reverse: Sequence[bool]) -> np.ndarray:
    parts = [np.arange(b - 1, a - 1, -1) if r else np.arange(a, b) for a, b, r in zip(starts, ends, reverse)]
    return np.concatenate(parts).astype(np.int64)


def varlen_groups(pieces: Sequence[Piece], batch: int, sq: int, sk: int, device) -> list[VarlenGroup]:
    """The varlen launches of ``pieces`` (block coordinates, keys from the block's first): one per mask kind, all
    index tensors from one host buffer in one copy."""
    kinds = [(False, [p for p in pieces if p.mask == "full"]), (True, [p for p in pieces if p.mask != "full"])]
    kinds = [(causal, members) for causal, members in kinds if members]
    host, layout = [], []
    for _, members in kinds:
        seqs = [(p, i) for p in members for i in range(batch)]  # piece-major: a piece's b sequences side by side
        rev = [p.mask == "anti" for p, _ in seqs]
        q_idx = _ranges([i * sq + p.q_start for p, i in seqs], [i * sq + p.q_end for p, i in seqs], rev)
        k_idx = _ranges([i * sk + p.k_start for p, i in seqs], [i * sk + p.k_end for p, i in seqs], rev)
        cu_q = np.cumsum([0] + [p.rows for p, _ in seqs], dtype=np.int64)
        cu_k = np.cumsum([0] + [p.keys for p, _ in seqs], dtype=np.int64)
        host += [q_idx, k_idx, cu_q, cu_k]
        layout.append((cu_q[::batch], cu_k[::batch]))
    if not kinds:
        return []
    parts = iter(torch.split(to_device_once(np.concatenate(host), device), [len(h) for h in host]))
    groups = []
    for (causal, members), (q_off, k_off) in zip(kinds, layout):
        q_index, k_index, cu_q, cu_k = next(parts), next(parts), next(parts), next(parts)
        groups.append(
            VarlenGroup(
                tuple(members),
                causal,
                q_index,
                k_index,
                cu_q.to(torch.int32),
                cu_k.to(torch.int32),
                tuple(int(x) for x in q_off),
                tuple(int(x) for x in k_off),
                max(p.rows for p in members),
                max(p.keys for p in members),
            )
        )
    return groups


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # [b, s, h, d] -> [b * s, h, d]


def _unreverse(x: torch.Tensor, piece: Piece, dim: int = 1) -> torch.Tensor:
    return x.flip(dim) if piece.mask == "anti" else x


class PieceKernel(BlockKernel):
    """A kernel over launches with no mask or the causal square; see the module."""

    needs_equal_head_dims = False
    launch_max_logit = False
    """Whether ``dense_forward`` / ``varlen_forward`` take ``max_logit=True`` and then return a third item: the
    launch's max logit [h] (any float dtype), or None where this launch cannot give it."""

    def __init__(self) -> None:
        self._groups: OrderedDict[tuple, tuple[list, list[VarlenGroup]]] = OrderedDict()

    # ---- the launches a subclass supplies (tensors contiguous) ------------------------------------------------

    @abc.abstractmethod
    def dense_forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch on [b, s, h, d]: (out [b, s_q, h, dv] in q's dtype, lse [b, h, s_q] fp32)."""

    @abc.abstractmethod
    def dense_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """One launch: (dq, dk, dv) in the inputs' dtype, from the final out and lse [b, h, s_q]."""

    @abc.abstractmethod
    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        """One launch on THD [total, h, d]: (out [total_q, h, dv], lse [h, total_q] fp32)."""

    @abc.abstractmethod
    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale):
        """One launch: (dq, dk, dv) on THD, from the final out and lse [h, total_q]."""

    def varlen_backward_limit(self, head_dim: int) -> int | None:
        """The longest sequence (queries or keys) the varlen backward takes; None: any."""
        return None

    # ---- the interface ----------------------------------------------------------------------------------------

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def for_head_dims(self, key_dim: int, value_dim: int) -> BlockKernel:
        """Itself when cuDNN takes V's head dim as it is (a multiple of 8: d_qk != d_v is fine), else V padded to
        the key dim (:class:`~megatron_2d.kernels.base.PaddedValueKernel`)."""
        if value_dim % 8 == 0:
            return self
        if value_dim > key_dim:
            raise ValueError(f"value head dim {value_dim}: not a multiple of 8, and above the key head dim {key_dim}")
        return PaddedValueKernel(self, key_dim, value_dim)

    def _plan(self, calls, first_key: int, batch: int, sq: int, sk: int, device):
        """(calls run whole as (call, mask), varlen groups of the other calls' pieces) for one block, cached."""
        key = (tuple(calls), first_key, batch, sq, sk, device)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        whole, pieces = [], []
        batched = batch == 1 and len(calls) >= 2  # packed documents: every call's pieces into the varlen launches
        for c in calls:
            nq, nk = c.q_end - c.q_start, c.k_end - c.k_start
            own = band_pieces(c.band, nq, nk)
            mask = whole_block_mask(own, nq, nk)
            if mask is not None and not batched:
                whole.append((c, mask))
                continue
            dq, dk = c.q_start, c.k_start - first_key
            pieces += [Piece(p.q_start + dq, p.q_end + dq, p.k_start + dk, p.k_end + dk, p.mask) for p in own]
        self._groups[key] = (whole, varlen_groups(pieces, batch, sq, sk, device))
        if len(self._groups) > _GROUP_CACHE:
            self._groups.popitem(last=False)
        return self._groups[key]

    def forward_calls(self, q, k, v, calls, first_key, scale):
        return self._forward_calls(q, k, v, calls, first_key, scale, None)

    def forward_calls_with_max(self, q, k, v, calls, first_key, scale):
        if not self.launch_max_logit:
            return super().forward_calls_with_max(q, k, v, calls, first_key, scale)
        maxes: list = []
        results = self._forward_calls(q, k, v, calls, first_key, scale, maxes)
        acc = accumulator_dtype(q.dtype)
        if any(m is None for m in maxes):  # a launch that could not give it: the separate pass over the block
            return results, calls_max_logit(q, k, calls, first_key, scale, acc)
        max_logit = torch.full((q.shape[2],), float("-inf"), dtype=acc, device=q.device)
        for m in maxes:
            torch.maximum(max_logit, m.to(acc), out=max_logit)
        return results, max_logit

    def _forward_calls(self, q, k, v, calls, first_key, scale, maxes: list | None):
        """forward_calls' results; with ``maxes`` (a list), every launch asked for its max logit, appended there."""
        whole, groups = self._plan(calls, first_key, q.shape[0], q.shape[1], k.shape[1], q.device)
        launch = {} if maxes is None else {"max_logit": True}

        def outputs(returned):
            if maxes is None:
                return returned
            maxes.append(returned[2])
            return returned[:2]

        results = []
        for c, mask in whole:
            keys = slice(c.k_start - first_key, c.k_end - first_key)
            out, lse = outputs(
                self.dense_forward(
                    *(x.contiguous() for x in (q[:, c.q_start : c.q_end], k[:, keys], v[:, keys])),
                    mask == "causal",
                    scale,
                    **launch,
                )
            )
            results.append((c, out, lse))
        b = q.shape[0]
        qf, kf, vf = _flat(q), _flat(k), _flat(v)
        for g in groups:
            out, lse = outputs(
                self.varlen_forward(
                    qf.index_select(0, g.q_index),
                    kf.index_select(0, g.k_index),
                    vf.index_select(0, g.k_index),
                    g.cu_q,
                    g.cu_k,
                    g.max_q,
                    g.max_k,
                    g.causal,
                    scale,
                    **launch,
                )
            )  # out [total_q, h, dv], lse [h, total_q]
            for p, a, e in zip(g.pieces, g.q_offsets[:-1], g.q_offsets[1:]):
                o = out[a:e].view(b, p.rows, *out.shape[1:])  # [b, rows, h, dv]
                m = lse[:, a:e].view(lse.shape[0], b, p.rows).transpose(0, 1)  # [b, h, rows]
                results.append(
                    (
                        PieceCall(p.q_start, p.q_end, p.k_start + first_key, p.k_end + first_key),
                        _unreverse(o, p),
                        _unreverse(m, p, 2),
                    )
                )
        return results

    def backward_calls(self, dout, q, k, v, out, lse, calls, first_key, scale):
        whole, groups = self._plan(calls, first_key, q.shape[0], q.shape[1], k.shape[1], q.device)
        results = []
        for c, mask in whole:
            rows, keys = slice(c.q_start, c.q_end), slice(c.k_start - first_key, c.k_end - first_key)
            grads = self.dense_backward(
                *(x.contiguous() for x in (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])),
                lse[:, :, rows].contiguous(),
                mask == "causal",
                scale,
            )
            results.append((c, *grads))
        if not groups:
            return results
        b = q.shape[0]
        limit = self.varlen_backward_limit(q.shape[-1])
        flat = [_flat(x) for x in (dout, q, k, v, out)]
        lse_flat = lse.transpose(0, 1).reshape(lse.shape[1], -1)  # [b, h, s] -> [h, b * s]
        for g in groups:
            if limit is not None and max(g.max_q, g.max_k) > limit:
                results += self._dense_piece_backward(dout, q, k, v, out, lse, g, first_key, scale)
                continue
            dq, dk, dv = self.varlen_backward(
                flat[0].index_select(0, g.q_index),
                flat[1].index_select(0, g.q_index),
                flat[2].index_select(0, g.k_index),
                flat[3].index_select(0, g.k_index),
                flat[4].index_select(0, g.q_index),
                lse_flat.index_select(1, g.q_index).contiguous(),
                g.cu_q,
                g.cu_k,
                g.max_q,
                g.max_k,
                g.causal,
                scale,
            )
            for p, qa, qe, ka, ke in zip(
                g.pieces, g.q_offsets[:-1], g.q_offsets[1:], g.k_offsets[:-1], g.k_offsets[1:]
            ):
                results.append(
                    (
                        PieceCall(p.q_start, p.q_end, p.k_start + first_key, p.k_end + first_key),
                        _unreverse(dq[qa:qe].view(b, p.rows, *dq.shape[1:]), p),
                        _unreverse(dk[ka:ke].view(b, p.keys, *dk.shape[1:]), p),
                        _unreverse(dv[ka:ke].view(b, p.keys, *dv.shape[1:]), p),
                    )
                )
        return results

    def _dense_piece_backward(self, dout, q, k, v, out, lse, group: VarlenGroup, first_key: int, scale: float):
        """The backward of a group's pieces one dense launch each (anti squares on reversed copies)."""
        results = []
        for p in group.pieces:
            rows, keys = slice(p.q_start, p.q_end), slice(p.k_start, p.k_end)
            xs = [
                _unreverse(x, p).contiguous() for x in (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])
            ]
            m = _unreverse(lse[:, :, rows], p, 2).contiguous()
            dq, dk, dv = self.dense_backward(*xs, m, group.causal, scale)
            call = PieceCall(p.q_start, p.q_end, p.k_start + first_key, p.k_end + first_key)
            results.append((call, _unreverse(dq, p), _unreverse(dk, p), _unreverse(dv, p)))
        return results

    def forward(self, q, k, v, band, scale):
        sq = q.shape[1]
        call = PieceCall(0, sq, 0, k.shape[1], band)
        parts = self.forward_calls(q, k, v, [call], 0, scale)
        if len(parts) == 1 and (parts[0][0].q_start, parts[0][0].q_end) == (0, sq):
            return parts[0][1], parts[0][2]
        acc = accumulator_dtype(q.dtype)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=acc, device=q.device)
        for c, o, m in parts:
            merge_attention_(out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end], o, m)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, band, scale):
        call = PieceCall(0, q.shape[1], 0, k.shape[1], band)
        parts = self.backward_calls(dout, q, k, v, out, lse, [call], 0, scale)
        if len(parts) == 1 and parts[0][0] == call:
            return parts[0][1:]
        acc = accumulator_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for c, gq, gk, gv in parts:
            dq[:, c.q_start : c.q_end] += gq
            dk[:, c.k_start : c.k_end] += gk
            dv[:, c.k_start : c.k_end] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
