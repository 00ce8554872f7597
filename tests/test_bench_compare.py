"""tools/bench_compare.py (megatron_2d_dev.bench.compare): the CPU flash_attn stand-in, the fp64 reference, the
correctness gate, an end-to-end run.

No timing is asserted: only that every row has a finite time and an error below the bf16 tolerance. ring-flash-attn
is a test dependency (requirements-dev.txt): when it does not import, the tests that need it fail, saying so.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import megatron_2d
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, reference_attention, rel_err
from megatron_2d_dev import flash_attn_cpu
from megatron_2d_dev.bench import compare as bench_compare
from megatron_2d_dev.bench import runners as bench_runners
from megatron_2d_dev.bench.harness import round_order

BF16_TOLERANCE = TOLERANCES[torch.bfloat16].end_to_end


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _tiny_args(*extra):
    return bench_compare.parse_args(
        [
            "--ranks",
            "4",
            "--seq",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--dim",
            "16",
            "--repeats",
            "1",
            "--quiet",
            *extra,
        ]
    )


def _require_ring_flash_attn():
    """Load ring-flash-attn's zigzag module through the stand-in, or FAIL (not skip) with the fix."""
    try:
        with flash_attn_cpu.flash_attn_stand_in():
            return flash_attn_cpu.load_ring_flash_attn_module("zigzag_ring_flash_attn")
    except ImportError as err:
        pytest.fail(f"ring-flash-attn is required for these tests (pip install -r requirements-dev.txt): {err}")


# -- the stand-in kernel ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "causal,hkv,dtype",
    [
        (True, 4, torch.float64),  # causal MHA
        (False, 4, torch.float64),  # full attention (the zigzag ring's off-diagonal blocks)
        (True, 2, torch.float64),  # GQA: 2 query heads per K/V head
        (True, 1, torch.float32),  # MQA in fp32
    ],
)
def test_stand_in_matches_reference_with_lse(causal, hkv, dtype):
    b, s, hq, d = 2, 48, 4, 16
    q, dout = (_randn(b, s, hq, d, seed=i).to(dtype) for i in (0, 1))
    k, v = (_randn(b, s, hkv, d, seed=i).to(dtype) for i in (2, 3))
    scale = 0.3
    out, lse, _, _ = flash_attn_cpu._flash_attn_forward(q, k, v, 0.0, scale, causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = flash_attn_cpu._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal)

    t = lambda x: x.transpose(0, 1).to(torch.float64).requires_grad_(True)  # noqa: E731  bshd -> sbhd leaf
    qr, kr, vr = t(q), t(k), t(v)
    ref = reference_attention(qr, kr, vr, causal, scale)
    ref.backward(dout.transpose(0, 1).to(torch.float64))
    scores = torch.einsum("qbhd,kbhd->bhqk", qr, kr.repeat_interleave(hq // hkv, dim=2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    # lse is fp32 whatever the dtype (as flash-attn's), so even fp64 gradients carry its rounding (~1e-7).
    tol_out, tol_grad = (1e-10, 1e-6) if dtype == torch.float64 else (1e-5, 1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, s)
    assert rel_err(lse, torch.logsumexp(scores, dim=-1)) < 1e-6
    assert rel_err(out.transpose(0, 1), ref) < tol_out
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel_err(got.transpose(0, 1), want) < tol_grad
    # softmax_d as flash-attn returns it: fp32 rowsum(dout * out), rows padded to a multiple of 128 with zeros
    assert softmax_d.dtype == torch.float32 and softmax_d.shape == (b, hq, 128)
    assert rel_err(softmax_d[..., :s], (dout.double() * out.double()).sum(-1).transpose(1, 2)) < 1e-5
    assert not softmax_d[..., s:].any()


def test_stand_in_refuses_what_it_does_not_implement():
    q = _randn(1, 8, 2, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_cpu._flash_attn_forward(q, q, q, 0.1, None, False)
    with pytest.raises(NotImplementedError, match="alibi"):
        flash_attn_cpu._flash_attn_forward(q, q, q, 0.0, None, False, alibi_slopes=torch.ones(2))


def test_stand_in_is_installed_only_inside_the_block():
    if flash_attn_cpu.real_flash_attn_present() or torch.cuda.is_available():
        with flash_attn_cpu.flash_attn_stand_in() as installed:
            assert not installed  # never shadow the real kernels
        return
    with flash_attn_cpu.flash_attn_stand_in() as installed:
        from flash_attn.flash_attn_interface import _flash_attn_forward

        assert installed and _flash_attn_forward is flash_attn_cpu._flash_attn_forward
    assert "flash_attn" not in sys.modules and "flash_attn.flash_attn_interface" not in sys.modules


def test_ring_flash_attn_loads_without_its_package_init():
    module = _require_ring_flash_attn()
    assert callable(module.zigzag_ring_flash_attn_func)
    assert "flash_attn" not in sys.modules or flash_attn_cpu.real_flash_attn_present()


# -- the fp64 reference -----------------------------------------------------------------------------------------


def _reference_shards(rank, world, q, k, v, dout, max_elements, causal, window):
    return bench_compare.reference_on_rank(
        q, k, v, dout, rank, world, max_elements=max_elements, causal=causal, window=window
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,max_elements,causal,window,dv",
    [
        (1, 2**24, True, (-1, -1), 8),
        (2, 2**11, True, (-1, -1), 8),  # 2**11: blocks of a few rows
        (2, 2**11, True, (5, 0), 6),
        (2, 2**11, False, (-1, -1), 6),
        (2, 2**11, False, (3, 7), 6),
    ],
    ids=["one-rank", "causal", "causal-window-mla", "full-mla", "window-both-sides-mla"],
)
def test_reference_on_rank_matches_full_autograd(world, max_elements, causal, window, dv):
    S, b, hq, hkv, d = 32, 2, 4, 2, 8
    q, dout = _randn(S, b, hq, d, seed=0), _randn(S, b, hq, dv, seed=1)
    k, v = _randn(S, b, hkv, d, seed=2), _randn(S, b, hkv, dv, seed=3)
    if world == 1:
        shards = [_reference_shards(0, 1, q, k, v, dout, max_elements, causal, window)]
    else:
        shards = run_on_ranks(world, _reference_shards, q, k, v, dout, max_elements, causal, window)
    full = [megatron_2d.unshard_sequence([s[i] for s in shards]) for i in range(4)]
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal, d**-0.5, window=window)
    ref.backward(dout)
    for got, want in zip(full, (ref, qr.grad, kr.grad, vr.grad)):
        assert rel_err(got, want) < 1e-12


# -- the correctness gate ---------------------------------------------------------------------------------------


class LocalOnly(bench_compare.Runner):
    """Deliberately wrong: each rank attends only to its own tokens (no communication)."""

    def step(self, q, k, v, dout):
        # [s, b, h, d] -> [b, h, s, d]; K/V heads repeated for GQA
        q, k, v = (x.detach().permute(1, 2, 0, 3).requires_grad_(True) for x in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
        )
        out.backward(dout.permute(1, 2, 0, 3))
        return tuple(x.permute(2, 0, 1, 3) for x in (out.detach(), q.grad, k.grad, v.grad))

    def bytes_sent(self):
        return {"a2a": 0, "ring": 0}


class Raises(bench_compare.Runner):
    def step(self, q, k, v, dout):
        raise RuntimeError("deliberate failure")


@pytest.mark.distributed
def test_gate_flags_wrong_and_failing_implementations():
    args = _tiny_args("--no-peers")
    extra = [
        bench_compare.Impl("local only", "broken", build=lambda rank, world, a: LocalOnly()),
        bench_compare.Impl("raises", "broken", build=lambda rank, world, a: Raises()),
    ]
    report = bench_compare.run_compare(args, extra)
    rows = {r.name: r for r in report.rows}
    assert rows["local only"].status == "MISMATCH" and rows["local only"].seconds is None
    assert max(rows["local only"].errors.values()) > 0.1
    assert rows["raises"].status.startswith("ERROR: RuntimeError: deliberate failure")
    assert rows["raises"].seconds is None
    ours = [r for r in report.rows if r.family == bench_compare.OURS]
    assert ours and all(r.status == "ok" for r in ours)


def test_relative_errors_propagate_nan_and_inf():
    errs = bench_compare.relative_errors([math.nan, 1.0, 0.0, 0.0, 1.0, 0.0, 0.1, 1.0])
    assert math.isnan(errs["out"]) and errs["dq"] == 0.0 and errs["dk"] == math.inf and errs["dv"] == 0.1
    assert not bench_compare.passes(errs, torch.bfloat16)
    assert bench_compare.passes({"out": 1e-3, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3}, torch.bfloat16)


# -- end to end -------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_bench_compare_end_to_end_json(tmp_path, capsys):
    _require_ring_flash_attn()
    path = tmp_path / "compare.json"
    bench_compare.main(
        [
            "--ranks",
            "4",
            "--seq",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--dim",
            "16",
            "--repeats",
            "1",
            "--quiet",
            "--json",
            str(path),
        ]
    )
    printed = capsys.readouterr().out
    assert "note: ring-flash-attn: zigzag_ring_flash_attn_func" in printed and "matched layouts" in printed
    assert "inner ring size: the default (one ring, w = cp)" in printed  # hp1 x cp4 runs w = 2 and w = 4
    assert "per-block kernel: megatron_2d's cpu_flash, as every row" in printed
    data = json.loads(path.read_text())
    assert data["args"]["dtype"] == "bf16"
    rows = {r["name"]: r for r in data["rows"]}
    ring = rows.get(bench_compare.RING_FLASH)
    assert ring is not None and ring["status"] == "ok", f"ring-flash-attn row: {ring}"
    assert ring["bytes"]["ring_counted"] == ring["bytes"]["ring"]  # the closed form is what it sends
    assert "note: TE rows on CPU ranks: Transformer Engine 2.20.2's own DotProductAttention" in printed
    timed = [r for r in data["rows"] if not r["status"].startswith("n/a")]
    # 5 layouts of CP=4 with hp | 4 (w = 1 only at cp = 1) with fp32 dK/dV riders and again with bf16 ones,
    # ring-flash, USP U=1, U=2 and U=4 with K/V repeated, torch CP x 2, TE p2p, a2a+p2p [2, 2] and all_gather
    assert len(timed) == 19
    assert sum(r["name"].endswith("dK/dV in bf16") for r in timed) == 5
    te_families = {"TE p2p", "TE a2a+p2p", "TE all_gather"}
    for r in timed:
        assert r["status"] == "ok", r
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0, r
        assert math.isfinite(r["efficiency"]) and math.isfinite(r["efficiency_alone"]), r
        assert r["cpu_seconds"] > 0 and len(r["round_seconds"]) == 1, r
        assert max(r["errors"].values()) < BF16_TOLERANCE, r
        fams = {bench_compare.OURS, bench_compare.RING_FLASH, bench_compare.USP, bench_compare.TORCH_CP}
        assert set(r["ratios"]) == fams | te_families
        if r["family"] in te_families:  # TE's code sent what the closed forms say
            assert (r["bytes"]["ring_counted"], r["bytes"]["a2a_counted"]) == (r["bytes"]["ring"], r["bytes"]["a2a"])
    assert sorted(r["status"] for r in data["rows"] if r["status"].startswith("n/a")) == [
        "n/a: a2a needs CP=4 to divide hq=4 and hkv=2",
        "n/a: yunchang's Ulysses all-to-all splits the heads over U=4 ranks: U must divide hq=4 and hkv=2 "
        "(its all_to_all_4D raises otherwise)",
    ]
    # the round order rotates: with one timed round there is one order, of every timed row
    assert len(data["order"]) == 1 and len(data["order"][0]) == 19


# -- the peers: USP (yunchang) and torch CP ---------------------------------------------------------------------


def _peer_args(world, hkv, *extra):
    return bench_compare.parse_args(
        ["--ranks", str(world), "--seq", "256", "--heads", "4", "--kv-heads", str(hkv), "--dim", "16"]
        + ["--repeats", "1", "--quiet", *extra]
    )


def _peer_rows(args, impls):
    out = run_on_ranks(args.ranks, bench_compare.compare_on_rank, args, impls, "cpu", timeout_s=240)[0]
    return {impl.name: r for impl, r in zip(impls, out["rows"])}, out


@pytest.mark.distributed
@pytest.mark.parametrize("world,hkv", [(2, 4), (2, 1), (4, 4), (4, 2)], ids=["n2-mha", "n2-mqa", "n4-mha", "n4-gqa"])
def test_usp_and_torch_cp_pass_the_fp64_gate(world, hkv):
    args = _peer_args(world, hkv)
    impls = bench_compare.usp_impls(args) + bench_compare.torch_cp_impls(args)
    rows, _ = _peer_rows(args, impls)
    expected = {f"USP ulysses{u} x ring{world // u}" for u in (1, 2, 4) if world % u == 0}
    expected |= {"torch CP allgather", "torch CP alltoall"}
    if hkv < world:
        expected.add(f"USP ulysses{world} x ring1, K/V repeated by the caller")
    assert set(rows) == expected
    for name, r in rows.items():
        if world > hkv and name == f"USP ulysses{world} x ring1":  # yunchang cannot split hkv < U heads
            assert r["status"] == (
                f"n/a: yunchang's Ulysses all-to-all splits the heads over U={world} ranks: U must divide hq=4 and "
                f"hkv={hkv} (its all_to_all_4D raises otherwise)"
            )
            continue
        assert r["status"] == "ok", (name, r)
        assert max(r["errors"].values()) < BF16_TOLERANCE, (name, r)
        if name.startswith("USP"):
            assert r["bytes"]["ring_counted"] == r["bytes"]["ring"], (name, r["bytes"])


class _Perturbed(bench_compare.Runner):
    """A peer's runner whose output is 10% off: the gate must catch it."""

    def __init__(self, inner):
        self.inner, self.bytes_source = inner, inner.bytes_source

    def to_native(self, *xs):
        return self.inner.to_native(*xs)

    def step(self, *xs):
        out, dq, dk, dv = self.inner.step(*xs)
        return out * 1.1, dq, dk, dv

    def from_native(self, *xs):
        return self.inner.from_native(*xs)

    def bytes_sent(self):
        return self.inner.bytes_sent()


@pytest.mark.distributed
def test_a_wrong_peer_is_reported_mismatch():
    args = _peer_args(2, 2)
    usp, cp = bench_compare.usp_impls(args)[0], bench_compare.torch_cp_impls(args)[0]
    impls = [
        bench_compare.Impl(
            f"perturbed {impl.name}", impl.family, build=lambda r, w, a, b=impl.build: _Perturbed(b(r, w, a))
        )
        for impl in (usp, cp)
    ] + [usp]
    rows, _ = _peer_rows(args, impls)
    for impl in impls[:2]:
        r = rows[impl.name]
        assert r["status"] == "MISMATCH" and r["seconds"] is None, r
        assert r["errors"]["out"] > 0.05 and r["errors"]["dq"] < BF16_TOLERANCE
    assert rows[usp.name]["status"] == "ok"


def test_peer_bytes_closed_forms():
    # this rank's shard at N = 4: S/N = 64 tokens, b=1, hq=4, hkv=2, d=16, bf16 (2 bytes)
    nq, nkv, e = 64 * 4 * 16, 64 * 2 * 16, 2
    # USP [U=2, R=2]: K/V after the all-to-all: 128 tokens x 1 head, the same element count
    assert bench_runners.usp_bytes(nq, nkv, e, 2, 2) == {
        "a2a": 2 * (2 * nq + 2 * nkv) * e / 2,
        "ring": 2 * nkv * (1 * 2 * e + 2 * 4),
    }
    assert bench_runners.usp_bytes(nq, nkv, e, 4, 1) == {"a2a": 2 * (2 * nq + 2 * nkv) * e * 3 / 4, "ring": 0}
    assert bench_runners.usp_bytes(nq, nkv, e, 1, 4)["a2a"] == 0
    assert bench_runners.torch_cp_bytes(nkv, 4, e) == {"a2a": 0, "ring": 2 * nkv * (3 * 2 * e + 4 * 4)}


def test_peers_flag():
    assert bench_compare.parse_args([]).peers == bench_compare.PEERS
    assert bench_compare.parse_args(["--peers", "all"]).peers == bench_compare.PEERS
    assert bench_compare.parse_args(["--peers", "torch-cp,usp"]).peers == ("usp", "torch-cp")
    assert bench_compare.parse_args(["--no-peers"]).peers == ()
    with pytest.raises(SystemExit):
        bench_compare.parse_args(["--peers", "usp,megatron"])
    args = _peer_args(2, 2, "--peers", "torch-cp")
    families = {impl.family for impl in bench_compare.all_impls(args)}
    assert families == {bench_compare.OURS, bench_compare.TORCH_CP}
    assert bench_compare.parse_args(["--system-malloc"]).system_malloc


def test_round_order_puts_every_implementation_at_every_position():
    timed = [0, 2, 3, 5, 8]
    orders = [round_order(timed, r) for r in range(1, 1 + len(timed))]
    for order in orders:
        assert sorted(order) == timed
    for position in range(len(timed)):
        assert sorted(order[position] for order in orders) == timed
    assert round_order([], 3) == []


def _timed_row(name, family, seconds, hp, cp, rounds=(), cpu=None):
    return bench_compare.Row(
        name,
        family,
        "ok",
        seconds,
        None,
        None,
        None,
        layout={"hp": hp, "cp": cp, "w": cp},
        cpu_seconds=cpu,
        round_seconds=list(rounds),
    )


def test_matched_layouts_pairs_usp_rows_with_the_best_2d_row():
    rows = [
        _timed_row("hp2 x cp2 a", bench_compare.OURS, 3.0, 2, 2, (3.0, 3.0, 3.0), cpu=6.0),
        _timed_row("hp2 x cp2 b", bench_compare.OURS, 2.0, 2, 2, (2.0, 1.0, 4.5), cpu=3.0),
        _timed_row("hp4 x cp1", bench_compare.OURS, 1.0, 4, 1),
        _timed_row("USP ulysses2 x ring2", bench_compare.USP, 4.0, 2, 2, (4.0, 2.0, 4.0), cpu=4.0),
        _timed_row("USP ulysses1 x ring4", bench_compare.USP, 4.0, 1, 4),  # no 2D row of hp1 x cp4 here
    ]
    (m,) = bench_compare.matched_layouts(rows)
    assert (m.row, m.against, m.ratio, m.cpu_ratio) == ("hp2 x cp2 b", "USP ulysses2 x ring2", 0.5, 0.75)
    assert m.round_ratios == (0.5, 0.5, 1.125)  # paired by round
    assert m.verdict == "within noise"  # the third round disagrees


def test_default_windows_pairs_one_ring_with_the_fastest_other_window():
    def row(name, seconds, w, placement="head_first", hp=1, cp=4):
        r = _timed_row(name, bench_compare.OURS, seconds, hp, cp, (seconds,) * 3)
        r.layout.update(w=w, placement=placement)
        return r

    rows = [
        row("w4", 1.0, 4),
        row("w2", 1.1, 2),
        row("w1", 1.2, 1),
        row("w4 context_first", 1.0, 4, "context_first"),  # no other w of its placement
        row("hp2 w2", 2.0, 2, hp=2, cp=2),
    ]
    (m,) = bench_compare.default_windows(rows)
    assert (m.row, m.against, m.verdict) == ("w4", "w2", "faster")
    assert m.ratio == pytest.approx(1.0 / 1.1)


@pytest.mark.parametrize(
    "ours,usp,verdict",
    [
        ((1.0, 1.0, 1.0), (1.1, 1.2, 1.05), "faster"),
        ((1.1, 1.2, 1.05), (1.0, 1.0, 1.0), "slower"),
        ((1.0, 1.0, 1.0), (1.0, 1.2, 1.2), "within noise"),  # a tie is not a lead
        ((1.0, 1.0), (2.0, 2.0), "-"),  # two rounds cannot tell
    ],
)
def test_matched_verdict_needs_every_round_to_agree(ours, usp, verdict):
    rows = [
        _timed_row("hp2 x cp1", bench_compare.OURS, 1.0, 2, 1, ours),
        _timed_row("USP ulysses2 x ring1", bench_compare.USP, 1.0, 2, 1, usp),
    ]
    (m,) = bench_compare.matched_layouts(rows)
    assert m.verdict == verdict and m.cpu_ratio is None


def test_flash_attn_stand_in_version_is_a_parameter():
    if flash_attn_cpu.real_flash_attn_present() or torch.cuda.is_available():
        pytest.skip("the stand-in never shadows a real flash_attn")
    with flash_attn_cpu.flash_attn_stand_in(version=flash_attn_cpu.FLASH_ATTN_2_7_VERSION):
        import flash_attn

        assert flash_attn.__version__ == flash_attn_cpu.FLASH_ATTN_2_7_VERSION
        assert not flash_attn_cpu.real_flash_attn_present()
    with flash_attn_cpu.flash_attn_stand_in():
        import flash_attn

        assert flash_attn.__version__ == flash_attn_cpu.STAND_IN_VERSION


def test_torch_cp_cpu_rule_is_scoped():
    from torch.distributed.tensor import DTensor

    from megatron_2d_dev.bench import torch_cp_cpu

    handlers = lambda: DTensor._op_dispatcher._custom_op_handlers  # noqa: E731
    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert torch_cp_cpu.CPU_SDPA not in handlers() and torch_cp_cpu.CPU_SDPA not in strategies
    with torch_cp_cpu.cpu_sdpa_context_parallel():
        assert handlers()[torch_cp_cpu.CPU_SDPA] is handlers()[torch_cp_cpu.CPU_SDPA_BACKWARD]
        assert torch_cp_cpu.CPU_SDPA in strategies and torch_cp_cpu.CPU_SDPA_BACKWARD in strategies
    assert torch_cp_cpu.CPU_SDPA not in handlers() and torch_cp_cpu.CPU_SDPA_BACKWARD not in strategies


def test_torch_cp_block_adapter_matches_torch_sdpa():
    from megatron_2d_dev.bench import torch_cp_cpu

    q, k, v, dout = (_randn(1, 2, 32, 8, seed=i) for i in range(4))  # [b, h, s, d]
    for causal in (True, False):
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        ref.backward(dout)
        out, lse = torch_cp_cpu.block_forward(q, k, v, is_causal=causal)
        grads = torch_cp_cpu.block_backward(dout, q, k, v, out, lse, is_causal=causal)
        assert out.shape == q.shape and lse.shape == (1, 2, 32)
        for got, want in zip((out, *grads), (ref, qr.grad, kr.grad, vr.grad)):
            assert rel_err(got, want) < 1e-6


# -- calibration (tools/calibrate_planner.py: megatron_2d_dev.bench.calibration) ---------------------------------------


def test_calibration_recovers_known_rates_and_reads_bench_json():
    from megatron_2d_dev.bench import calibration as cal

    machine = cal.MachineFigures(cores=2, peak_flops=400e9, copy_bytes_per_s=30e9, step_latency_s={4: 5e-4, 8: 1e-3})
    args = {"heads": 8, "kv_heads": 8, "dim": 64}
    model, seq, rate, link = cal.bench_model(args), 4096, 80e9, 0.5e9
    samples = []
    for n in (4, 8):
        parallel = cal.ParallelSpec(gpus=n, cp=n)
        for layout in (cal.Scheme("2d", 1, n, n), cal.Scheme("2d", 2, n // 2, 1), cal.Scheme("2d", n, 1, 1)):
            c = cal.work_counts(layout, model, cal.cpu_cluster(n, machine), parallel, seq)
            fixed = cal.fixed_seconds(layout, model, cal.cpu_cluster(n, machine), parallel, seq)
            t = fixed + cal.share(n, machine.cores) * (c.flops / rate + c.nvlink_bytes / link)
            samples.append(cal.Sample(n, layout, t, c.nvlink_bytes))
    fit = cal.fit(samples, model, machine, seq, batch=1)
    assert fit.flops_per_s == pytest.approx(rate, rel=1e-9)
    assert fit.nvlink_bytes_per_s == pytest.approx(link, rel=1e-9)
    cluster, eff = cal.calibrated_cluster(8, machine, fit)
    assert eff == pytest.approx(0.2) and cluster.peak_tflops == pytest.approx(0.1)  # 400 GFLOP/s / (8 / 2)

    row = {
        "family": bench_compare.OURS,
        "seconds": 0.5,
        "bytes": {"a2a": 10, "ring": 20},
        "layout": {"hp": 2, "cp": 2, "w": 1, "placement": "context_first"},
    }
    data = {"args": {"ranks": 4}, "rows": [row, dict(row, family=bench_compare.RING_FLASH, layout=None)]}
    assert cal.samples_from_json(data) == [cal.Sample(4, cal.Scheme("2d", 2, 2, 1, "context_first"), 0.5, 30)]


def test_spearman_handles_ties():
    from megatron_2d_dev.bench import calibration as cal

    assert cal.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert cal.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert cal.spearman([1, 2, 3, 4], [5, 5, 6, 6]) == pytest.approx(0.8944, abs=1e-4)
    assert math.isnan(cal.spearman([1, 2, 3], [7, 7, 7]))


# -- the TE rows: Transformer Engine's own DotProductAttention and context_parallel.py on CPU ranks ---------------


def _run_te_rows(rank, world, args, kinds):
    full = bench_compare.make_inputs(args, torch.bfloat16)
    shards = [megatron_2d.shard_sequence(x, rank, world) for x in full]
    ref = bench_compare.reference_on_rank(*(x.double() for x in full), rank, world)
    out = {}
    for kind, a2a_size in kinds:
        runner = bench_compare.TEContextParallel(kind, a2a_size, args, world, GROUP_TIMEOUT)
        got = runner.from_native(*runner.step(*runner.to_native(*shards)))
        errors = bench_compare.relative_errors(bench_compare.error_parts(got, ref))
        groups = runner.attn.cp_group if isinstance(runner.attn.cp_group, list) else [runner.attn.cp_group]
        cp = ([torch.distributed.get_process_group_ranks(g) for g in groups], runner.attn.cp_global_ranks)
        out[(kind, a2a_size)] = (cp, errors, runner.bytes_sent())
    return out


@pytest.mark.distributed
def test_te_rows_run_transformer_engine_on_cpu_ranks():
    """Each TE row runs TE's own code (the bench's release, in its CPU context entered by the parent): Megatron's
    groups, within the bf16 gate of fp64, and the bytes TE's code sent are the closed forms'."""
    from megatron_2d_dev.te_context_parallel import te_context_parallel_on_cpu

    args = _tiny_args("--kv-heads", "4")  # hkv = 4: every kind is valid TE at N = 4
    kinds = [("p2p", 1), ("a2a", 4), ("a2a+p2p", 2), ("all_gather", 1)]
    with te_context_parallel_on_cpu(args.te_release, claim_cuda=False):
        per_rank = run_on_ranks(4, _run_te_rows, args, kinds, timeout_s=120)
    for rank, results in enumerate(per_rank):
        for (kind, _a2a_size), (cp, errors, sent) in results.items():
            groups, global_ranks = cp
            assert global_ranks == [0, 1, 2, 3]
            if kind == "a2a+p2p":  # Megatron's hierarchical groups: a2a on adjacent ranks, p2p 2 apart
                assert groups == [[0, 1] if rank < 2 else [2, 3], [0, 2] if rank % 2 == 0 else [1, 3]]
            else:
                assert groups == [[0, 1, 2, 3]]
            assert bench_compare.passes(errors, torch.bfloat16), (kind, errors)
            assert sent["a2a_counted"] == sent["a2a"] and sent["ring_counted"] == sent["ring"], (kind, sent)
    # Closed forms for this rank's shard: S/N = 32 tokens, b=1, hq=hkv=4, d=16, bf16 (2 bytes).
    nq = nkv = 32 * 4 * 16
    e = 2
    sent = {k: {n: v[2][n] for n in ("a2a", "ring")} for k, v in per_rank[0].items()}
    assert sent[("p2p", 1)] == {"a2a": 0, "ring": 2 * nkv * e * 3 * 3}
    assert sent[("a2a", 4)] == {"a2a": 2 * (2 * nq + 2 * nkv) * e * 3 / 4, "ring": 0}
    assert sent[("a2a+p2p", 2)] == {"a2a": 2 * (2 * nq + 2 * nkv) * e / 2, "ring": 2 * nkv * e * 3}
    assert sent[("all_gather", 1)] == {"a2a": 0, "ring": 2 * nkv * e * 3 * 3}


def test_te_rows_follow_what_te_accepts(monkeypatch):
    import types

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    args = bench_compare.parse_args(["--ranks", "8", "--heads", "8", "--kv-heads", "2"])
    args.device = "cuda"
    rows = {r.name: r for r in bench_compare.te_impls(args)}
    assert set(rows) == {"TE p2p", "TE a2a", "TE a2a+p2p [2, 4]", "TE all_gather"}  # A | hkv: no K/V replication
    assert rows["TE a2a"].unavailable.startswith("a2a needs CP=8 to divide")
    assert rows["TE p2p"].build and rows["TE a2a+p2p [2, 4]"].build and rows["TE all_gather"].build
    assert all(r.context is None for r in rows.values())  # CUDA: the installed TE, no CPU context
    args.device = "cpu"  # CPU ranks: the same rows, TE's CPU context entered by the parent
    cpu_rows = {r.name: r for r in bench_compare.te_impls(args)}
    assert set(cpu_rows) == set(rows) and cpu_rows["TE p2p"].context[0] == f"TE {args.te_release}"
    args.te_release = "9.9.9"
    (missing,) = bench_compare.te_impls(args)
    assert missing.unavailable.startswith("Transformer Engine 9.9.9 is not installed")
