"""The cuDNN-based kernels' shared pieces and PyTorch's cuDNN ops (torch_cudnn) through their CPU kernels: every
small band cut into full / causal / anti pieces exactly, launch counts of whole calls, windows and packed blocks, and
the stand-in refusing what PyTorch's CUDA code does not define."""

import itertools

import numpy as np
import pytest
import torch

from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.merge import merge_attention_
from megatron_2d.kernels.pieces import band_pieces
from megatron_2d.layout.band import Band
from megatron_2d.layout.block_calls import BlockCall
from megatron_2d.testing.reference import TOLERANCES, attention_with_lse, norm_err, rel_err
from megatron_2d_dev.torch_cudnn_cpu import torch_cudnn_on_cpu

BF16 = TOLERANCES[torch.bfloat16]


def piece_counts(band, sq, sk):
    """[sq, sk] how often each pair is covered by the pieces, and the most pieces sharing one row."""
    got, per_row = np.zeros((sq, sk), int), np.zeros(sq, int)
    for p in band_pieces(band, sq, sk):
        i, j = np.arange(p.rows)[:, None], np.arange(p.keys)[None]
        if p.mask == "full":
            seen = np.ones((p.rows, p.keys), int)
        else:
            assert p.rows == p.keys, p  # causal masks only on squares: their alignment cannot matter
            seen = (j <= i) if p.mask == "causal" else (j >= i)
        got[p.q_start : p.q_end, p.k_start : p.k_end] += seen
        per_row[p.q_start : p.q_end] += 1
    return got, per_row.max(initial=0)


@pytest.mark.parametrize("size", [range(1, 9), pytest.param(range(9, 14), marks=pytest.mark.slow)])
def test_pieces_hold_every_visible_pair_once(size):
    """Every band on every block of these sizes: the pieces cover exactly the visible pairs, once each; a causal or
    full block stays one piece; no row is in more than three pieces."""
    for sq, sk in itertools.product(size, range(1, 14)):
        for lo, hi in itertools.product([None, *range(-14, 14)], repeat=2):
            band = None if (lo, hi) == (None, None) else Band(lo, hi)
            want = np.array([[band is None or band.visible(i, j) for j in range(sk)] for i in range(sq)], int)
            got, sharing = piece_counts(band, sq, sk)
            assert (got == want).all(), (sq, sk, band, band_pieces(band, sq, sk))
            assert sharing <= 3, (sq, sk, band)
    assert [p.mask for p in band_pieces(Band(None, 0), 8, 8)] == ["causal"]
    assert [p.mask for p in band_pieces(None, 8, 5)] == ["full"]


def test_a_window_is_two_squares_per_window_of_rows():
    """A causal window of W keys over a long block: row tiles of W - 1, each an anti and a causal square."""
    pieces = band_pieces(Band(-4095, 0), 32768, 32768)
    assert len(pieces) <= 2 * 32768 // 4095 + 3
    assert {p.mask for p in pieces} == {"anti", "causal", "full"} and max(p.rows for p in pieces) == 4095


def block(sq, sk, hq=4, hkv=2, d=16, dv=16, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, sq, hq, n, generator=g, dtype=torch.float64).bfloat16() for n in (d, dv))
    k, v = (torch.randn(b, sk, hkv, n, generator=g, dtype=torch.float64).bfloat16() for n in (d, dv))
    return q, k, v, dout


def reference(q, k, v, dout, band, scale):
    """fp64 (out, lse, dq, dk, dv) of one block under ``band``."""
    sq, sk = q.shape[1], k.shape[1]
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    offset = torch.arange(sk)[None] - torch.arange(sq)[:, None]
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if band is not None:
        hidden = (offset < band.lo if band.lo is not None else hidden) | (
            offset > band.hi if band.hi is not None else hidden
        )
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1].repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), leaves[2].repeat_interleave(rep, 2))
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), *(x.grad for x in leaves)


CASES = {  # name: (band, s_q, s_k, batch, head dims, launches forward / backward)
    "causal square": (Band(None, 0), 64, 64, 2, (16, 16), {"dense forward": 1, "dense backward": 1}),
    "full rectangle, MLA dims": (None, 32, 48, 2, (24, 16), {"dense forward": 1, "dense backward": 1}),
    "causal, more queries than keys": (  # a 16-key causal square, and 32 rows below it (> d: dense backward)
        Band(None, 0),
        48,
        16,
        1,
        (16, 16),
        {"varlen forward": 2, "varlen backward": 1, "dense backward": 1},
    ),
    "window of 16 keys (pieces <= d)": (  # 70 pieces, whatever the length: two launches each way
        Band(-15, 0),
        512,
        512,
        2,
        (16, 16),
        {"varlen forward": 2, "varlen backward": 2},
    ),
    "window of 64 keys (pieces > d)": (  # 10 pieces of 63 rows: their backward dense
        Band(-63, 0),
        256,
        256,
        1,
        (16, 16),
        {"varlen forward": 2, "dense backward": 10},
    ),
    "two-sided band": (Band(-9, 12), 80, 96, 2, (16, 16), {"varlen forward": 2, "dense backward": 10}),
}


@pytest.mark.parametrize("name", CASES)
def test_torch_cudnn_calls_and_launches(name):
    """torch_cudnn on one block through PyTorch's cuDNN ops on CPU: causal squares and full blocks one dense launch;
    other bands their pieces in at most one varlen launch per mask (backward: dense per piece where a piece is longer
    than the head dim, the varlen graph's bound); exact against fp64. A call's dQ adds up to three pieces' bf16
    partials, so it is held to the end-to-end bound; out, lse, dK, dV to their per-output bounds."""
    band, sq, sk, b, (d, dv), launches = CASES[name]
    q, k, v, dout = block(sq, sk, d=d, dv=dv, b=b)
    want = reference(q, k, v, dout, band, 0.3)
    with torch_cudnn_on_cpu() as counted:
        kernel = select_kernel(torch.device("cpu"), torch.bfloat16, "torch_cudnn", head_dim=d)
        out, lse = kernel.forward(q, k, v, band, 0.3)
        grads = kernel.backward(dout, q, k, v, out, lse, band, 0.3)
    assert dict(counted) == launches
    got = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))
    for key, expected in zip(got, want):
        assert got[key].shape == expected.shape, key
        if key == "dq" and len(band_pieces(band, sq, sk)) > 1:
            assert rel_err(got[key], expected) < BF16.end_to_end, key
        else:
            assert norm_err(got[key], expected) < BF16.of(key), (key, norm_err(got[key], expected))


def test_torch_cudnn_packed_block_is_two_varlen_launches():
    """Many calls on one batch-1 block (packed documents: causal squares and full rectangles, a tall causal call):
    one varlen launch per mask kind, forward and backward (every piece within the head dim); each call exact."""
    calls = [
        BlockCall(0, 12, 0, 12, Band(None, 0)),
        BlockCall(12, 20, 12, 24, None),
        BlockCall(20, 40, 24, 36, Band(None, 0)),
        BlockCall(40, 48, 36, 48, Band(None, 4)),
    ]  # disjoint rows and keys, so each call's gradients can be read off the block's
    q, k, v, dout = block(48, 48, d=24, dv=24, seed=3)
    with torch_cudnn_on_cpu() as counted:
        kernel = select_kernel(torch.device("cpu"), torch.bfloat16, "torch_cudnn", head_dim=24)
        out = torch.zeros(1, 48, 4, 24)
        lse = torch.full((1, 4, 48), float("-inf"))
        for c, o, m in kernel.forward_calls(q, k, v, calls, 0, 0.3):
            merge_attention_(out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end], o, m)
        dq, dk, dv = (torch.zeros(x.shape) for x in (q, k, v))
        for c, gq, gk, gv in kernel.backward_calls(dout, q, k, v, out.bfloat16(), lse, calls, 0, 0.3):
            dq[:, c.q_start : c.q_end] += gq
            dk[:, c.k_start : c.k_end] += gk
            dv[:, c.k_start : c.k_end] += gv
    assert dict(counted) == {"varlen forward": 2, "varlen backward": 2}
    for c in calls:
        rows, keys = slice(c.q_start, c.q_end), slice(c.k_start, c.k_end)
        want = reference(q[:, rows], k[:, keys], v[:, keys], dout[:, rows], c.band, 0.3)
        for key, a, e in zip(("out", "lse"), (out[:, rows], lse[:, :, rows]), want[:2]):
            assert norm_err(a, e) < BF16.of(key), (c, key)
        for key, a, e in zip(("dq", "dk", "dv"), (dq[:, rows], dk[:, keys], dv[:, keys]), want[2:]):
            assert rel_err(a, e) < BF16.end_to_end, (c, key)


def test_cudnn_stand_in_semantics():
    """The ops on CPU as PyTorch's CUDA code runs them: is_causal top-left on a dense rectangle (row i sees keys
    0..i); varlen per sequence; the varlen backward's graph bounded by the head dim; a dense backward given out in
    another layout than q's refused."""
    q, k, v, dout = block(6, 10, d=8, dv=8, b=1)
    with torch_cudnn_on_cpu():
        fwd, bwd = torch.ops.aten._cudnn_attention_forward, torch.ops.aten._cudnn_attention_backward
        out, lse = fwd(*(x.transpose(1, 2) for x in (q, k, v)), None, None, None, 6, 10, True, 0.0, True, False,
                       scale=0.5)[:2]  # fmt: skip
        want = attention_with_lse(*(x.double() for x in (q, k[:, :6], v[:, :6])), True, 0.5)
        assert lse.shape == (1, 4, 6, 1) and rel_err(out.transpose(1, 2), want[0]) < BF16.end_to_end
        cu = torch.tensor([0, 3, 9], dtype=torch.int32)
        qt, kt, vt = (torch.randn(9, h, 8).bfloat16() for h in (4, 2, 2))
        out, lse = fwd(qt, kt, vt, None, cu, cu, 6, 6, True, 0.0, True, False, scale=0.5)[:2]
        assert out.shape == (9, 4, 8) and lse.shape == (9, 4, 1)
        for r in (slice(0, 3), slice(3, 9)):
            ref = attention_with_lse(*(x[r][None].double() for x in (qt, kt, vt)), True, 0.5)
            assert rel_err(out[r][None], ref[0]) < BF16.end_to_end and rel_err(lse[r, :, 0].t()[None], ref[1]) < 1e-5
        long_cu = torch.tensor([0, 9], dtype=torch.int32)  # one sequence of 9 > head dim 8
        with pytest.raises(RuntimeError, match=r"built for sequences of at most 8 queries and 8 keys"):
            bwd(qt, qt, kt, vt, qt, lse, lse, lse, None, long_cu, long_cu, 9, 9, 0.0, True, scale=0.5)
        q4, k4, v4, o4 = (x.transpose(1, 2) for x in (q, k, v, dout))
        with pytest.raises(RuntimeError, match=r"out is not in q's layout"):
            bwd(o4, q4, k4, v4, o4.contiguous(), torch.zeros(1, 4, 6, 1), lse, lse, None, None, None, 6, 10, 0.0,
                False, scale=0.5)  # fmt: skip
