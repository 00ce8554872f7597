"""Sliding windows and attention sinks under 2D attention.

Pure pieces (bands, block calls, kernels) against token-level masks; then attention_2d on forked gloo ranks:
forward out AND dq/dk/dv/d sinks against the single-process reference (the same global tensors, sharded with
``shard_sequence``), over windows smaller than a chunk, spanning chunks, larger than the sequence and non-causal
(left, right) windows; learnable and off-by-one sinks; worlds 1-8; several (hp, cp, w), both placements, GQA with
K/V replication. Bytes sent by the neighbour exchange are checked against a closed form.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random

import pytest
import torch
import torch.distributed as dist

import megatron_2d
import megatron_2d.attention  # noqa: F401  imported once here, not in every forked rank (PEP 562 exports)
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.cpu_flash import row_tiles
from megatron_2d.layout.band import Band, SlidingWindow, flash_expressible
from megatron_2d.layout.block_calls import block_pair_calls, context_calls, context_chunks
from megatron_2d.layout.topology import Layout2D
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, reference_attention, rel_err
from megatron_2d_dev.shared_worlds import run_by_world, run_each_on_ranks, selected_params
from megatron_2d_dev.torch_flash_cpu import torch_flash_on_cpu

TIMEOUT = GROUP_TIMEOUT


# ---------------------------------------------------------------------------------------------- pure pieces
def token_mask(q_pos, k_pos, causal, window):
    """[len(q_pos), len(k_pos)] bool: which keys each query sees (the definition, on global positions)."""
    q, k = torch.tensor(q_pos).view(-1, 1), torch.tensor(k_pos).view(1, -1)
    left, right = window
    seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        seen &= k <= q
    if left != -1:
        seen &= k >= q - left
    if right != -1:
        seen &= k <= q + right
    return seen


def test_band_trim_keeps_every_visible_pair_and_no_empty_row():
    rng = random.Random(0)
    for _ in range(2000):
        sq, sk = rng.randint(1, 12), rng.randint(1, 12)
        lo = rng.choice([None, rng.randint(-15, 15)])
        hi = rng.choice([None, rng.randint(-15, 15)])
        band = Band(lo, hi)
        full = torch.tensor([[band.visible(i, j) for j in range(sk)] for i in range(sq)])
        box = band.trim(sq, sk)
        if box is None:
            assert not full.any(), (band, sq, sk)
            continue
        inside = torch.zeros_like(full)
        inner = box.band or Band(None, None)
        nq, nk = box.q_end - box.q_start, box.k_end - box.k_start
        sub = torch.tensor([[inner.visible(i, j) for j in range(nk)] for i in range(nq)])
        inside[box.q_start : box.q_end, box.k_start : box.k_end] = sub
        assert torch.equal(inside, full), (band, sq, sk, box)
        assert sub.any(dim=1).all() and sub.any(dim=0).all()  # no fully masked row or column
        if box.band is not None and not flash_expressible(box.band, nq, nk):  # split: tests/test_kernels.py
            with pytest.raises(ValueError, match="split it with flash_boxes"):
                box.band.flash_window(nq, nk)
        elif box.band is not None:
            left, right = box.band.flash_window(nq, nk)  # expressible in flash-attn (bottom-right)
            assert left >= -1 and right >= -1
            r = torch.arange(nq).view(-1, 1) + (nk - nq)
            c = torch.arange(nk).view(1, -1)
            flash = torch.ones(nq, nk, dtype=torch.bool)
            if left != -1:
                flash &= c >= r - left
            if right != -1:
                flash &= c <= r + right
            assert torch.equal(flash, sub), (box, left, right)


@pytest.mark.parametrize(
    "causal, window",
    [
        (True, (0, 0)),
        (True, (1, 0)),
        (True, (3, 0)),
        (True, (4, 0)),
        (True, (9, -1)),
        (True, (100, 0)),
        (False, (2, 3)),
        (False, (-1, 5)),
        (False, (6, -1)),
        (False, (0, 0)),
        (True, (-1, -1)),
        (False, (-1, -1)),
    ],
    ids=lambda x: str(x),
)
def test_plans_cover_each_visible_pair_exactly_once(causal, window):
    """For every context rank pair of several layouts, the calls tile exactly the token-level mask."""
    c = 4
    for cp_size, hp, placement in [
        (4, 1, "head_first"),
        (4, 2, "context_first"),
        (6, 2, "head_first"),
        (8, 4, "context_first"),
    ]:
        layout = Layout2D(cp_size, hp, 1, placement)
        win = SlidingWindow.of(window, causal, 2 * cp_size * c)
        group_calls = context_calls(layout, c, causal, win)
        for (dst, src), calls in group_calls.calls.items():
            q_pos = [x * c + t for x in context_chunks(layout, dst) for t in range(c)]
            k_pos = [y * c + t for y in context_chunks(layout, src) for t in range(c)]
            covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int)
            for call in calls:
                band = call.band or Band(None, None)
                for i in range(call.q_start, call.q_end):
                    for j in range(call.k_start, call.k_end):
                        covered[i, j] += band.visible(i - call.q_start, j - call.k_start)
            assert torch.equal(covered, token_mask(q_pos, k_pos, causal, window).int()), (layout, dst, src)
            assert (group_calls.keys[(dst, src)] is None) == (not calls)


def test_window_plans_skip_blocks_and_flops():
    """A window shorter than a chunk: hp=1 context rank r sees only its neighbours r-1 and r+1."""
    layout, c = Layout2D(8, 1, 1), 16
    group_calls = context_calls(layout, c, True, SlidingWindow.of((5, 0), True, 16 * c))
    for (dst, src), hull in group_calls.keys.items():
        assert (hull is not None) == (abs(dst - src) <= 1), (dst, src, hull)
    # own block: each query sees itself and up to 5 keys back (6 pairs per row, fewer at each chunk's start
    # only where the previous chunk lives elsewhere)
    assert not group_calls.dense and context_calls(layout, c, True, SlidingWindow()).dense
    flops = sum(call.flops_units for calls in group_calls.calls.values() for call in calls)
    S = 16 * c
    assert flops == sum(min(i, 5) + 1 for i in range(S))  # exactly the windowed causal pairs


def test_plan_without_window_keeps_zigzag_half_blocks():
    assert block_pair_calls([1, 6], [0, 7], 4, True, SlidingWindow()) == block_pair_calls([1, 6], [0, 7], 4, True)
    assert len(block_pair_calls([0, 3, 4, 7], [1, 2, 5, 6], 8, True)) == 2  # merged runs, not one call per chunk pair


def test_sliding_window_rejects_bad_values():
    with pytest.raises(ValueError, match=r"looks 3 tokens ahead, but causal=True"):
        SlidingWindow.of((4, 3), True, 64)
    with pytest.raises(ValueError, match=r"left must be an integer >= 0, or -1 for unbounded; got -2"):
        SlidingWindow.of((-2, 0), True, 64)
    with pytest.raises(ValueError, match=r"must be a pair \(left, right\)"):
        SlidingWindow.of(16, True, 64)
    assert SlidingWindow.of((63, 0), True, 64) == SlidingWindow(-1, 0)  # a window over everything is none


BAND_KERNELS = [
    ("cpu_flash", torch.float32),
    ("cpu_flash", torch.bfloat16),
    ("torch_math", torch.float32),
    ("torch_math", torch.bfloat16),
    ("torch_flash", torch.bfloat16),
]  # torch_flash: fp16/bf16 only


@pytest.mark.parametrize("name, dtype", BAND_KERNELS, ids=[f"{n}-{str(dt)[6:]}" for n, dt in BAND_KERNELS])
@pytest.mark.parametrize(
    "band, sq, sk",
    [
        (Band(-40, 0), 600, 600),  # narrow causal band over a long block: the CPU kernel tiles it
        (Band(-3, 2), 300, 300),  # narrow two-sided band
        (Band(0, None), 40, 40),  # keys at or after the query (a trimmed window tail)
        (Band(-20, 20), 30, 50),  # rectangular
    ],
    ids=["narrow_causal", "two_sided", "anti_causal", "rectangular"],
)
def test_kernels_with_bands(name, dtype, band, sq, sk):
    torch.manual_seed(3)
    b, hq, hkv, d = 1, 4, 2, 16
    q64 = torch.randn(b, sq, hq, d, dtype=torch.float64, requires_grad=True)
    k64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    v64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, sq, hq, d, dtype=torch.float64)
    box = band.trim(sq, sk)
    assert (box.q_start, box.q_end, box.k_start, box.k_end) == (0, sq, 0, sk)  # cases are pre-trimmed
    mask_ok = torch.tensor([[band.visible(i, j) for j in range(sk)] for i in range(sq)])
    rep = hq // hkv
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64.repeat_interleave(rep, 2)) * 0.25
    scores = scores.masked_fill(~mask_ok, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v64.repeat_interleave(rep, 2))
    ref.backward(dout)
    q, k, v = (x.detach().to(dtype) for x in (q64, k64, v64))
    with torch_flash_on_cpu() if name == "torch_flash" else contextlib.nullcontext():  # its CUDA op on CPU
        kernel = select_kernel(torch.device("cpu"), dtype, name)
        out, lse = kernel.forward(q, k, v, band, 0.25)
        dq, dk, dv = kernel.backward(dout.to(dtype), q, k, v, out, lse, band, 0.25)
    tol = TOLERANCES[dtype].end_to_end
    assert rel_err(lse, torch.logsumexp(scores, -1)) < tol
    for got, want in ((out, ref), (dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert got.shape == want.shape and rel_err(got, want) < tol


def test_cpu_tiles_follow_the_band():
    tiles = row_tiles(Band(-40, 0), 600, 600)
    assert len(tiles) == 10  # 64-row tiles (the band is 41 wide)
    assert max(t.k_end - t.k_start for t in tiles) <= 64 + 40
    assert row_tiles(Band(None, 0), 600, 600)[0].band == Band(None, 0)  # causal: one native call


# --------------------------------------------------------------------------------------- distributed runs
# (world, hp, w, placement): worlds 1, 2, 4, 6, 8; inner/outer rings, both placements, head-only and ring-only.
LAYOUTS = [
    (1, 1, 1, "head_first"),
    (2, 1, 1, "head_first"),
    (2, 2, 1, "head_first"),
    (4, 1, 2, "head_first"),
    (4, 2, 1, "context_first"),
    (4, 2, 2, "head_first"),
    (6, 2, 1, "head_first"),
    (6, 3, 2, "context_first"),
    (8, 1, 2, "head_first"),
    (8, 2, 2, "context_first"),
    (8, 4, 1, "head_first"),
]
CHUNK = 8  # tokens per zigzag chunk: S = 2 * world * CHUNK
# (name, causal, window as a function of S)
WINDOWS = [
    ("causal_below_chunk", True, lambda S: (3, 0)),
    ("causal_self_only", True, lambda S: (0, 0)),
    ("causal_one_to_few_chunks", True, lambda S: (CHUNK + 3, 0)),
    ("causal_several_chunks", True, lambda S: (3 * CHUNK + 1, -1)),
    ("causal_beyond_sequence", True, lambda S: (S + 5, 0)),
    ("two_sided", False, lambda S: (5, 2)),
    ("right_only", False, lambda S: (-1, CHUNK - 1)),
    ("left_only_noncausal", False, lambda S: (2 * CHUNK + 3, -1)),
]
SINKS = ["none", "learnable", "off_by_one"]


HEADS = {  # hp -> (name, hq, hkv): GQA split over the head group, and GQA whose K/V heads must be replicated
    1: [("gqa", 8, 2)],
    2: [("gqa", 8, 4), ("kv_replicated_x2", 8, 1)],
    3: [("gqa", 6, 3), ("kv_replicated_x3", 6, 2)],
    4: [("gqa", 8, 4), ("kv_replicated_x2", 8, 2)],
}


def error(actual, expected):
    """Relative error; absolute where the reference is exactly zero (a self-only window has dq = dk = 0)."""
    if expected.abs().max() == 0:
        return actual.abs().max().item()
    return rel_err(actual, expected)


@functools.cache
def case_reference(world, causal, window, sink_kind, hq, hkv, seed):
    """A case's global inputs (q, k, v, dout, sinks) and fp64 reference (out, dq, dk, dv, d sinks): computed once in
    the test process (:func:`computed_before_forking`), the forked ranks inherit the cache, instead of every rank
    computing the same reference."""
    d, b, S = 16, 2, 2 * world * CHUNK
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(S, b, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(S, b, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = {
        "none": None,
        "off_by_one": torch.zeros(hq, dtype=torch.float64),
        "learnable": torch.randn(hq, generator=g, dtype=torch.float64),
    }[sink_kind]
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_(sink_kind == "learnable")
    ref = reference_attention(*leaves, causal, 0.3, window=window, sinks=ref_sinks)
    ref.backward(dout)
    dsinks = None if sink_kind != "learnable" else ref_sinks.grad
    return (q, k, v, dout, sinks), (ref.detach(), *(x.grad for x in leaves), dsinks)


def run_case(rank, world, groups, dtype, causal, window, sink_kind, hq, hkv, seed):
    """One case: max relative error over out, dq, dk, dv (and d sinks, summed over the CP group)."""
    (q, k, v, dout, sinks), (ref, dq, dk, dv, dsinks) = case_reference(world, causal, window, sink_kind, hq, hkv, seed)

    def shard(x):
        return megatron_2d.shard_sequence(x, rank, world, seq_dim=0)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_(True) for x in (q, k, v))
    my_sinks = None if sinks is None else sinks.to(torch.float32).requires_grad_(sink_kind == "learnable")
    out = megatron_2d.attention_2d(
        ql, kl, vl, groups, causal=causal, softmax_scale=0.3, sliding_window=window, sinks=my_sinks
    )
    out.backward(shard(dout).to(dtype))
    errors = [error(out, shard(ref)), error(ql.grad, shard(dq)), error(kl.grad, shard(dk)), error(vl.grad, shard(dv))]
    if sink_kind == "learnable":
        grad = my_sinks.grad.clone()
        dist.all_reduce(grad)
        errors.append(rel_err(grad, dsinks))
    elif my_sinks is not None:
        assert my_sinks.grad is None
    return max(errors)


def layout_cases(world, hp):
    """{(window name, sinks, heads name): run_case arguments after dtype} of a layout."""
    S = 2 * world * CHUNK
    cases = {}
    for (wname, causal, window_of), sink_kind, (hname, hq, hkv) in itertools.product(WINDOWS, SINKS, HEADS[hp]):
        if sink_kind != "none" and wname not in ("causal_below_chunk", "two_sided", "causal_beyond_sequence"):
            continue
        cases[(wname, sink_kind, hname)] = (causal, window_of(S), sink_kind, hq, hkv, len(cases))
    return cases


def computed_before_forking(world, cases):
    for case in cases:
        case_reference(world, *case)


def run_layout(rank, world, hp, w, placement, cases):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    return {key: run_case(rank, world, groups, torch.float32, *case) for key, case in cases.items()}


@pytest.fixture(scope="module")
def layout_errors(request):
    """The selected layouts, one forked world per world size (megatron_2d_dev.shared_worlds)."""
    layouts = selected_params(request, "test_windows_and_sinks_match_reference", "layout")
    calls = {}
    for world, hp, w, placement in layouts:
        cases = layout_cases(world, hp)
        computed_before_forking(world, cases.values())
        calls[(world, hp, w, placement)] = (world, (run_layout, (hp, w, placement, cases)))
    return run_by_world(calls, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"N{n}-hp{h}-w{w}-{p}" for n, h, w, p in LAYOUTS])
def test_windows_and_sinks_match_reference(layout_errors, layout):
    per_rank = layout_errors[layout]
    bad = {
        case: err
        for rank_errors in per_rank
        for case, err in rank_errors.items()
        if not err < TOLERANCES[torch.float32].end_to_end
    }
    assert len(per_rank[0]) == (len(WINDOWS) + 3 * 2) * len(HEADS[layout[1]])  # sinks on three windows
    assert not bad, bad


BF16_CASES = [(True, (5, 0), "learnable", 8, 2, 11), (False, (5, 2), "none", 8, 2, 12)]


def run_bf16(rank, world):
    groups = megatron_2d.build_2d_groups(2, 1, "head_first", timeout=TIMEOUT)
    return [run_case(rank, world, groups, torch.bfloat16, *case) for case in BF16_CASES]


@pytest.mark.distributed
def test_bf16_window_and_sinks():
    computed_before_forking(4, BF16_CASES)
    errors = [e for rank in run_on_ranks(4, run_bf16) for e in rank]
    assert max(errors) < TOLERANCES[torch.bfloat16].end_to_end, errors


# -------------------------------------------------------------------------------------------- bytes sent
def run_bytes(rank, world, window):
    groups = megatron_2d.build_2d_groups(1, 1, "head_first", timeout=TIMEOUT)
    S, b, h, d = 2 * world * CHUNK, 1, 2, 16
    q, k, v, dout = (megatron_2d.shard_sequence(torch.randn(S, b, h, d), rank, world) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    groups.comm_bytes.reset()
    megatron_2d.attention_2d(q, k, v, groups, causal=True, sliding_window=window).backward(dout)
    return groups.comm_bytes.as_dict()


def neighbour_bytes_closed_form(rank, cp, left, b=1, g=2, d=16, elt=4, grad_elt=4):
    """hp = 1, causal window of left <= c tokens: context rank r's keys are seen by r+1 (the last ``left`` keys
    of its first chunk) and by r-1 (the last ``left`` of its second chunk), where those ranks exist. Each such
    rank gets that K/V slice in forward and again in backward, and returns its dK/dV partial (fp32)."""
    neighbours = (rank > 0) + (rank < cp - 1)
    slice_elements = 2 * b * left * g * d  # K and V of ``left`` tokens
    return neighbours * slice_elements * (2 * elt + grad_elt)


@pytest.mark.distributed
@pytest.mark.parametrize("left", [1, 5, CHUNK], ids=lambda x: f"left{x}")
def test_window_bytes_follow_closed_form_and_beat_the_ring(left):
    world = 8
    windowed, full = run_each_on_ranks(world, [(run_bytes, ((left, 0),)), (run_bytes, ((-1, 0),))])
    for rank in range(world):
        assert windowed[rank]["neighbour"] == neighbour_bytes_closed_form(rank, world, left)
        assert windowed[rank]["inner_ring"] == windowed[rank]["outer_ring"] == 0
    ring = sum(full[0].values())
    assert full[0]["neighbour"] == 0 and ring > 0
    # a window of S/16 (= one chunk at CP=8) sends at most a third of the full causal ring's bytes
    assert max(sum(r.values()) for r in windowed) <= ring / 3


@pytest.mark.distributed
def test_window_beyond_sequence_runs_the_ring():
    world = 4
    wide, causal = run_each_on_ranks(world, [(run_bytes, ((10**6, 0),)), (run_bytes, ((-1, -1),))])
    assert wide == causal
