"""torch's CPU flash-attention kernel (with log-sum-exp and a matching backward), banded calls tiled.

The CPU kernel knows two masks natively (none, top-left causal) and otherwise takes an explicit additive mask,
which it does not skip: a narrow band (a sliding window) over a long block would cost the whole block. So a
band narrower than half the block is cut into row tiles of max(TILE_ROWS, band width) queries, each trimmed to
the keys it can see; a tile costs at most (tile + width) keys per query instead of the whole block
(TILE_ROWS = 64 measured best of 32-256 for windows of 32-512 keys on one CPU thread).
"""

from __future__ import annotations

import torch

from ..layout.band import Band, Trimmed
from ..layout.choices import Kernel
from .base import KERNELS, BlockKernel, accumulator_dtype, band_mask, repeat_kv_heads, sum_kv_head_groups

TILE_ROWS = 64

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [b, s, h, d] <-> [b, h, s, d] (views)


def row_tiles(band: Band | None, sq: int, sk: int) -> list[Trimmed]:
    """The kernel calls for one banded call: itself, or row tiles trimmed to their keys (narrow bands)."""
    if band is None or band.lo is None or band.hi is None or 2 * (band.hi - band.lo + 1) > sk:
        return [Trimmed(0, sq, 0, sk, band)]
    rows = max(TILE_ROWS, band.hi - band.lo + 1)
    tiles = []
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        box = band.shifted(r0, 0).trim(r1 - r0, sk)
        if box is not None:
            tiles.append(Trimmed(r0 + box.q_start, r0 + box.q_end, box.k_start, box.k_end, box.band))
    return tiles


def _mask_args(band: Band | None, sq: int, sk: int, q: torch.Tensor):
    """(is_causal, attn_mask) for the CPU kernel."""
    if band is None:
        return False, None
    if band.is_causal_square(sq, sk):
        return True, None
    return False, band_mask(band, sq, sk, q.dtype, q.device)


@KERNELS.register
class CpuFlashKernel(BlockKernel):
    """``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward; K/V heads expanded for GQA. The
    backward computes in the accumulator dtype (fp32 for bf16 / fp16 inputs)."""

    name = Kernel.CPU_FLASH

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu"

    def forward(self, q, k, v, band, scale) -> tuple[torch.Tensor, torch.Tensor]:
        b, sq, hq, d = q.shape
        k, v = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        acc = accumulator_dtype(q.dtype)
        tiles = row_tiles(band, sq, k.shape[1])
        if len(tiles) == 1 and (tiles[0].q_start, tiles[0].q_end) == (0, sq):
            tile = tiles[0]
            causal, mask = _mask_args(tile.band, sq, tile.k_end - tile.k_start, q)
            kt, vt = k[:, tile.k_start : tile.k_end], v[:, tile.k_start : tile.k_end]
            out, lse = _flash(_t(q), _t(kt), _t(vt), 0.0, causal, attn_mask=mask, scale=scale)[:2]
            return _t(out), lse.to(acc)  # the kernel's out keeps [b, s, h, d] memory order
        out = torch.zeros_like(q)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
        for tile in tiles:
            rows, keys = slice(tile.q_start, tile.q_end), slice(tile.k_start, tile.k_end)
            causal, mask = _mask_args(tile.band, tile.q_end - tile.q_start, tile.k_end - tile.k_start, q)
            o, s = _flash(_t(q[:, rows]), _t(k[:, keys]), _t(v[:, keys]), 0.0, causal, attn_mask=mask, scale=scale)[:2]
            out[:, rows] = _t(o)
            lse[:, :, rows] = s.to(acc)
        return out, lse

    def backward_inputs(self, dout, out):
        acc = accumulator_dtype(out.dtype)
        return dout.to(acc), out.to(acc)  # cast once per backward pass, not once per block

    def backward(self, dout, q, k, v, out, lse, band, scale):
        sq, hq, hkv, dtype = q.shape[1], q.shape[2], k.shape[2], q.dtype
        acc = accumulator_dtype(dtype)
        # bf16 / fp16 run in the accumulator dtype: torch's CPU backward in half precision is several times slower
        # than upcast + fp32 on CPUs without half-precision matrix units (docs/benchmarks.md), and no less exact.
        dout, q, k, v, out = (x.to(acc) for x in (dout, q, k, v, out))
        k_rep, v_rep = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
        lse = lse.to(acc)
        tiles = row_tiles(band, sq, k.shape[1])
        dq = dk = dv = None  # tiled calls accumulate in the accumulator dtype
        for tile in tiles:
            rows, keys = slice(tile.q_start, tile.q_end), slice(tile.k_start, tile.k_end)
            causal, mask = _mask_args(tile.band, tile.q_end - tile.q_start, tile.k_end - tile.k_start, q)
            g = _flash_backward(
                _t(dout[:, rows]),
                _t(q[:, rows]),
                _t(k_rep[:, keys]),
                _t(v_rep[:, keys]),
                _t(out[:, rows]),
                lse[:, :, rows].contiguous(),
                0.0,
                causal,
                attn_mask=mask,
                scale=scale,
            )
            if dq is None:  # one call: its gradients are the block's (up to its key range)
                if (tile.k_start, tile.k_end) == (0, k.shape[1]) and (tile.q_start, tile.q_end) == (0, sq):
                    dq, dk, dv = _t(g[0]), sum_kv_head_groups(_t(g[1]), hkv), sum_kv_head_groups(_t(g[2]), hkv)
                    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
                dq, dk, dv = (torch.zeros(x.shape, dtype=lse.dtype, device=x.device) for x in (q, k_rep, v_rep))
            dq[:, rows] += _t(g[0])
            dk[:, keys] += _t(g[1])
            dv[:, keys] += _t(g[2])
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
