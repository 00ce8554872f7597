"""The flash_attn2 kernel through the real flash-attn releases (2.5.8, 2.6.3, 2.7.4.post1, 2.8.3.post2).

Each release's own Python layer runs (public functions, autograd Functions, from 2.7 its torch custom ops) over a
CPU ``flash_attn_2_cuda`` with the release's C++ positional arguments (megatron_2d_dev.flash_attn_package;
tools/install.sh installs the releases). A release's custom ops register once per process, so each release runs
in forked ranks. Checked per release: the extension's argument lists against the release's own calls; the
extension's conventions (bottom-right masks, windows, softcap, empty rows, both varlen lse layouts) against fp64;
FlashAttn2Kernel forward and backward (causal, full, windows, GQA, fp16/bf16, varlen groups); head dims the
backward cannot take, refused at selection; attention_2d with kernel="flash_attn2" on 4 ranks (causal, full, a
sliding window, GQA, packed documents in both modes through the varlen functions) against the fp64 reference.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools

import pytest
import torch

import megatron_2d
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.base import BlockKernel
from megatron_2d.kernels.flash_attn2 import FlashAttn2Kernel, packed_lse, padded_lse
from megatron_2d.layout.band import Band
from megatron_2d.layout.block_calls import BlockCall
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.testing.reference import (
    FLASH_CONVENTION_CASES,
    TOLERANCES,
    flash_reference,
    norm_err,
    packed_reference_attention,
    reference_attention,
    rel_err,
    rounded,
)
from megatron_2d_dev import flash_attn_package as fap
from megatron_2d_dev.torch_flash_cpu import kernel_on_cpu

TIMEOUT = GROUP_TIMEOUT
LOW = (torch.bfloat16, torch.float16)


def test_every_release_is_installed():
    missing = [v for v in fap.RELEASES if not fap.is_installed(v)]
    assert not missing, (
        f"flash-attn releases {missing} are not installed under {fap.releases_dir()}: run "
        f"'python -m megatron_2d_dev.flash_attn_package install' (tools/install.sh does)"
    )


# ---- the CPU extension's arguments, read from each release's own calls ------------------------------------------

# how the releases' Python layer names the C++ parameters it passes (the rest pass under the C++ name itself)
PYTHON_NAMES = {
    "dropout_p": "p_dropout",
    "causal": "is_causal",
    "alibi_slopes": "alibi_slopes_",
    "dq": "dq_",
    "dk": "dk_",
    "dv": "dv_",
    "block_table": "block_table_",
    "leftpad_k": "leftpad_k_",
    "window_size[0]": "window_size_left",
    "window_size[1]": "window_size_right",
}


def extension_calls(version):
    """{function: [positional argument of each call, as source text]} of the release's calls to its extension."""
    tree = ast.parse((fap.release_path(version) / "flash_attn" / "flash_attn_interface.py").read_text())
    calls = {}
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in ("flash_attn_cuda", "flash_attn_gpu")
            and func.attr in ("fwd", "bwd", "varlen_fwd", "varlen_bwd")
        ):
            assert not node.keywords, (version, func.attr)
            calls.setdefault(func.attr, []).append([ast.unparse(a) for a in node.args])
    return calls


@pytest.mark.parametrize("version", fap.RELEASES)
def test_extension_takes_each_releases_positional_arguments(version):
    """Each call the release's interface makes to fwd/bwd/varlen_fwd/varlen_bwd passes exactly the stand-in's
    parameters, in order (constants such as None and False sit where the C++ takes optionals and flags)."""
    abi = fap.abi_of(version)
    calls = extension_calls(version)
    assert sorted(calls) == ["bwd", "fwd", "varlen_bwd", "varlen_fwd"], sorted(calls)
    for fn, call_list in calls.items():
        for args in call_list:
            assert len(args) == len(abi.args[fn]), (version, fn, args)
            for text, param in zip(args, abi.args[fn]):
                if text not in ("None", "False", "True"):
                    assert PYTHON_NAMES.get(text, text) == param, (version, fn, text, param)


# ---- per release, in its own process: the extension, then the kernel ---------------------------------------------


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def errors_vs_reference(got, want, dtype):
    """{output: norm_err} of the outputs above their bound in the one tolerance table."""
    tol = TOLERANCES[dtype]
    return {
        key: norm_err(g, w)
        for key, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)
        if not norm_err(g, w) < tol.of(key)
    }


def private_call(interface, abi, q, k, v, dout, scale, causal, window, softcap):
    """The release's private forward and backward, by its own parameter names: (out, lse, dq, dk, dv)."""
    fwd_params = inspect.signature(
        getattr(interface._flash_attn_forward, "_init_fn", interface._flash_attn_forward)
    ).parameters
    win = (
        {"window_size_left": window[0], "window_size_right": window[1]}
        if "window_size_left" in fwd_params
        else {"window_size": window}
    )
    cap = {"softcap": softcap} if "softcap" in fwd_params else {}
    res = interface._flash_attn_forward(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        return_softmax=False,
        **win,
        **cap,
    )
    out, lse = (res[0], res[5]) if abi.fwd_returns_inputs else (res[0], res[1])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    interface._flash_attn_backward(
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
        **win,
        **cap,
    )
    return out, lse, dq, dk, dv


# trimmed bands as the ring passes them (local top-left coordinates: key j visible from query i iff lo <= j - i <= hi);
# the last ones on blocks with more queries than keys, where flash-attn's C++ would change their window (the right
# side reaching s_k becomes unbounded; an unbounded right side becomes s_k when the left one is bounded)
BANDS = [(16, 16, -5, 0), (12, 20, -2, 9), (16, 16, None, 3), (16, 16, -4, None), (10, 16, -3, 6)]
TALL_BANDS = [(64, 16, None, 0), (56, 16, -40, None), (48, 12, -36, 0), (40, 16, -30, 4)]


def run_release_kernel(rank, world, version):
    """Everything single-process of one release; returns {case: problem} (empty when all is well) and facts."""
    interface = fap.load_release(version)
    abi = fap.abi_of(version)
    extension = __import__("sys").modules["flash_attn_2_cuda"]
    problems, facts = {}, {}
    # the extension's conventions, through the release's private functions (softcap from 2.6)
    for sq, sk, causal, window, softcap in FLASH_CONVENTION_CASES:
        if softcap and "softcap" not in abi.args["fwd"]:
            continue
        q, dout = randn(2, sq, 4, 16, seed=1, dtype=torch.bfloat16), randn(2, sq, 4, 16, seed=2, dtype=torch.bfloat16)
        k, v = randn(2, sk, 2, 16, seed=3, dtype=torch.bfloat16), randn(2, sk, 2, 16, seed=4, dtype=torch.bfloat16)
        got = private_call(interface, abi, q, k, v, dout, 0.4, causal, window, softcap)
        want = flash_reference(q, k, v, dout, 0.4, causal, window, softcap)
        empty = torch.isinf(want[1])
        if not torch.equal(torch.isinf(got[1]), empty) or got[0][:, empty[0, 0]].any():
            problems[("empty rows", sq, sk)] = "lse +inf / out 0 where a row sees no key"
        finite = [x if i != 1 else x.masked_fill(empty, 0) for i, x in enumerate(got)]
        ref = [x if i != 1 else x.masked_fill(empty, 0) for i, x in enumerate(want)]
        # tiny blocks: each output against the end-to-end bound (a mask error is O(1))
        bad = {
            key: rel_err(g, w)
            for key, g, w in zip(("out", "lse", "dq", "dk", "dv"), finite, ref)
            if not rel_err(g, w) < TOLERANCES[torch.bfloat16].end_to_end
        }
        if bad:
            problems[("convention", sq, sk, causal, window, softcap)] = bad
    problems.update(varlen_window_against_max_seqlen_k(interface))
    with kernel_on_cpu(FlashAttn2Kernel):
        kernel = select_kernel(torch.device("cpu"), torch.bfloat16, "flash_attn2", head_dim=32)
        facts["backward_is_custom_op"] = hasattr(interface._flash_attn_backward, "_init_fn")
        for dtype, causal, hkv in itertools.product(LOW, (True, False), (4, 1)):
            sq, sk = 16, 16 if causal else 24
            q, dout = randn(2, sq, 4, 32, seed=11, dtype=dtype), randn(2, sq, 4, 32, seed=12, dtype=dtype)
            k, v = randn(2, sk, hkv, 32, seed=13, dtype=dtype), randn(2, sk, hkv, 32, seed=14, dtype=dtype)
            band = Band(None, 0) if causal else None
            out, lse = kernel.forward(q, k, v, band, 0.3)
            got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, band, 0.3))
            bad = errors_vs_reference(got, flash_reference(q, k, v, dout, 0.3, causal), dtype)
            if bad or lse.dtype != torch.float32 or got[2].dtype != dtype:
                problems[("kernel", str(dtype), causal, hkv)] = bad or "dtypes"
        for sq, sk, lo, hi in BANDS + TALL_BANDS:
            box = Band(lo, hi).trim(sq, sk)
            assert (box.q_start, box.q_end, box.k_start, box.k_end, box.band) == (0, sq, 0, sk, Band(lo, hi))
            q, dout = (
                randn(1, sq, 4, 32, seed=15, dtype=torch.bfloat16),
                randn(1, sq, 4, 32, seed=16, dtype=torch.bfloat16),
            )
            k, v = (randn(1, sk, 2, 32, seed=s, dtype=torch.bfloat16) for s in (17, 18))
            out, lse = kernel.forward(q, k, v, box.band, 0.3)
            got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, box.band, 0.3))
            window = (-1 if lo is None else sk - sq - lo, -1 if hi is None else hi - (sk - sq))  # top-left band
            bad = errors_vs_reference(got, flash_reference(q, k, v, dout, 0.3, False, window), torch.bfloat16)
            if bad:
                problems[("band", sq, sk, lo, hi)] = bad
        problems.update(varlen_equals_single_calls(kernel))
        problems.update(tall_calls_in_one_block(kernel))
        facts["padded_varlen_lse"] = kernel._padded_varlen_lse
        # a head dim the backward cannot take: refused at selection (before, it passed forward and failed backward)
        try:
            select_kernel(torch.device("cpu"), torch.bfloat16, "flash_attn2", head_dim=60)
            problems["head dim 60"] = "not refused at selection"
        except ValueError as err:
            facts["head_dim_60"] = str(err)
        q60 = randn(1, 8, 2, 60, seed=19, dtype=torch.bfloat16)
        out, lse = kernel.forward(q60, q60, q60, Band(None, 0), 0.3)
        try:
            kernel.backward(q60, q60, q60, q60, out, lse, Band(None, 0), 0.3)
            facts["backward_d60"] = "ran"
        except RuntimeError as err:
            facts["backward_d60"] = str(err).splitlines()[0]
    facts["extension_calls"] = dict(extension.calls)
    return problems, facts


def varlen_equals_single_calls(kernel):
    """A block's calls batched into varlen launches give each call's own result exactly (keys from first_key)."""
    problems = {}
    for f in (0, 5):
        q, dout = randn(1, 24, 4, 16, seed=31, dtype=torch.bfloat16), randn(1, 24, 4, 16, seed=32, dtype=torch.bfloat16)
        k, v = randn(1, 20, 2, 16, seed=33, dtype=torch.bfloat16), randn(1, 20, 2, 16, seed=34, dtype=torch.bfloat16)
        calls = [
            BlockCall(0, 6, f + 0, f + 6, Band(None, 0)),
            BlockCall(6, 10, f + 6, f + 10, Band(None, 0)),
            BlockCall(10, 16, f + 2, f + 9, None),
            BlockCall(16, 24, f + 12, f + 20, None),
            BlockCall(3, 9, f + 14, f + 18, None),
        ]
        batched = {c: (o, l) for c, o, l in kernel.forward_calls(q, k, v, calls, f, 0.3)}
        single = BlockKernel.forward_calls(kernel, q, k, v, calls, f, 0.3)
        out, lse = torch.zeros_like(q), torch.zeros(1, 4, 24)
        for c, o, l in single:
            out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end] = o, l
            if not (torch.equal(o, batched[c][0]) and torch.allclose(l, batched[c][1])):
                problems[("varlen forward", f, c)] = "differs from the single call"
        grads = {c: g for c, *g in kernel.backward_calls(dout, q, k, v, out, lse, calls, f, 0.3)}
        for c, *want in BlockKernel.backward_calls(kernel, dout, q, k, v, out, lse, calls, f, 0.3):
            if not all(torch.equal(a, b) for a, b in zip(grads[c], want)):
                problems[("varlen backward", f, c)] = "differs from the single call"
    return problems


def varlen_window_against_max_seqlen_k(interface):
    """The extension normalises a varlen call's window against max_seqlen_k, as the C++ does (not against each
    sequence): window (-1, 2) keeps its right side on a sequence of 4 queries and 2 keys when another has 6 keys,
    so that sequence's first query sees key 0 only."""
    cu_q, cu_k = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 2, 8], dtype=torch.int32)
    q, k, v = (randn(8, h, 16, seed=s, dtype=torch.bfloat16) for s, h in ((51, 4), (52, 2), (53, 2)))
    out, lse, _ = interface.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 4, 6, softmax_scale=0.4, window_size=(-1, 2), return_attn_probs=True
    )
    lse = packed_lse(lse, (0, 4, 8))
    problems = {}
    for n in range(2):
        rq, rk = slice(int(cu_q[n]), int(cu_q[n + 1])), slice(int(cu_k[n]), int(cu_k[n + 1]))
        want = flash_reference(q[rq][None], k[rk][None], v[rk][None], q[rq][None], 0.4, False, (-1, 2))
        errors = (rel_err(out[rq], want[0][0]), rel_err(lse[:, rq], want[1][0]))
        if not max(errors) < TOLERANCES[torch.bfloat16].end_to_end:
            problems[("varlen window against max_seqlen_k", n)] = errors
    return problems


def tall_calls_in_one_block(kernel):
    """Calls of one block with more queries than keys (as packed calls with a non-causal window make them), two of
    each band so that they share varlen launches: each call's out, lse, dq, dk, dv against fp64 on its own box."""
    problems = {}
    f = 3  # the block's keys start at first_key
    calls = [
        BlockCall(0, 4, f + 0, f + 2, Band(None, 0)),
        BlockCall(4, 11, f + 2, f + 4, Band(-5, None)),
        BlockCall(11, 15, f + 4, f + 6, Band(None, 0)),
        BlockCall(15, 22, f + 6, f + 8, Band(-5, None)),
        BlockCall(22, 30, f + 8, f + 11, Band(-6, 0)),
    ]
    q, dout = randn(1, 30, 4, 16, seed=41, dtype=torch.bfloat16), randn(1, 30, 4, 16, seed=42, dtype=torch.bfloat16)
    k, v = randn(1, 14, 2, 16, seed=43, dtype=torch.bfloat16), randn(1, 14, 2, 16, seed=44, dtype=torch.bfloat16)
    for batched in (True, False):  # the kernel's varlen launches, and one call at a time
        forward = kernel.forward_calls if batched else functools.partial(BlockKernel.forward_calls, kernel)
        backward = kernel.backward_calls if batched else functools.partial(BlockKernel.backward_calls, kernel)
        out, lse = torch.zeros_like(q), torch.zeros(1, 4, 30)
        for c, o, l in forward(q, k, v, calls, f, 0.3):
            out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end] = o, l
        dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
        for c, gq, gk, gv in backward(dout, q, k, v, out, lse, calls, f, 0.3):
            dq[:, c.q_start : c.q_end] += gq.float()
            dk[:, c.k_start - f : c.k_end - f] += gk.float()
            dv[:, c.k_start - f : c.k_end - f] += gv.float()
        for c in calls:
            rows, keys = slice(c.q_start, c.q_end), slice(c.k_start - f, c.k_end - f)
            nq, nk = c.q_end - c.q_start, c.k_end - c.k_start
            lo, hi = c.band.lo, c.band.hi
            window = (-1 if lo is None else nk - nq - lo, -1 if hi is None else hi - (nk - nq))  # top-left band
            want = flash_reference(q[:, rows], k[:, keys], v[:, keys], dout[:, rows], 0.3, False, window)
            got = (out[:, rows], lse[:, :, rows], dq[:, rows], dk[:, keys], dv[:, keys])
            bad = {
                key: rel_err(g, w)
                for key, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)
                if not rel_err(g, w) < TOLERANCES[torch.bfloat16].end_to_end
            }
            if bad:
                problems[("tall call", "varlen" if batched else "single", c)] = bad
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("version", fap.RELEASES)
def test_kernel_through_release(version):
    ((problems, facts),) = run_on_ranks(1, run_release_kernel, version, timeout_s=120)
    assert not problems, problems
    abi = fap.abi_of(version)
    assert facts["backward_is_custom_op"] == (abi.name == "2.7")  # the objects the issue is about
    assert facts["padded_varlen_lse"] == abi.padded_varlen_lse  # both varlen lse layouts covered
    assert "head dim 60 is not supported by the flash kernels" in facts["head_dim_60"]
    assert facts["backward_d60"] == "head_size should be a multiple of 8"  # what the refusal prevents
    calls = facts["extension_calls"]
    assert all(calls[fn] > 0 for fn in ("fwd", "bwd", "varlen_fwd", "varlen_bwd")), calls


# ---- attention_2d with kernel="flash_attn2" on 4 ranks, per release ----------------------------------------------


# (mode, causal, sliding window) of the packed cases: causal, and non-causal windows bounded on both sides, on the
# left only and on the right only (zigzag mode: their calls include some with more queries than keys)
PACKED_CASES = [
    ("zigzag", True, (-1, -1)),
    ("zigzag", False, (4, 4)),
    ("zigzag", False, (9, -1)),
    ("zigzag", False, (-1, 9)),
    ("documents", True, (-1, -1)),
    ("documents", False, (4, 4)),
]


def run_release_ring(rank, world, version):
    fap.load_release(version)
    extension = __import__("sys").modules["flash_attn_2_cuda"]
    errors = {}
    with kernel_on_cpu(FlashAttn2Kernel):
        groups = megatron_2d.build_2d_groups(2, 1, "context_first", timeout=TIMEOUT)
        shard = lambda x: megatron_2d.shard_sequence(x.detach(), rank, world)  # noqa: E731
        for causal, hkv, window in ((True, 8, (-1, -1)), (False, 2, (-1, -1)), (True, 2, (12, 0)), (False, 2, (10, 6))):
            g = torch.Generator().manual_seed(21)
            q, k, v, dout = (
                rounded(torch.randn(2 * world * 12, 2, h, 64, generator=g, dtype=torch.float64), torch.bfloat16)
                for h in (8, hkv, hkv, 8)
            )
            for x in (q, k, v):
                x.requires_grad_(True)
            reference_attention(q, k, v, causal, 64**-0.5, window=window).backward(dout)
            ql, kl, vl = (shard(x).bfloat16().requires_grad_(True) for x in (q, k, v))
            out = megatron_2d.attention_2d(
                ql, kl, vl, groups, causal=causal, kernel="flash_attn2", sliding_window=window
            )
            out.backward(shard(dout).bfloat16())
            ref = reference_attention(q.detach(), k.detach(), v.detach(), causal, 64**-0.5, window=window)
            for key, a, e in (
                ("out", out, ref),
                ("dq", ql.grad, q.grad),
                ("dk", kl.grad, k.grad),
                ("dv", vl.grad, v.grad),
            ):
                errors[(causal, hkv, window, key)] = norm_err(a, shard(e))
        before = extension.calls["varlen_fwd"], extension.calls["varlen_bwd"]
        tall = 0  # windowed calls with more queries than keys + 1: those whose window flash-attn's C++ would change
        for mode, causal, window in PACKED_CASES:
            lengths = [3, 40, 1, 17, 64, 9, 5, 30]
            cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
            layout = megatron_2d.PackedSharding(cu, groups, mode=mode)
            g = torch.Generator().manual_seed(4)
            q, k, v, dout = (
                rounded(torch.randn(int(cu[-1]), h, 32, generator=g, dtype=torch.float64), torch.bfloat16)
                for h in (8, 2, 2, 8)
            )
            for x in (q, k, v):
                x.requires_grad_(True)
            ref = packed_reference_attention(q, k, v, cu, causal, 32**-0.5, window=window)
            ref.backward(dout)
            ql, kl, vl = (layout.shard(x.detach()).bfloat16().requires_grad_(True) for x in (q, k, v))
            out = megatron_2d.attention_2d(
                ql, kl, vl, groups, causal=causal, kernel="flash_attn2", packing=layout, sliding_window=window
            )
            out.backward(layout.shard(dout).bfloat16())
            for key, a, e in (
                ("out", out, ref),
                ("dq", ql.grad, q.grad),
                ("dk", kl.grad, k.grad),
                ("dv", vl.grad, v.grad),
            ):
                errors[(mode, causal, window, key)] = norm_err(a, layout.shard(e.detach()))
            if window != (-1, -1):
                sliding = megatron_2d.SlidingWindow.of(window, causal, layout.max_document_length)
                by_source = layout.calls(causal, sliding)
                tall += sum(
                    c.band is not None and c.q_end - c.q_start > c.k_end - c.k_start + 1
                    for calls in by_source.values()
                    for c in calls
                )
    varlen = (extension.calls["varlen_fwd"] - before[0], extension.calls["varlen_bwd"] - before[1])
    return errors, varlen, tall


@pytest.mark.distributed
@pytest.mark.parametrize("version", fap.RELEASES)
def test_attention_2d_through_release(version):
    """hp 2 x cp 2 (context_first): head all-to-all and ring, flash_attn2 in every block; packed documents go
    through the release's varlen functions (both lse layouts across the releases), causal and with non-causal
    sliding windows, whose calls include some with more queries than keys (where flash-attn's C++ would change the
    window: the kernel splits them)."""
    tol = TOLERANCES[torch.bfloat16]
    results = run_on_ranks(4, run_release_ring, version, timeout_s=180)
    for errors, (varlen_fwd, varlen_bwd), _ in results:
        bad = {case: e for case, e in errors.items() if not e < tol.of(case[-1])}
        assert not bad, bad
        assert len(errors) == 4 * 4 + len(PACKED_CASES) * 4
        assert varlen_fwd > 0 and varlen_bwd > 0
    assert sum(tall for _, _, tall in results) > 0  # the cases reach the blocks this is about


def test_varlen_lse_layouts_round_trip():
    """Older flash-attn 2 returned varlen lse as [n, h, max_seqlen]; both layouts give the same rows."""
    lse, offsets = torch.randn(3, 10), (0, 4, 10)
    padded = padded_lse(lse, offsets, 6)
    assert padded.shape == (2, 3, 6) and torch.equal(padded[0, :, 4:], torch.zeros(3, 2))
    assert torch.equal(packed_lse(padded, offsets), lse) and packed_lse(lse, offsets) is lse
