"""attention_2d with a value head dim narrower than the query/key head dim (MLA: 192 / 128), on forked ranks.

K and V travel side by side, unpadded; kernels that need equal head dims (torch's CPU flash kernel, flash-attn 2)
get V padded as Transformer Engine pads it. Every case compares out, dq, dk, dv with a single-process fp64
reference on the same layout helper's shards; Transformer Engine's four MLA CP configs run in bf16 with TE's
tolerances.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch

import megatron_2d
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.base import PaddedValueKernel
from megatron_2d.testing.distributed import RankFailure, run_on_ranks
from megatron_2d.testing.reference import (TOLERANCE, packed_reference_attention, reference_attention,
                                           reference_on_rank, rel_err, rounded)

TIMEOUT = datetime.timedelta(seconds=60)
DK, DV = 24, 16           # query/key and value head dims of the small cases (192 / 128 scaled down)

# (world, hp, w, placement): head-only, ring-only (inner and outer), 2D with Double-Ring, context_first
LAYOUTS = [(4, 1, 4, "head_first"), (4, 2, 1, "context_first"), (4, 4, 1, "head_first"),
           (8, 2, 2, "head_first"), (8, 1, 2, "head_first"), (8, 8, 1, "head_first")]
# (causal, sliding window, batch, kernel, K/V heads): full and causal, a window narrow enough for the neighbour
# exchange and one the Double-Ring carries, a window open on both sides, batch 1 (point-to-point head exchange),
# torch_math (native unequal head dims) besides cpu_flash (V padded), and one GQA case
CASES = [(True, (-1, -1), 2, None, 8), (False, (-1, -1), 2, None, 8), (True, (3, 0), 2, None, 8),
         (True, (40, 0), 1, None, 8), (False, (5, 7), 2, None, 8), (True, (-1, -1), 1, "torch_math", 8),
         (False, (9, 2), 2, "torch_math", 8), (True, (-1, -1), 2, None, 2)]


def _inputs(S, b, hq, hkv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, b, h, d, generator=g, dtype=torch.float64)
            for h, d in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv))]            # q, k, v, dout


def mla_cases(rank, world, hp, w, placement):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    shard = lambda x: megatron_2d.shard_sequence(x.detach(), rank, world)     # noqa: E731
    errors = {}
    for i, (causal, window, batch, kernel, hkv) in enumerate(CASES):
        q, k, v, dout = _inputs(16 * world, batch, 8, hkv, DK, DV, seed=i)
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        reference_attention(*leaves, causal, 0.3, window=window).backward(dout)
        ql, kl, vl = (shard(x).float().requires_grad_(True) for x in (q, k, v))
        out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, softmax_scale=0.3, kernel=kernel,
                                       sliding_window=window)
        assert out.shape == (16, batch, 8, DV) and out.is_contiguous()
        out.backward(shard(dout).float())
        with torch.no_grad():
            expected = reference_attention(q, k, v, causal, 0.3, window=window)
        errors[(causal, window, batch, kernel, hkv)] = max(
            rel_err(a, shard(e)) for a, e in ((out, expected), (ql.grad, q.grad), (kl.grad, k.grad),
                                              (vl.grad, v.grad)))
    # packed documents (THD), both modes, with a window
    cu = torch.tensor(np.cumsum([0, 3, 40, 9, 70, 6]), dtype=torch.int32)
    for mode in ("zigzag", "documents"):
        layout = megatron_2d.PackedLayout(cu, groups, mode=mode)
        q, k, v, dout = (x[:, 0] for x in _inputs(int(cu[-1]), 1, 8, 8, DK, DV, seed=11))
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        packed_reference_attention(*leaves, cu, True, DK ** -0.5, window=(20, 0)).backward(dout)
        ql, kl, vl = (layout.shard(x.detach()).float().requires_grad_(True) for x in (q, k, v))
        out = megatron_2d.attention_2d(ql, kl, vl, groups, sliding_window=(20, 0), packing=layout)
        out.backward(layout.shard(dout).float())
        with torch.no_grad():
            expected = packed_reference_attention(q, k, v, cu, True, DK ** -0.5, window=(20, 0))
        errors[("packed", mode)] = max(
            ((a.double() - layout.shard(e)).abs().max() / e.abs().max()).item()
            for a, e in ((out, expected), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)))
    return errors


@pytest.mark.parametrize("world, hp, w, placement", LAYOUTS, ids=[f"N{n}-hp{h}-w{w}-{p}" for n, h, w, p in LAYOUTS])
def test_value_dim_narrower_than_key_dim_is_exact(world, hp, w, placement):
    for errors in run_on_ranks(world, mla_cases, hp, w, placement, timeout_s=240):
        bad = {case: err for case, err in errors.items() if not err < TOLERANCE[torch.float32]}
        assert not bad, bad
        assert len(errors) == len(CASES) + 2


# Transformer Engine's MLA context-parallel configs (tests/pytorch/attention/test_attention_with_cp.py,
# model_configs_flash_attn): b 2, s 4096, heads 128 (cp_3_0) or 12, qk head dim 192, v head dim 128. Only the
# sequence is shortened, to what two CPU cores run in seconds (cp_3_0's 128 heads most); batch, heads, head dims and
# masks are TE's, and the windows stay 512 tokens, so that each still cuts the sequence (2048 tokens: 4 windows).
TE_MLA_CONFIGS = {
    #          heads, causal, window,      seq (TE: 4096)
    "cp_3_0": (128, True, (-1, -1), 256),
    "cp_3_1": (12, False, (-1, -1), 1024),
    "cp_3_2": (12, True, (512, 0), 2048),
    "cp_3_3": (12, False, (512, 512), 2048),
}
TE_TOLERANCES = {torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}   # run_attention_with_cp.py's, bf16
# TE's absolute bound is loose for outputs of a few hundredths (full attention averages many values), so each
# tensor must also stay within our bf16 end-to-end bound relative to its largest value


def te_mla_config(rank, world, name):
    heads, causal, window, seq = TE_MLA_CONFIGS[name]
    groups = megatron_2d.build_2d_groups(2, 2, "head_first", timeout=TIMEOUT)
    q, k, v, dout = (rounded(x, torch.bfloat16).float() for x in _inputs(seq, 2, heads, heads, 192, 128, seed=3))
    shard = lambda x: megatron_2d.shard_sequence(x, rank, world)               # noqa: E731
    expected = reference_on_rank(q, k, v, dout, rank, world, causal=causal, window=window, dtype=torch.float32)
    ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, sliding_window=window)
    out.backward(shard(dout).to(torch.bfloat16))
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), expected):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, **TE_TOLERANCES[torch.bfloat16])
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16]
    return groups.comm_bytes.as_dict()


@pytest.mark.parametrize("name", sorted(TE_MLA_CONFIGS))
def test_transformer_engine_mla_cp_configs(name):
    for sent in run_on_ranks(4, te_mla_config, name, timeout_s=300):
        assert sent["all_to_all"] > 0                        # hp 2 x cp 2: the head exchange and the ring both ran
        assert sent["inner_ring"] + sent["neighbour"] > 0


def test_padded_value_kernel_matches_native_unequal_dims():
    """cpu_flash needs equal head dims: for dv < dk it runs through PaddedValueKernel, which must equal torch_math
    (native unequal dims) call by call, banded calls (tiled) included."""
    from megatron_2d.band import Band
    from megatron_2d.block_plan import BlockCall

    flash = select_kernel(torch.device("cpu"), torch.float64, "cpu_flash")
    math_kernel = select_kernel(torch.device("cpu"), torch.float64, "torch_math")
    assert flash.for_head_dims(32, 32) is flash and math_kernel.for_head_dims(32, 16) is math_kernel
    padded = flash.for_head_dims(32, 16)
    assert isinstance(padded, PaddedValueKernel) and padded.name == "cpu_flash"
    with pytest.raises(ValueError, match="value head dim 40 exceeds the query/key head dim 32"):
        flash.for_head_dims(32, 40)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 160, 4, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 150, 2, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 150, 2, 16, generator=g, dtype=torch.float64)
    calls = (BlockCall(0, 160, 0, 150, None), BlockCall(0, 150, 0, 150, Band(None, 0)),
             BlockCall(10, 160, 0, 150, Band(-20, 0)))                          # full, causal, narrow band (tiled)
    for call in calls:
        rows, keys = slice(call.q_start, call.q_end), slice(call.k_start, call.k_end)
        (_, out, lse), = padded.forward_calls(q, k, v, (call,), 0, 0.2)
        (_, out_ref, lse_ref), = math_kernel.forward_calls(q, k, v, (call,), 0, 0.2)
        assert out.shape[-1] == 16 and rel_err(out, out_ref) < 1e-12 and rel_err(lse, lse_ref) < 1e-12
        full_out = torch.zeros(2, 160, 4, 16, dtype=torch.float64)
        full_lse = torch.zeros(2, 4, 160, dtype=torch.float64)
        full_out[:, rows], full_lse[:, :, rows] = out_ref, lse_ref
        dout = torch.randn(2, 160, 4, 16, generator=g, dtype=torch.float64)
        kernel_dout, kernel_out = padded.backward_inputs(dout, full_out)          # padded once per backward
        (_, *grads), = padded.backward_calls(kernel_dout, q, k, v, kernel_out, full_lse, (call,), 0, 0.2)
        (_, *grads_ref), = math_kernel.backward_calls(dout, q, k, v, full_out, full_lse, (call,), 0, 0.2)
        assert grads[2].shape[-1] == 16
        assert all(rel_err(a, e) < 1e-12 for a, e in zip(grads, grads_ref)), (call, keys)


def wider_value(rank, world):
    groups = megatron_2d.build_2d_groups(1, 1, timeout=TIMEOUT)
    q, k, v = (torch.zeros(8, 1, 2, d) for d in (16, 16, 24))
    megatron_2d.attention_2d(q, k, v, groups)


def test_value_wider_than_key_is_refused_by_name():
    with pytest.raises(RankFailure, match="value head dim 24 exceeds the query/key head dim 16: the cpu_flash"):
        run_on_ranks(1, wider_value)
