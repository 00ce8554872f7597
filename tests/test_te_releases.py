"""The te_fused kernel through real Transformer Engine releases (2.5.0, 2.8.0, 2.12.0, 2.20.2).

Each release's whole PyTorch layer imports and runs (``transformer_engine.pytorch``, its ``fused_attn_fwd`` /
``fused_attn_bwd``) over a CPU ``transformer_engine_torch`` taking the release's positional arguments
(megatron_2d_dev.te_package; tools/install.sh installs the releases). Each release runs in forked ranks (one TE
per process). Checked per release: the extension's argument lists against the release's own calls; TeFusedKernel
forward and backward against fp64 (causal squares, full blocks with MLA head dims, tall causal calls, windows,
two-sided bands, a packed block's THD launches, both THD stats layouts), and its max logit (from TE's launches where
the release returns one); attention_2d with kernel="te_fused" on 4 ranks (causal, full, a sliding window, GQA, packed
documents, with the max logit) against the fp64 reference, oldest and newest release.
"""

from __future__ import annotations

import ast
import itertools
import sys

import pytest
import torch

import megatron_2d
from megatron_2d.kernels.merge import merge_attention_
from megatron_2d.kernels.te_fused import TeFusedKernel
from megatron_2d.layout.band import Band
from megatron_2d.layout.block_calls import BlockCall
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.testing.reference import (
    TOLERANCES,
    max_logit_reference,
    norm_err,
    packed_reference_attention,
    reference_attention,
    rel_err,
    rounded,
)
from megatron_2d_dev import te_package as tep
from megatron_2d_dev.torch_flash_cpu import kernel_on_cpu

TIMEOUT = GROUP_TIMEOUT
BF16 = TOLERANCES[torch.bfloat16]


@pytest.fixture(scope="module")
def forked_loads_prepared():
    """Each forked rank loads its release; what every load reads the same way (the extension's names, the shared
    dependencies) is read once here and inherited (te_package.prepare_forked_loads)."""
    tep.prepare_forked_loads()


def test_every_release_is_installed():
    missing = [v for v in tep.RELEASES if not tep.is_installed(v)]
    assert not missing, (
        f"Transformer Engine releases {missing} are not installed under {tep.releases_dir()}: run "
        f"'python -m megatron_2d_dev.te_package install' (tools/install.sh does)"
    )


def extension_calls(version):
    """{function: [positional argument of each call, as source text]} of the release's calls to tex.fused_attn_*."""
    path = tep.release_path(version) / "transformer_engine" / "pytorch" / "cpp_extensions" / "fused_attn.py"
    calls = {}
    for node in ast.walk(ast.parse(path.read_text())):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "tex":
            if func.attr in ("fused_attn_fwd", "fused_attn_bwd"):
                assert not node.keywords, (version, func.attr)
                calls.setdefault(func.attr, []).append([ast.unparse(a) for a in node.args])
    return calls


@pytest.mark.parametrize("version", tep.RELEASES)
def test_extension_takes_each_releases_positional_arguments(version):
    """The release's one call of each function passes exactly the stand-in's parameters, in order (an enum argument
    named by the string it is looked up from: ``QKVLayout[qkv_layout]`` is qkv_layout)."""
    abi = tep.abi_of(version)
    calls = extension_calls(version)
    assert sorted(calls) == ["fused_attn_bwd", "fused_attn_fwd"] and all(len(c) == 1 for c in calls.values())
    for fn, names in (("fused_attn_fwd", abi.fwd), ("fused_attn_bwd", abi.bwd)):
        (args,) = calls[fn]
        assert [a.split("[")[1].rstrip("]") if "[" in a else a for a in args] == list(names), (version, fn)


# ---- per release, in its own process: the kernel on one block ----------------------------------------------------

BLOCKS = {  # name: (band, s_q, s_k, batch, (head dim qk, v))
    "causal square": (Band(None, 0), 64, 64, 2, (16, 16)),
    "full, MLA head dims": (None, 32, 48, 2, (24, 16)),
    "causal, more queries than keys": (Band(None, 0), 48, 16, 1, (16, 16)),
    "window of 16 keys": (Band(-15, 0), 256, 256, 2, (16, 16)),
    "two-sided band": (Band(-9, 12), 80, 96, 2, (16, 16)),
}
PACKED = [  # disjoint rows and keys
    BlockCall(0, 12, 0, 12, Band(None, 0)),
    BlockCall(12, 20, 12, 24, None),
    BlockCall(20, 40, 24, 36, Band(None, 0)),
    BlockCall(40, 48, 36, 48, Band(None, 4)),
]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).bfloat16()


def block_reference(q, k, v, dout, band, scale):
    """fp64 (out, lse, dq, dk, dv) of one block under ``band`` (local coordinates)."""
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    offset = torch.arange(k.shape[1])[None] - torch.arange(q.shape[1])[:, None]
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if band is not None and band.lo is not None:
        hidden |= offset < band.lo
    if band is not None and band.hi is not None:
        hidden |= offset > band.hi
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1].repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), leaves[2].repeat_interleave(rep, 2))
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), *(x.grad for x in leaves)


def block_max_logit(q, k, calls, scale):
    """[h] fp64: the max of scale * q . k over the pairs of ``calls`` (local band coordinates), brute force."""
    rep = q.shape[2] // k.shape[2]
    best = torch.full((q.shape[2],), float("-inf"), dtype=torch.float64)
    for c in calls:
        qc, kc = q[:, c.q_start : c.q_end].double(), k[:, c.k_start : c.k_end].double().repeat_interleave(rep, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale
        offset = torch.arange(kc.shape[1])[None] - torch.arange(qc.shape[1])[:, None]
        hidden = torch.zeros_like(offset, dtype=torch.bool)
        if c.band is not None and c.band.lo is not None:
            hidden |= offset < c.band.lo
        if c.band is not None and c.band.hi is not None:
            hidden |= offset > c.band.hi
        best = torch.maximum(best, s.masked_fill(hidden, float("-inf")).amax(dim=(0, 2, 3)))
    return best


def max_logit_of(kernel, q, k, v, calls, scale):
    """(error / bound, whether it came from TE's launches) of forward_calls_with_max on one block: TE's max has
    O's dtype (bf16), the separate pass's fp32 (on CPU), so a max every value of which is a bf16 number came from
    TE (the chance that 4 fp32 maxima of 24 / 16-dim products all are is nil)."""
    _, got = kernel.forward_calls_with_max(q, k, v, calls, 0, scale)
    err = rel_err(got, block_max_logit(q, k, calls, scale)) / BF16.max_logit
    return err, bool(torch.equal(got, got.bfloat16().float()))


def run_release_kernel(rank, world, version, thd_stats):
    """Every block case and the packed block through TeFusedKernel: {case: {output: error / bound}}, launches, and
    per case whether its max logit came from TE's launches."""
    tep.load_release(version, thd_stats)
    extension = sys.modules["transformer_engine_torch"]
    ratios, launches, from_te = {}, {}, {}
    with kernel_on_cpu(TeFusedKernel):
        kernel = TeFusedKernel()
        for name, (band, sq, sk, b, (d, dv)) in BLOCKS.items():
            q, k, v = randn(b, sq, 4, d, seed=1), randn(b, sk, 2, d, seed=2), randn(b, sk, 2, dv, seed=3)
            dout = randn(b, sq, 4, dv, seed=4)
            extension.calls.clear()
            out, lse = kernel.forward(q, k, v, band, 0.3)
            grads = kernel.backward(dout, q, k, v, out, lse, band, 0.3)
            launches[name] = dict(extension.calls)
            want = block_reference(q, k, v, dout, band, 0.3)
            # a call cut into pieces adds up to three bf16 partials per dQ row: the end-to-end bound for it
            ratios[name] = {
                key: (rel_err(a, e) / BF16.end_to_end if key == "dq" and launches[name]["fused_attn_fwd"] > 1
                      else norm_err(a, e) / BF16.of(key))
                for key, a, e in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want)
            }  # fmt: skip
            whole = [BlockCall(0, sq, 0, sk, band)]
            ratios[name]["max_logit"], from_te[name] = max_logit_of(kernel, q, k, v, whole, 0.3)
        q, k, v, dout = (randn(1, 48, h, 24, seed=10 + i) for i, h in enumerate((4, 2, 2, 4)))
        extension.calls.clear()
        out, lse = torch.zeros(1, 48, 4, 24), torch.full((1, 4, 48), float("-inf"))
        for c, o, m in kernel.forward_calls(q, k, v, PACKED, 0, 0.3):
            merge_attention_(out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end], o, m)
        dq, dk, dv = (torch.zeros(x.shape) for x in (q, k, v))
        for c, gq, gk, gv in kernel.backward_calls(dout, q, k, v, out.bfloat16(), lse, PACKED, 0, 0.3):
            dq[:, c.q_start : c.q_end] += gq
            dk[:, c.k_start : c.k_end] += gk
            dv[:, c.k_start : c.k_end] += gv
        launches["packed"] = dict(extension.calls)
        packed_max, from_te["packed"] = max_logit_of(kernel, q, k, v, PACKED, 0.3)
        ratios["packed max_logit"] = {"max_logit": packed_max}
        for c in PACKED:
            rows, keys = slice(c.q_start, c.q_end), slice(c.k_start, c.k_end)
            want = block_reference(q[:, rows], k[:, keys], v[:, keys], dout[:, rows], c.band, 0.3)
            got = (out[:, rows], lse[:, :, rows], dq[:, rows], dk[:, keys], dv[:, keys])
            ratios[("packed", c)] = {
                key: (norm_err(a, e) / BF16.of(key) if key in ("out", "lse") else rel_err(a, e) / BF16.end_to_end)
                for key, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, want)
            }
        version_seen = kernel.version
    return ratios, launches, version_seen, kernel._padded_thd_stats, from_te


@pytest.mark.distributed
@pytest.mark.parametrize(
    "version, thd_stats",
    [(v, "packed") for v in tep.RELEASES] + [("2.5.0", "padded"), ("2.12.0", "padded"), ("2.20.2", "padded")],
)
def test_kernel_through_release(forked_loads_prepared, version, thd_stats):
    """TeFusedKernel over the release's fused_attn_fwd / fused_attn_bwd: causal squares and full blocks one launch
    each way, other bands and packed blocks at most two (THD: no bound on the pieces' lengths), exact against
    fp64; the THD stats layout the extension returns is the one given back. The max logit is exact too, and comes
    from TE's launches (return_max_logit) from 2.12 on (2.9 on), except THD launches of 2.12 with the padded layout
    (its max comes back [h, 1], padded rows included: the separate pass takes over)."""
    ((ratios, launches, seen, padded, from_te),) = run_on_ranks(
        1, run_release_kernel, version, thd_stats, timeout_s=180
    )
    bad = {case: r for case, r in ratios.items() if not all(x < 1 for x in r.values())}
    assert not bad, bad
    assert seen == version and padded == (thd_stats == "padded")
    with_max = version not in ("2.5.0", "2.8.0")
    for case, took in from_te.items():
        dense = case != "packed" and launches[case]["fused_attn_fwd"] == 1
        assert took == (with_max and (dense or (version, thd_stats) != ("2.12.0", "padded"))), (case, took)
    one = {"fused_attn_fwd": 1, "fused_attn_bwd": 1}
    assert launches["causal square"] == launches["full, MLA head dims"] == one
    assert all(launches[n] == {"fused_attn_fwd": 2, "fused_attn_bwd": 2} for n in BLOCKS if n not in
               ("causal square", "full, MLA head dims"))  # fmt: skip
    assert launches["packed"] == {"fused_attn_fwd": 2, "fused_attn_bwd": 2}


# ---- attention_2d with kernel="te_fused" on 4 ranks, per release -------------------------------------------------


def run_release_ring(rank, world, version):
    tep.load_release(version)
    errors = {}
    with kernel_on_cpu(TeFusedKernel):
        groups = megatron_2d.build_2d_groups(2, 1, "context_first", timeout=TIMEOUT)
        shard = lambda x: megatron_2d.shard_sequence(x.detach(), rank, world)  # noqa: E731
        for causal, hkv, window in ((True, 8, (-1, -1)), (False, 2, (-1, -1)), (True, 2, (12, 0))):
            g = torch.Generator().manual_seed(21)
            q, k, v, dout = (
                rounded(torch.randn(2 * world * 12, 2, h, 32, generator=g, dtype=torch.float64), torch.bfloat16)
                for h in (8, hkv, hkv, 8)
            )
            for x in (q, k, v):
                x.requires_grad_(True)
            reference_attention(q, k, v, causal, 32**-0.5, window=window).backward(dout)
            ql, kl, vl = (shard(x).bfloat16().requires_grad_(True) for x in (q, k, v))
            out, max_logit = megatron_2d.attention_2d(
                ql, kl, vl, groups, causal=causal, kernel="te_fused", sliding_window=window, return_max_logit=True
            )
            out.backward(shard(dout).bfloat16())
            ref = reference_attention(q.detach(), k.detach(), v.detach(), causal, 32**-0.5, window=window)
            full = torch.tensor([0, q.shape[0]])
            ref_max = max_logit_reference(q.detach(), k.detach(), full, causal, 32**-0.5, window)
            errors[(causal, hkv, window, "max_logit")] = rel_err(max_logit, ref_max)
            for key, a, e in (
                ("out", out, ref),
                ("dq", ql.grad, q.grad),
                ("dk", kl.grad, k.grad),
                ("dv", vl.grad, v.grad),
            ):
                errors[(causal, hkv, window, key)] = rel_err(a, shard(e))
        for mode, causal in (("zigzag", True), ("documents", True), ("zigzag", False)):
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
            packed_reference_attention(q, k, v, cu, causal, 32**-0.5).backward(dout)
            ql, kl, vl = (layout.shard(x.detach()).bfloat16().requires_grad_(True) for x in (q, k, v))
            out, max_logit = megatron_2d.attention_2d(
                ql, kl, vl, groups, causal=causal, kernel="te_fused", packing=layout, return_max_logit=True
            )
            out.backward(layout.shard(dout).bfloat16())
            ref = packed_reference_attention(q.detach(), k.detach(), v.detach(), cu, causal, 32**-0.5)
            ref_max = max_logit_reference(q.detach(), k.detach(), cu, causal, 32**-0.5)
            errors[(mode, causal, "max_logit")] = rel_err(max_logit, ref_max)
            for key, a, e in (
                ("out", out, ref),
                ("dq", ql.grad, q.grad),
                ("dk", kl.grad, k.grad),
                ("dv", vl.grad, v.grad),
            ):
                errors[(mode, causal, key)] = rel_err(a, layout.shard(e))
    return errors, dict(sys.modules["transformer_engine_torch"].calls)


@pytest.mark.distributed
@pytest.mark.parametrize("version", [tep.RELEASES[0], tep.RELEASES[-1]])
def test_attention_2d_through_release(forked_loads_prepared, version):
    """hp 2 x cp 2 (context_first): head all-to-all and ring, te_fused in every block (causal, full with GQA, a
    causal sliding window, packed documents in both modes), within the bf16 end-to-end bound. The oldest and newest
    release (every release's kernel calls are checked above; TE's import costs each rank seconds)."""
    results = run_on_ranks(4, run_release_ring, version, timeout_s=240)
    for errors, calls in results:
        bad = {
            case: e
            for case, e in errors.items()
            if not e < (BF16.max_logit if case[-1] == "max_logit" else BF16.end_to_end)
        }
        assert not bad, bad
        assert len(errors) == 3 * 5 + 3 * 5 and calls["fused_attn_fwd"] > 0 and calls["fused_attn_bwd"] > 0
