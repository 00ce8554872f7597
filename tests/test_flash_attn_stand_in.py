"""The hand-written CPU stand-in of flash-attn's API (megatron_2d_dev.flash_attn_cpu), which the benchmarks
install for ring-flash-attn (any float dtype), against an independent fp64 computation of flash-attn's
conventions (mask alignment, window, softcap, lse layouts, empty rows, softmax_d, dtypes). Our flash_attn2 kernel
is tested through the real flash-attn releases in tests/test_flash_attn_releases.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_2d.testing.reference import FLASH_CONVENTION_CASES, flash_reference, rel_err
from megatron_2d_dev import flash_attn_cpu


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def run_private(api, q, k, v, dout, scale, causal, window, softcap=0.0):
    """The stand-in's private forward and backward: (out, lse, dq, dk, dv, softmax_d)."""
    win = {"window_size_left": window[0], "window_size_right": window[1]}
    out, lse, _, _ = api._flash_attn_forward(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        return_softmax=False,
        softcap=softcap,
        **win,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = api._flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        softcap=softcap,
        **win,
    )
    return out, lse, dq, dk, dv, softmax_d


# ---- the stand-in against flash-attn's documented conventions ---------------------------------------------------


@pytest.mark.parametrize(
    "sq, sk, causal, window, softcap",
    FLASH_CONVENTION_CASES,
    ids=[
        f"q{a}-k{b}-{'causal' if c else 'full'}-win{w[0]}_{w[1]}-cap{s:g}" for a, b, c, w, s in FLASH_CONVENTION_CASES
    ],
)
def test_stand_in_follows_flash_attn_conventions(sq, sk, causal, window, softcap):
    api = flash_attn_cpu._build_api(strict_dtypes=False)
    q, dout = randn(2, sq, 4, 16, seed=1), randn(2, sq, 4, 16, seed=2)
    k, v = randn(2, sk, 2, 16, seed=3), randn(2, sk, 2, 16, seed=4)
    out, lse, dq, dk, dv, softmax_d = run_private(api, q, k, v, dout, 0.4, causal, window, softcap)
    want = flash_reference(q, k, v, dout, 0.4, causal, window, softcap)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))  # empty rows: +inf, as flash-attn
    finite = torch.isfinite(want[1])
    assert (lse[finite] - want[1][finite]).abs().max() < 1e-5
    # lse is fp32 (as flash-attn's) and the backward rebuilds P from it, so fp64 gradients carry ~1e-7
    assert rel_err(out, want[0]) < 1e-10
    for got, ref in zip((dq, dk, dv), want[2:]):
        assert rel_err(got, ref) < 1e-6
    assert softmax_d.shape == (2, 4, 128) and not softmax_d[..., sq:].any()
    assert rel_err(softmax_d[..., :sq], (dout * out).sum(-1).transpose(1, 2)) < 1e-6


def test_empty_rows_give_zero_output_and_zero_gradient():
    api = flash_attn_cpu._build_api(strict_dtypes=False)
    q, dout, k, v = randn(1, 6, 2, 8, seed=5), randn(1, 6, 2, 8, seed=6), randn(1, 3, 2, 8), randn(1, 3, 2, 8)
    out, lse, dq, _, _, _ = run_private(api, q, k, v, dout, 0.5, True, (-1, -1))
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, :3] > 0).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert not out[:, :3].any() and not dq[:, :3].any()


def test_varlen_layouts():
    """Varlen: tokens packed as [total, h, d]; lse [h, total_q]; softmax_d [h, total_q + 128 * batch]; each
    sequence equals the padded function on it alone."""
    api = flash_attn_cpu._build_api(strict_dtypes=False)
    lens_q, lens_k = [5, 3, 8], [5, 7, 8]
    cu_q = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, dout, k, v = randn(16, 4, 8, seed=7), randn(16, 4, 8, seed=8), randn(20, 2, 8, seed=9), randn(20, 2, 8)
    out, lse, s_dmask = api.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 8, 8, causal=True, window_size=(4, -1), return_attn_probs=True
    )
    assert lse.shape == (4, 16) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = api._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 8, 8, 0.0, 8**-0.5, True, 4, -1, 0.0, None, False
    )
    assert softmax_d.shape == (4, 16 + 128 * 3)
    for n in range(3):
        rq, rk = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        want = flash_reference(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], 8**-0.5, True, (4, -1))
        assert rel_err(out[rq], want[0][0]) < 1e-10 and rel_err(dq[rq], want[2][0]) < 1e-6
        assert rel_err(dk[rk], want[3][0]) < 1e-6 and rel_err(dv[rk], want[4][0]) < 1e-6
        assert (lse[:, rq] - want[1][0]).abs().max() < 1e-5
    assert lens_q == [int(x) for x in cu_q.diff()] and lens_k == [int(x) for x in cu_k.diff()]


def test_public_function_return_switch_and_defaults():
    package, _ = flash_attn_cpu.flash_attn_modules()
    q, k, v = (randn(1, 8, 2, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    out = package.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    out2, lse, s_dmask = package.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 8) and s_dmask.numel() == 0
    # softmax_scale None is 1/sqrt(d)
    assert torch.equal(out, package.flash_attn_func(q, k, v, softmax_scale=16**-0.5, causal=True))


def test_stand_in_refuses_what_flash_attn_refuses_or_it_does_not_implement():
    package, interface = flash_attn_cpu.flash_attn_modules()
    q = randn(1, 8, 2, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        package.flash_attn_func(q, q, q)
    qb = q.bfloat16()
    with pytest.raises(NotImplementedError, match="dropout"):
        package.flash_attn_func(qb, qb, qb, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi"):
        package.flash_attn_func(qb, qb, qb, alibi_slopes=torch.ones(2))


def test_stand_in_has_flash_attns_signatures():
    """The private and public signatures as flash-attn 2.7 declares them (names and order)."""
    _, interface = flash_attn_cpu.flash_attn_modules()
    head = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal"]
    assert list(inspect.signature(interface._flash_attn_backward).parameters) == head + [
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "deterministic",
        "rng_state",
    ]
    public = list(inspect.signature(interface.flash_attn_func).parameters)
    assert public[:7] == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size"]
    assert public[-1] == "return_attn_probs" and "softcap" in public


# ---- the C++'s window normalisation, which the CPU stand-ins of the compiled kernels apply ---------------------


@pytest.mark.parametrize(
    "causal, window, seqlen_k, expected",
    [
        (False, (-1, -1), 8, (False, -1, -1)),  # no window
        (True, (-1, -1), 8, (True, -1, -1)),  # causal
        (False, (-1, 0), 8, (True, -1, -1)),  # set_params_fprop: left < 0 and right == 0 is the causal kernel
        (True, (3, -1), 8, (False, 3, 0)),  # causal caps the right side at 0
        (False, (3, 2), 8, (False, 3, 2)),  # kept
        (False, (8, 2), 8, (False, 8, 2)),  # left >= s_k: -1, then s_k again, the right side being bounded
        (False, (2, 8), 8, (False, 2, 8)),  # right >= s_k: -1, then s_k
        (False, (2, 20), 8, (False, 2, 8)),  # right 20 runs as 8: too few keys once a block has 10+ queries
        (False, (-1, 8), 8, (False, -1, -1)),  # right >= s_k with the left unbounded: no window (every later key)
        (False, (3, -1), 8, (False, 3, 8)),  # an unbounded side next to a bounded one: s_k
        (False, (9, 9), 8, (False, -1, -1)),  # both >= s_k: no window
        (False, (-1, 5), 8, (False, 8, 5)),
    ],
)
def test_kernel_window_is_the_cpp_normalisation(causal, window, seqlen_k, expected):
    """flash_api.cpp (flash-attn 2.5.8 to 2.8.3 and PyTorch's copy): mha_fwd / mha_bwd turn a side >= seqlen_k
    into -1 and causal into right = 0; set_params_fprop takes left < 0 with right == 0 as causal and sets a -1 side
    to seqlen_k when the other side is bounded (varlen: max_seqlen_k throughout)."""
    assert flash_attn_cpu.kernel_window(causal, *window, seqlen_k) == expected
