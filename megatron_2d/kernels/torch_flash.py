"""PyTorch's own flash-attention kernel on CUDA (fp16/bf16): the GPU kernel when flash-attn is not installed.

``torch.ops.aten._scaled_dot_product_flash_attention`` returns the log-sum-exp and has a matching backward, in
memory linear in the sequence, but it knows no mask besides ``is_causal`` (top-left, for square blocks). So each
block call runs as pieces, one kernel call each (:func:`band_pieces`):

    no band           one full call
    causal square     one causal call
    any other band    per row tile of at most the band's width: a full rectangle, a causal square (key j' <= query
                      i'), and an anti-causal square (j' >= i'), run as a causal call on both sequences reversed

The pieces cover the call's visible (query, key) pairs exactly once; their outputs merge through the log-sum-exp
(fp32), and each piece's backward runs against the call's final out and lse. A narrow band over a long block thus
costs ~3 launches per band width of rows (the work stays that of the band). K/V heads are repeated for GQA.

The op's schema is checked when the kernel is built: a PyTorch whose op takes other arguments is refused at
kernel selection, naming its version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..band import Band
from ..merge import merge_attention_
from .base import BlockKernel, accumulator_dtype, repeat_kv_heads, sum_kv_head_groups
from .flash_attn2 import flash_head_dim_problem

FULL, CAUSAL, ANTICAUSAL = "full", "causal", "anticausal"

FORWARD_ARGS = ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale")
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
    "philox_seed",
    "philox_offset",
    "scale",
)


@dataclass(frozen=True)
class Piece:
    """Rows [q_start, q_end) x keys [k_start, k_end), all visible (FULL), or a square seen causally
    (CAUSAL: key j' visible from query i' iff j' <= i') or anti-causally (ANTICAUSAL: iff j' >= i')."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    kind: str


def _clip(p: Piece, sk: int) -> list[Piece]:
    """``p`` restricted to the keys [0, sk) that exist, as pieces of the same three kinds."""
    if p.kind == FULL:
        k0, k1 = max(p.k_start, 0), min(p.k_end, sk)
        return [Piece(p.q_start, p.q_end, k0, k1, FULL)] if k0 < k1 and p.q_start < p.q_end else []
    n, out = p.q_end - p.q_start, []
    x = max(0, -p.k_start)  # columns before key 0
    if x:
        if p.kind == ANTICAUSAL:  # rows above the cut see every remaining key
            out += _clip(Piece(p.q_start, p.q_start + x, p.k_start + x, p.k_end, FULL), sk)
        p = Piece(p.q_start + x, p.q_end, p.k_start + x, p.k_end, p.kind)  # causal rows above see nothing
        n -= x
    m = sk - p.k_start  # columns that exist from the square's first key
    if n <= 0 or m <= 0:
        return out
    if m >= n:
        return out + [p]
    out.append(Piece(p.q_start, p.q_start + m, p.k_start, p.k_start + m, p.kind))
    if p.kind == CAUSAL:  # rows below the cut see all m keys
        out.append(Piece(p.q_start + m, p.q_end, p.k_start, p.k_start + m, FULL))
    return out


def band_pieces(band: Band | None, sq: int, sk: int) -> list[Piece]:
    """The pieces of one call (``band`` in local coordinates, key j visible from query i iff lo <= j - i <= hi).

    A row tile [r, r + t) with t at most the band's width W = hi - lo + 1 sees keys [i + lo, i + hi]: an
    anti-causal square on keys [r + lo, r + lo + t), every key of [r + lo + t, r + hi], and a causal square of
    rows [r + 1, r + t) on keys [r + hi + 1, r + hi + t); an unbounded side drops its square."""
    if band is None:
        return [Piece(0, sq, 0, sk, FULL)]
    if band.is_causal_square(sq, sk):
        return [Piece(0, sq, 0, sk, CAUSAL)]
    lo, hi = band.lo, band.hi
    tile = sq if lo is None or hi is None else max(1, min(sq, hi - lo + 1))
    pieces: list[Piece] = []
    for r in range(0, sq, tile):
        t = min(tile, sq - r)
        if lo is not None:
            pieces += _clip(Piece(r, r + t, r + lo, r + lo + t, ANTICAUSAL), sk)
        pieces += _clip(Piece(r, r + t, -1 if lo is None else r + lo + t, sk if hi is None else r + hi + 1, FULL), sk)
        if hi is not None:
            pieces += _clip(Piece(r + 1, r + t, r + hi + 1, r + hi + t, CAUSAL), sk)
    return pieces


def _covers(p: Piece, sq: int, sk: int) -> bool:
    """Whether one piece is the whole call (so its result needs no merging or accumulation)."""
    return (p.q_start, p.q_end, p.k_start, p.k_end) == (0, sq, 0, sk)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [b, s, h, d] <-> [b, h, s, d] (views)


def _ops():
    return (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    )


def _check_schemas() -> None:
    """Refuse a PyTorch whose flash ops take other arguments than the ones this kernel passes."""
    for op, expected in zip(_ops(), (FORWARD_ARGS, BACKWARD_ARGS)):
        names = tuple(a.name for a in op._schema.arguments)
        if names != expected:
            raise ImportError(
                f"torch {torch.__version__}: {op._schema.name} takes {names}, the torch_flash kernel passes {expected}"
            )


class TorchFlashKernel(BlockKernel):
    """``aten::_scaled_dot_product_flash_attention`` and its backward, banded calls cut into pieces."""

    name = "torch_flash"

    def __init__(self) -> None:
        _check_schemas()
        self._aux: tuple | None = None  # the forward's (cum_seq_q, cum_seq_k, philox_seed, philox_offset)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def head_dim_problem(self, head_dim: int) -> str | None:
        return flash_head_dim_problem(head_dim)

    @staticmethod
    def _oriented(piece: Piece, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Tensors [b, s, h, d] of one piece as its kernel call takes them: reversed along s if ANTICAUSAL."""
        return [x.flip(1) if piece.kind == ANTICAUSAL else x for x in xs]

    def _piece_forward(self, q, k, v, piece: Piece, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        forward, _ = _ops()
        qs, ks, vs = self._oriented(
            piece,
            q[:, piece.q_start : piece.q_end],
            k[:, piece.k_start : piece.k_end],
            v[:, piece.k_start : piece.k_end],
        )
        res = forward(_t(qs), _t(ks), _t(vs), 0.0, piece.kind != FULL, False, scale=scale)
        self._aux = (res[2], res[3], res[6], res[7])
        out, lse = _t(res[0]), res[1]  # [b, s, h, d], [b, h, s]
        if piece.kind == ANTICAUSAL:
            out, lse = out.flip(1), lse.flip(-1)
        return out, lse

    def forward(self, q, k, v, band, scale):
        b, sq, hq, d = q.shape
        k, v = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        acc = accumulator_dtype(q.dtype)
        pieces = band_pieces(band, sq, k.shape[1])
        if len(pieces) == 1 and _covers(pieces[0], sq, k.shape[1]):
            out, lse = self._piece_forward(q, k, v, pieces[0], scale)
            return out, lse.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
        for p in pieces:
            o, s = self._piece_forward(q, k, v, p, scale)
            rows = slice(p.q_start, p.q_end)
            merge_attention_(out[:, rows], lse[:, :, rows], o, s.to(acc))
        return out.to(q.dtype), lse

    def _no_dropout_aux(self, q: torch.Tensor) -> tuple:
        """The forward's cum_seq / philox outputs, which the backward takes back (unread without dropout)."""
        if self._aux is None:
            self._piece_forward(q[:1, :1, :1], q[:1, :1, :1], q[:1, :1, :1], Piece(0, 1, 0, 1, FULL), 1.0)
        return self._aux

    def backward(self, dout, q, k, v, out, lse, band, scale):
        sq, hq, hkv = q.shape[1], q.shape[2], k.shape[2]
        k_rep, v_rep = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        lse = lse.to(torch.float32)
        cum_q, cum_k, seed, offset = self._no_dropout_aux(q)
        _, backward = _ops()
        pieces = band_pieces(band, sq, k.shape[1])
        grads = None
        for p in pieces:
            rows, keys = slice(p.q_start, p.q_end), slice(p.k_start, p.k_end)
            do, qs, ks, vs, os = self._oriented(
                p, dout[:, rows], q[:, rows], k_rep[:, keys], v_rep[:, keys], out[:, rows]
            )
            ls = lse[:, :, rows].flip(-1) if p.kind == ANTICAUSAL else lse[:, :, rows]
            g = backward(
                _t(do),
                _t(qs),
                _t(ks),
                _t(vs),
                _t(os),
                ls.contiguous(),
                cum_q,
                cum_k,
                p.q_end - p.q_start,
                p.k_end - p.k_start,
                0.0,
                p.kind != FULL,
                seed,
                offset,
                scale=scale,
            )
            dq, dk, dv = self._oriented(p, *(_t(x) for x in g))
            if len(pieces) == 1 and _covers(p, sq, k.shape[1]):
                return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
            if grads is None:  # pieces accumulate in the accumulator dtype
                grads = [
                    torch.zeros(x.shape, dtype=accumulator_dtype(q.dtype), device=x.device) for x in (q, k_rep, v_rep)
                ]
            grads[0][:, rows] += dq
            grads[1][:, keys] += dk
            grads[2][:, keys] += dv
        dq, dk, dv = grads  # kept in the accumulator dtype, as the ring accumulates them
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
