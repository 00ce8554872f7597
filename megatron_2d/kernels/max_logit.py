"""The max attention logit of a block's calls, without their [s_q, s_k] scores: one pass of row tiles.

    max over (batch, visible (query, key) pairs) of scale * q . k, per query head  ->  [h_q], accumulator dtype

What QK-clip (MuonClip) reads after every step (:func:`megatron_2d.attention_2d`'s ``return_max_logit``). Kernels
that get it from their own launch override :meth:`~megatron_2d.kernels.base.BlockKernel.forward_calls_with_max`
(te_fused on Transformer Engine 2.9 and later: cuDNN's per-row max); every other kernel runs this pass, which
computes q k^T once more, tile by tile:

    q [b, s_q, h_q, d] -> rows [r0, r1) as [b, h_kv, g, n, d]   (g = h_q / h_kv: GQA groups stay a dimension)
    k [b, s_k, h_kv, d] -> the tile's visible keys [k0, k1) as [b, h_kv, 1, d, m]
    scores [b, h_kv, g, n, m] (keys outside the band at -inf) -> amax over (b, n, m) -> [h_kv, g] -> [h_q]

A tile holds at most ``max_elements`` scores, each tile's keys trimmed to what its rows can see (a sliding window
costs its width, not the block). The scale is applied to the max (exact for a positive scale: rounding is monotonic,
so max(fl(scale x)) = fl(scale max(x))). Scores are computed in the accumulator dtype on CPU (fp32 for bf16 / fp16
inputs; fp64 for fp64), and in the inputs' dtype on CUDA, where the matmul accumulates in fp32 and rounds once: the
max is then the fp32 max rounded to the dtype, what Transformer Engine returns (its max_logit has O's dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..layout.band import Band, Trimmed

if TYPE_CHECKING:
    from ..layout.block_calls import BlockCall

MAX_ELEMENTS = {"cpu": 2**20, "cuda": 2**26}
"""Scores one tile holds, by device type (CPU: 4 MiB of fp32, cache-sized; CUDA: 128 MiB of bf16)."""


def score_dtype(dtype: torch.dtype, acc: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the pass computes scores in for inputs of ``dtype``, ``acc`` their accumulator dtype (see the
    module)."""
    return dtype if device.type == "cuda" else acc


def _tiles(box: Trimmed, max_rows: int) -> list[Trimmed]:
    """Row tiles of ``box`` (block coordinates), each trimmed to the keys its rows see."""
    if box.band is None:
        return [
            Trimmed(r0, min(box.q_end, r0 + max_rows), box.k_start, box.k_end, None)
            for r0 in range(box.q_start, box.q_end, max_rows)
        ]
    tiles = []
    nk = box.k_end - box.k_start
    for r0 in range(box.q_start, box.q_end, max_rows):
        r1 = min(box.q_end, r0 + max_rows)
        sub = box.band.shifted(r0 - box.q_start, 0).trim(r1 - r0, nk)
        if sub is not None:
            tiles.append(
                Trimmed(r0 + sub.q_start, r0 + sub.q_end, box.k_start + sub.k_start, box.k_start + sub.k_end, sub.band)
            )
    return tiles


def _hidden(band: Band, n: int, m: int, device) -> torch.Tensor:
    """[n, m] True where ``band`` hides key j from query i (local coordinates)."""
    offset = torch.arange(m, device=device).unsqueeze(0) - torch.arange(n, device=device).unsqueeze(1)  # j - i
    hidden = torch.zeros(n, m, dtype=torch.bool, device=device)
    if band.lo is not None:
        hidden |= offset < band.lo
    if band.hi is not None:
        hidden |= offset > band.hi
    return hidden


def band_max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    band: Band | None,
    scale: float,
    acc: torch.dtype,
    max_elements: int | None = None,
) -> torch.Tensor:
    """[h_q]: max of ``scale`` * q . k over the pairs ``band`` lets see, for q [b, s_q, h_q, d], k [b, s_k, h_kv,
    d]; -inf for a head that sees nothing. In ``acc``, the accumulator dtype of q's."""
    if scale < 0:  # the max of scale * x is |scale| times the max of -x
        return band_max_logit(q, -k, band, -scale, acc, max_elements)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dtype = score_dtype(q.dtype, acc, q.device)
    result = torch.full((hq,), float("-inf"), dtype=acc, device=q.device)
    box = Trimmed(0, sq, 0, sk, None) if band is None else band.trim(sq, sk)
    if box is None:
        return result
    bounded = box.band is not None and box.band.lo is not None and box.band.hi is not None
    width = box.band.hi - box.band.lo + 1 if bounded else box.k_end - box.k_start
    budget = max_elements if max_elements is not None else MAX_ELEMENTS.get(q.device.type, MAX_ELEMENTS["cuda"])
    max_rows = max(1, budget // (b * hq * max(1, width)))
    for tile in _tiles(box, max_rows):
        n, m = tile.q_end - tile.q_start, tile.k_end - tile.k_start
        qt = q[:, tile.q_start : tile.q_end].to(dtype).reshape(b, n, hkv, g, d).permute(0, 2, 3, 1, 4)
        kt = k[:, tile.k_start : tile.k_end].to(dtype).permute(0, 2, 3, 1).unsqueeze(2)  # [b, h_kv, 1, d, m]
        scores = torch.matmul(qt, kt)  # [b, h_kv, g, n, m]
        if tile.band is not None:
            scores.masked_fill_(_hidden(tile.band, n, m, q.device), float("-inf"))
        torch.maximum(result, scores.amax(dim=(0, 3, 4)).reshape(hq).to(acc), out=result)
    return result * scale


def calls_max_logit(
    q: torch.Tensor, k: torch.Tensor, calls: Sequence[BlockCall], first_key: int, scale: float, acc: torch.dtype
) -> torch.Tensor:
    """[h_q]: the max logit over every call of one block (``k`` holds the block's keys from ``first_key`` on)."""
    result = torch.full((q.shape[2],), float("-inf"), dtype=acc, device=q.device)
    for c in calls:
        keys = slice(c.k_start - first_key, c.k_end - first_key)
        torch.maximum(result, band_max_logit(q[:, c.q_start : c.q_end], k[:, keys], c.band, scale, acc), out=result)
    return result
