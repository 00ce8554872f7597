"""The flash-attn 2 block kernel (megatron_2d.kernels.flash_attn2) on CPU, through the stand-in of flash-attn's API.

First the stand-in itself against an independent fp64 computation of flash-attn's documented conventions (mask
alignment, window, softcap, lse layouts, empty rows, softmax_d, dtypes); then FlashAttn2Kernel, built on a fake
``flash_attn`` package of each API profile, forward and backward against fp64 math on the same rounded inputs;
then attention_2d on forked ranks with that kernel in the ring.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import itertools
import sys

import pytest
import torch

import megatron_2d
from megatron_2d.band import Band
from megatron_2d.kernels.flash_attn2 import FlashAttn2Kernel
from megatron_2d.testing import flash_attn_cpu
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import (TOLERANCES, norm_err, packed_reference_attention, reference_attention,
                                            rel_err, rounded)

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def brute_force(q, k, v, dout, scale, causal=False, window=(-1, -1), softcap=0.0):
    """fp64 attention with flash-attn's documented mask, written per (query, key) pair: (out, lse, dq, dk, dv).
    Query i sees key j when i + s_k - s_q - left <= j <= i + s_k - s_q + right (right = 0 when causal)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    left, right = window
    if causal:
        right = 0
    visible = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            lo = i + sk - sq - left if left >= 0 else -10 ** 9
            hi = i + sk - sq + right if right >= 0 else 10 ** 9
            visible[i, j] = lo <= j <= hi
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    kk, vv = (x.repeat_interleave(hq // hkv, dim=2) for x in (k64, v64))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(dout.double())
    lse = lse.detach().masked_fill(~visible.any(1), float("inf"))
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def run_private(api, q, k, v, dout, scale, causal, window, softcap=0.0):
    """The profile's private forward and backward: (out, lse, dq, dk, dv, softmax_d)."""
    params = inspect.signature(api._flash_attn_forward).parameters
    win = ({"window_size_left": window[0], "window_size_right": window[1]} if "window_size_left" in params
           else {"window_size": window})
    extra = {"softcap": softcap} if "softcap" in params else {}
    fwd = api._flash_attn_forward(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None,
                                  return_softmax=False, **win, **extra)
    out, lse = (fwd[0], fwd[1]) if len(fwd) == 4 else (fwd[4], fwd[5])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bwd = api._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
                                   causal=causal, alibi_slopes=None, deterministic=False, rng_state=None, **win,
                                   **extra)
    softmax_d = bwd if isinstance(bwd, torch.Tensor) else bwd[3]
    return out, lse, dq, dk, dv, softmax_d


# ---- the stand-in against flash-attn's documented conventions ---------------------------------------------------

MASKS = [  # (s_q, s_k, causal, window, softcap)
    (8, 8, True, (-1, -1), 0.0),     # square causal (the fast path)
    (6, 10, True, (-1, -1), 0.0),    # bottom-right causal, more keys than queries
    (10, 6, True, (-1, -1), 0.0),    # bottom-right causal, the first 4 query rows see nothing
    (12, 12, True, (3, -1), 0.0),    # causal sliding window
    (8, 12, False, (2, 1), 0.0),     # two-sided window, rectangular
    (8, 8, False, (-1, -1), 5.0),    # softcap
]


# flash-attn 2.5 has no softcap argument: that combination does not exist, so it is not listed
CONVENTION_CASES = [(p, *m) for p in flash_attn_cpu.PROFILES for m in MASKS if not (p == "2.5" and m[4])]


@pytest.mark.parametrize("profile, sq, sk, causal, window, softcap", CONVENTION_CASES,
                         ids=[f"fa{p}-q{a}-k{b}-{'causal' if c else 'full'}-win{w[0]}_{w[1]}-cap{s:g}"
                              for p, a, b, c, w, s in CONVENTION_CASES])
def test_stand_in_follows_flash_attn_conventions(profile, sq, sk, causal, window, softcap):
    api = flash_attn_cpu._build_profile(profile, strict_dtypes=False)
    q, dout = randn(2, sq, 4, 16, seed=1), randn(2, sq, 4, 16, seed=2)
    k, v = randn(2, sk, 2, 16, seed=3), randn(2, sk, 2, 16, seed=4)
    out, lse, dq, dk, dv, softmax_d = run_private(api, q, k, v, dout, 0.4, causal, window, softcap)
    want = brute_force(q, k, v, dout, 0.4, causal, window, softcap)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))          # empty rows: +inf, as flash-attn
    finite = torch.isfinite(want[1])
    assert (lse[finite] - want[1][finite]).abs().max() < 1e-5
    # lse is fp32 (as flash-attn's) and the backward rebuilds P from it, so fp64 gradients carry ~1e-7
    assert rel_err(out, want[0]) < 1e-10
    for got, ref in zip((dq, dk, dv), want[2:]):
        assert rel_err(got, ref) < 1e-6
    assert softmax_d.shape == (2, 4, 128) and not softmax_d[..., sq:].any()
    assert rel_err(softmax_d[..., :sq], (dout * out).sum(-1).transpose(1, 2)) < 1e-6


def test_empty_rows_give_zero_output_and_zero_gradient():
    api = flash_attn_cpu._build_profile("2.7", strict_dtypes=False)
    q, dout, k, v = randn(1, 6, 2, 8, seed=5), randn(1, 6, 2, 8, seed=6), randn(1, 3, 2, 8), randn(1, 3, 2, 8)
    out, lse, dq, _, _, _ = run_private(api, q, k, v, dout, 0.5, True, (-1, -1))
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, :3] > 0).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert not out[:, :3].any() and not dq[:, :3].any()


def test_varlen_layouts():
    """Varlen: tokens packed as [total, h, d]; lse [h, total_q]; softmax_d [h, total_q + 128 * batch]; each
    sequence equals the padded function on it alone."""
    api = flash_attn_cpu._build_profile("2.7", strict_dtypes=False)
    lens_q, lens_k = [5, 3, 8], [5, 7, 8]
    cu_q = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, dout, k, v = randn(16, 4, 8, seed=7), randn(16, 4, 8, seed=8), randn(20, 2, 8, seed=9), randn(20, 2, 8)
    out, lse, s_dmask = api.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True, window_size=(4, -1),
                                                   return_attn_probs=True)
    assert lse.shape == (4, 16) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = api._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 8, 8, 0.0,
                                                8 ** -0.5, True, 4, -1, 0.0, None, False)
    assert softmax_d.shape == (4, 16 + 128 * 3)
    for n in range(3):
        rq, rk = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        want = brute_force(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], 8 ** -0.5, True, (4, -1))
        assert rel_err(out[rq], want[0][0]) < 1e-10 and rel_err(dq[rq], want[2][0]) < 1e-6
        assert rel_err(dk[rk], want[3][0]) < 1e-6 and rel_err(dv[rk], want[4][0]) < 1e-6
        assert (lse[:, rq] - want[1][0]).abs().max() < 1e-5
    assert lens_q == [int(x) for x in cu_q.diff()] and lens_k == [int(x) for x in cu_k.diff()]


def test_public_function_return_switch_and_defaults():
    package, _ = flash_attn_cpu.flash_attn_modules("2.7")
    q, k, v = (randn(1, 8, 2, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    out = package.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    out2, lse, s_dmask = package.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 8) and s_dmask.numel() == 0
    # softmax_scale None is 1/sqrt(d)
    assert torch.equal(out, package.flash_attn_func(q, k, v, softmax_scale=16 ** -0.5, causal=True))


def test_stand_in_refuses_what_flash_attn_refuses_or_it_does_not_implement():
    package, interface = flash_attn_cpu.flash_attn_modules("2.7")
    q = randn(1, 8, 2, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        package.flash_attn_func(q, q, q)
    qb = q.bfloat16()
    with pytest.raises(NotImplementedError, match="dropout"):
        package.flash_attn_func(qb, qb, qb, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi"):
        package.flash_attn_func(qb, qb, qb, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="unknown flash-attn API profile"):
        flash_attn_cpu.flash_attn_modules("3.0")


def test_profiles_have_flash_attns_signatures():
    """The private signatures of each profile, as flash-attn declares them (names and order)."""
    head = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal"]
    expected_bwd = {
        "2.5": head + ["window_size", "alibi_slopes", "deterministic", "rng_state"],
        "2.6.0": head + ["window_size", "softcap", "alibi_slopes", "deterministic", "rng_state"],
        "2.7": head + ["window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
                       "rng_state"],
    }
    for profile, names in expected_bwd.items():
        _, interface = flash_attn_cpu.flash_attn_modules(profile)
        assert list(inspect.signature(interface._flash_attn_backward).parameters) == names, profile
        public = list(inspect.signature(interface.flash_attn_func).parameters)
        assert public[:7] == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size"]
        assert public[-1] == "return_attn_probs" and ("softcap" in public) == (profile != "2.5")


# ---- FlashAttn2Kernel through the stand-in ----------------------------------------------------------------------

@pytest.fixture
def fake_flash_attn(monkeypatch):
    """Install a fake flash_attn of one profile into sys.modules for the test (restored afterwards)."""

    def install(profile):
        package, interface = flash_attn_cpu.flash_attn_modules(profile)
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
        return interface

    return install


KERNEL_CASES = list(itertools.product(flash_attn_cpu.PROFILES, LOW, [True, False], [4, 1]))


@pytest.mark.parametrize("profile, dtype, causal, hkv", KERNEL_CASES,
                         ids=[f"fa{p}-{dt}-{'causal' if c else 'full'}-hkv{h}" for p, dt, c, h in KERNEL_CASES])
def test_flash_attn2_kernel_forward_backward(fake_flash_attn, profile, dtype, causal, hkv):
    fake_flash_attn(profile)
    dtype = LOW[dtype]
    kernel = FlashAttn2Kernel()
    sq, sk = 16, (16 if causal else 24)
    q, dout = randn(2, sq, 4, 32, seed=11, dtype=dtype), randn(2, sq, 4, 32, seed=12, dtype=dtype)
    k, v = randn(2, sk, hkv, 32, seed=13, dtype=dtype), randn(2, sk, hkv, 32, seed=14, dtype=dtype)
    band = Band(None, 0) if causal else None
    out, lse = kernel.forward(q, k, v, band, 0.3)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, band, 0.3)
    want = brute_force(q, k, v, dout, 0.3, causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    tol = TOLERANCES[dtype]
    bad = {key: norm_err(g, w) for (key, g), w in zip(got.items(), (want[0], want[1], *want[2:]))
           if not norm_err(g, w) < tol.of(key)}
    assert not bad, bad
    assert dq.dtype == dk.dtype == dv.dtype == dtype and dk.shape == k.shape


# Trimmed bands as the ring passes them (local top-left coordinates: key j visible from query i iff
# lo <= j - i <= hi): a causal window on a square block, a window between blocks (rectangular), one-sided bands.
BANDS = [(16, 16, -5, 0), (12, 20, -2, 9), (16, 16, None, 3), (16, 16, -4, None), (10, 16, -3, 6)]


@pytest.mark.parametrize("profile", flash_attn_cpu.PROFILES)
@pytest.mark.parametrize("sq, sk, lo, hi", BANDS, ids=[f"q{a}-k{b}-band{c}_{d}" for a, b, c, d in BANDS])
def test_flash_attn2_kernel_bands(fake_flash_attn, profile, sq, sk, lo, hi):
    """Bands become flash-attn windows (bottom-right aligned): forward and backward match the band's own mask."""
    fake_flash_attn(profile)
    kernel = FlashAttn2Kernel()
    band = Band(lo, hi).trim(sq, sk)
    assert band is not None and (band.q_start, band.q_end, band.k_start, band.k_end) == (0, sq, 0, sk)
    q, dout = randn(1, sq, 4, 32, seed=15, dtype=torch.bfloat16), randn(1, sq, 4, 32, seed=16, dtype=torch.bfloat16)
    k, v = (randn(1, sk, 2, 32, seed=s, dtype=torch.bfloat16) for s in (17, 18))
    out, lse = kernel.forward(q, k, v, band.band, 0.3)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, band.band, 0.3)
    # the same mask written as flash-attn's window: query i sees keys i + lo .. i + hi (top-left)
    left = -1 if lo is None else (sk - sq) - lo
    right = -1 if hi is None else hi - (sk - sq)
    want = brute_force(q, k, v, dout, 0.3, False, (left, right))
    tol = TOLERANCES[torch.bfloat16]
    for key, got, ref in (("out", out, want[0]), ("lse", lse, want[1]), ("dq", dq, want[2]), ("dk", dk, want[3]),
                          ("dv", dv, want[4])):
        assert norm_err(got, ref) < tol.of(key), key


# ---- attention_2d with the flash-attn 2 kernel in the ring ------------------------------------------------------

def run_ring_with_flash_attn2(rank, world, hp, w, placement):
    package, interface = flash_attn_cpu.flash_attn_modules("2.7")
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = package, interface
    FlashAttn2Kernel.supports = lambda self, device, dtype: dtype in (torch.float16, torch.bfloat16)  # CPU here
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=datetime.timedelta(seconds=30))
    errors = {}
    for causal, hkv in itertools.product([True, False], [8, 2]):
        g = torch.Generator().manual_seed(21)
        q, k, v, dout = (torch.randn(2 * world * 8, 2, h, 64, generator=g, dtype=torch.float64)
                         for h in (8, hkv, hkv, 8))
        q, k, v, dout = (rounded(x, torch.bfloat16).requires_grad_(x is not dout) for x in (q, k, v, dout))
        ref = reference_attention(q, k, v, causal, 64 ** -0.5)
        ref.backward(dout)
        shard = lambda x: megatron_2d.shard_sequence(x.detach(), rank, world)  # noqa: E731
        ql, kl, vl = (shard(x).bfloat16().requires_grad_(True) for x in (q, k, v))
        out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, kernel="flash_attn2")
        out.backward(shard(dout).bfloat16())
        for key, a, e in (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                          ("dv", vl.grad, v.grad)):
            errors[(causal, hkv, key)] = norm_err(a, shard(e))
    return errors


@pytest.mark.parametrize("world, hp, w, placement", [(4, 1, 4, "head_first"), (4, 2, 1, "context_first")],
                         ids=["N4-hp1-cp4-w4", "N4-hp2-cp2-w1-context_first"])
def test_attention_2d_with_flash_attn2_kernel(world, hp, w, placement):
    tol = TOLERANCES[torch.bfloat16]
    bad = {case: e for per_rank in run_on_ranks(world, run_ring_with_flash_attn2, hp, w, placement)
           for case, e in per_rank.items() if not e < tol.of(case[2])}
    assert not bad, bad


def run_packed_with_flash_attn2(rank, world, mode):
    """Packed documents with the flash-attn 2 kernel: many calls per block go to the varlen function."""
    package, interface = flash_attn_cpu.flash_attn_modules("2.7")
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = package, interface
    FlashAttn2Kernel.supports = lambda self, device, dtype: dtype in (torch.float16, torch.bfloat16)  # CPU here
    launches = {"varlen_fwd": 0, "varlen_bwd": 0}
    fwd, bwd = interface.flash_attn_varlen_func, interface._flash_attn_varlen_backward

    def counted(name, fn):
        @functools.wraps(fn)                   # keeps the signature the kernel binds arguments by
        def call(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return call

    interface.flash_attn_varlen_func = counted("varlen_fwd", fwd)
    interface._flash_attn_varlen_backward = counted("varlen_bwd", bwd)
    groups = megatron_2d.build_2d_groups(2, 1, "head_first", timeout=datetime.timedelta(seconds=30))
    lengths = [3, 40, 1, 17, 64, 9, 5, 30]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    layout = megatron_2d.PackedLayout(cu, groups, mode=mode)
    g = torch.Generator().manual_seed(4)
    T = int(cu[-1])
    q, k, v, dout = (rounded(torch.randn(T, h, 32, generator=g, dtype=torch.float64), torch.bfloat16)
                     for h in (8, 2, 2, 8))
    for x in (q, k, v):
        x.requires_grad_(True)
    ref = packed_reference_attention(q, k, v, cu, True, 32 ** -0.5)
    ref.backward(dout)
    ql, kl, vl = (layout.shard(x.detach()).bfloat16().requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, kernel="flash_attn2", packing=layout)
    out.backward(layout.shard(dout).bfloat16())
    errors = {key: norm_err(a, layout.shard(e.detach())) for key, a, e in
              (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad), ("dv", vl.grad, v.grad))}
    return errors, launches


@pytest.mark.parametrize("mode", ["zigzag", "documents"])
def test_packed_attention_with_flash_attn2_varlen(mode):
    tol = TOLERANCES[torch.bfloat16]
    for errors, launches in run_on_ranks(4, run_packed_with_flash_attn2, mode):
        assert all(e < tol.of(key) for key, e in errors.items()), errors
        assert launches["varlen_fwd"] > 0 and launches["varlen_bwd"] > 0, launches


def test_varlen_lse_layouts_round_trip():
    """Older flash-attn 2 returned varlen lse as [n, h, max_seqlen]; both layouts give the same rows."""
    from megatron_2d.kernels.flash_attn2 import packed_lse, padded_lse
    lse, offsets = torch.randn(3, 10), (0, 4, 10)
    padded = padded_lse(lse, offsets, 6)
    assert padded.shape == (2, 3, 6) and torch.equal(padded[0, :, 4:], torch.zeros(3, 2))
    assert torch.equal(packed_lse(padded, offsets), lse) and packed_lse(lse, offsets) is lse


@pytest.mark.parametrize("first_key", [0, 5])
def test_varlen_calls_equal_one_call_each(fake_flash_attn, first_key):
    """A block's calls batched into varlen launches give each call's own result, for a block whose keys start at
    ``first_key`` (the neighbour exchange sends key slices): forward and backward."""
    from megatron_2d.block_plan import BlockCall
    from megatron_2d.kernels.base import BlockKernel

    fake_flash_attn("2.7")
    kernel = FlashAttn2Kernel()
    S, K = 24, 20                                   # queries; keys held (global keys first_key .. first_key + K)
    q, dout = randn(1, S, 4, 16, seed=31, dtype=torch.bfloat16), randn(1, S, 4, 16, seed=32, dtype=torch.bfloat16)
    k, v = randn(1, K, 2, 16, seed=33, dtype=torch.bfloat16), randn(1, K, 2, 16, seed=34, dtype=torch.bfloat16)
    f = first_key
    calls = [BlockCall(0, 6, f + 0, f + 6, Band(None, 0)), BlockCall(6, 10, f + 6, f + 10, Band(None, 0)),
             BlockCall(10, 16, f + 2, f + 9, None), BlockCall(16, 24, f + 12, f + 20, None),
             BlockCall(3, 9, f + 14, f + 18, None)]
    batched = kernel.forward_calls(q, k, v, calls, f, 0.3)
    single = BlockKernel.forward_calls(kernel, q, k, v, calls, f, 0.3)
    by_call = {c: (o, l) for c, o, l in single}
    assert sorted((c for c, _, _ in batched), key=repr) == sorted(calls, key=repr) and len(kernel._groups) == 1
    for c, o, l in batched:
        assert torch.equal(o, by_call[c][0]) and torch.allclose(l, by_call[c][1])
    out = torch.zeros_like(q)
    lse = torch.zeros(1, 4, S)
    for c, o, l in single:                           # any final out/lse rows exercise the backward's gathers
        out[:, c.q_start:c.q_end], lse[:, :, c.q_start:c.q_end] = o, l
    grads = {c: g for c, *g in kernel.backward_calls(dout, q, k, v, out, lse, calls, f, 0.3)}
    for c, *want in BlockKernel.backward_calls(kernel, dout, q, k, v, out, lse, calls, f, 0.3):
        assert all(torch.equal(a, b) for a, b in zip(grads[c], want)), c
