"""attention_2d on forked gloo ranks: forward output and dq/dk/dv against a single-process reference.

Every rank builds the same global tensors, shards them with the users' helper (shard_sequence, Megatron's zigzag),
runs the op, and compares its shard of out and of the gradients with the same shard of the reference.
"""

from __future__ import annotations

import datetime
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.distributed import RankFailure, run_on_ranks

from megatron_2d.testing.reference import TOLERANCE, reference_attention, rel_err

TIMEOUT = datetime.timedelta(seconds=30)

# (world, hp, cp, w): every world size, inner-only / outer-only / double rings, head-only and context-only.
LAYOUTS = [
    (1, 1, 1, 1),
    (2, 1, 2, 1), (2, 1, 2, 2), (2, 2, 1, 1),
    (4, 1, 4, 1), (4, 1, 4, 2), (4, 2, 2, 1), (4, 2, 2, 2), (4, 4, 1, 1),
    (8, 1, 8, 1), (8, 1, 8, 2), (8, 1, 8, 4), (8, 2, 4, 1), (8, 2, 4, 2), (8, 2, 4, 4),
    (8, 4, 2, 1), (8, 4, 2, 2), (8, 8, 1, 1),
]
PLACEMENTS = ["head_first", "context_first"]


def head_variants(hp):
    """(name, hq, hkv): MHA, GQA without replication (hp divides hkv), GQA with K/V replication."""
    variants = [("mha", 8, 8), ("gqa", 8, max(2, hp)), ("gqa_rep_hkv1", 8, 1)]
    if hp == 4:
        variants.append(("gqa_rep_hkv2", 8, 2))
    return [v for v in variants if not (v[0] == "gqa" and v[2] == 8)]


def make_inputs(seq, batch, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(seq, batch, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(seq, batch, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(seq, batch, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def check_case(groups, rank, world, dtype, causal, hq, hkv, d, batch=2, chunk=4, seed=0, kernel=None):
    """Run one case on this rank; return the max relative error over out, dq, dk, dv."""
    q, k, v, dout = make_inputs(2 * world * chunk, batch, hq, hkv, d, seed)
    for t in (q, k, v):
        t.requires_grad_(True)
    reference_attention(q, k, v, causal, d ** -0.5).backward(dout)
    ref_out = reference_attention(q.detach(), k.detach(), v.detach(), causal, d ** -0.5)

    def shard(x):
        return megatron_2d.shard_sequence(x.detach(), rank, world, seq_dim=0)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, kernel=kernel)
    out.backward(shard(dout).to(dtype))
    assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.shape == kl.shape
    return max(rel_err(out, shard(ref_out)), rel_err(ql.grad, shard(q.grad)),
               rel_err(kl.grad, shard(k.grad)), rel_err(vl.grad, shard(v.grad)))


def run_grid(rank, world, hp, w, placement):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    worst = {}
    for causal, (name, hq, hkv), d in itertools.product([True, False], head_variants(hp), [64, 128]):
        worst[(causal, name, d)] = check_case(groups, rank, world, torch.float32, causal, hq, hkv, d)
    return worst


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("world, hp, cp, w", LAYOUTS, ids=[f"N{n}-hp{h}-cp{c}-w{w}" for n, h, c, w in LAYOUTS])
def test_fp32_matches_reference(world, hp, cp, w, placement):
    assert hp * cp == world
    results = run_on_ranks(world, run_grid, hp, w, placement)
    bad = {case: err for per_rank in results for case, err in per_rank.items() if not err < TOLERANCE[torch.float32]}
    assert not bad, f"relative errors above {TOLERANCE[torch.float32]}: {bad}"
    assert len(results[0]) == 2 * len(head_variants(hp)) * 2


def run_low_precision(rank, world, hp, w, placement, dtype):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    return [check_case(groups, rank, world, dtype, causal, 8, hkv, 64)
            for causal, hkv in itertools.product([True, False], [8, 1])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hp, w, placement", [(2, 2, "head_first"), (2, 1, "context_first"), (1, 2, "head_first")])
def test_low_precision_matches_reference(hp, w, placement, dtype):
    errs = [e for per_rank in run_on_ranks(4, run_low_precision, hp, w, placement, dtype) for e in per_rank]
    assert max(errs) < TOLERANCE[dtype], errs


def run_torch_math_kernel(rank, world):
    groups = megatron_2d.build_2d_groups(2, 2, "context_first", timeout=TIMEOUT)
    return check_case(groups, rank, world, torch.float32, True, 8, 2, 64, kernel="torch_math")


def test_torch_math_kernel_in_the_ring():
    assert max(run_on_ranks(8, run_torch_math_kernel)) < TOLERANCE[torch.float32]


# ---- bytes sent, against the closed-form volume ------------------------------------------------------------

def expected_bytes(world, hp, w, hq, hkv, s_local, batch, d, elt):
    """Closed-form bytes one rank sends for one forward+backward (see megatron_2d.double_ring for the schedule)."""
    cp, windows = world // hp, world // hp // w
    heads_kv = math.lcm(hkv, hp)                    # K/V heads after replication
    token_head_bytes = s_local * batch * d * elt
    # forward: q, k, v to heads and out back; backward: dout to heads, dq, dk, dv back
    a2a = (hp - 1) * token_head_bytes * (4 * hq + 4 * heads_kv) // hp
    kv_block = 2 * batch * (hp * s_local) * (heads_kv // hp) * d        # elements in one packed K/V block
    inner_kv, outer_kv = windows * (w - 1), windows - 1                 # sends per pass (forward, then backward)
    inner_dkv = windows * w if w > 1 else 0
    outer_dkv = windows if windows > 1 else 0
    inner = 2 * inner_kv * kv_block * elt + inner_dkv * kv_block * 4
    outer = 2 * outer_kv * kv_block * elt + outer_dkv * kv_block * 4
    assert inner_kv + outer_kv == cp - 1
    return {"all_to_all": a2a, "inner_ring": inner, "outer_ring": outer, "neighbour": 0}  # causal: the ring


def run_bytes(rank, world, hp, w, placement, hkv, dtype):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    q, k, v, dout = make_inputs(2 * world * 4, 2, 8, hkv, 64, seed=3)
    ql, kl, vl = (megatron_2d.shard_sequence(x, rank, world).to(dtype).requires_grad_(True) for x in (q, k, v))
    groups.comm_bytes.reset()
    megatron_2d.attention_2d(ql, kl, vl, groups).backward(megatron_2d.shard_sequence(dout, rank, world).to(dtype))
    return groups.comm_bytes.as_dict()


@pytest.mark.parametrize("world, hp, w, placement, hkv, dtype", [
    (8, 2, 2, "head_first", 8, torch.float32),
    (8, 4, 1, "context_first", 1, torch.bfloat16),    # K/V replicated 4x
    (8, 1, 4, "head_first", 2, torch.float32),        # w = cp: inner ring only
    (8, 1, 1, "head_first", 8, torch.float32),        # w = 1: outer ring only
    (4, 4, 1, "head_first", 2, torch.float16),        # all-to-all only
])
def test_bytes_match_closed_form(world, hp, w, placement, hkv, dtype):
    per_rank = run_on_ranks(world, run_bytes, hp, w, placement, hkv, dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    expected = expected_bytes(world, hp, w, 8, hkv, s_local=8, batch=2, d=64, elt=elt)
    assert all(got == expected for got in per_rank), (per_rank[0], expected)


# ---- bad input gets a clear error ---------------------------------------------------------------------------

def run_input_errors(rank, world):
    groups = megatron_2d.build_2d_groups(4, 1, "head_first", timeout=TIMEOUT)
    q = torch.zeros(8, 1, 8, 16)
    cases = [
        ((torch.zeros(8, 1, 6, 16), torch.zeros(8, 1, 6, 16), torch.zeros(8, 1, 6, 16)),
         "head-parallel size 4 does not divide the 6 query heads on this rank; valid head-parallel sizes: [1, 2, 3, 6]"),
        ((q, torch.zeros(8, 1, 3, 16), torch.zeros(8, 1, 3, 16)),
         "8 query heads are not a multiple of 3 K/V heads"),
        ((torch.zeros(7, 1, 8, 16), torch.zeros(7, 1, 8, 16), torch.zeros(7, 1, 8, 16)),
         "the local sequence length 7 must be even"),
        ((q, torch.zeros(8, 1, 8, 16), torch.zeros(8, 1, 4, 16)), "k and v must have the same shape"),
        ((q, torch.zeros(6, 1, 8, 16), torch.zeros(6, 1, 8, 16)), "must agree on sequence, batch and head dim"),
        ((q, q.double(), q), "q, k, v must share a dtype"),
        ((q.int(), q.int(), q.int()), "dtype torch.int32 is not supported"),
        ((q[0], q[0], q[0]), "q, k, v must be 4-D [s, b, heads, d]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as info:
            megatron_2d.attention_2d(*args, groups)
        assert message in str(info.value), (message, str(info.value))
    dist.barrier()  # every rank still reaches collectives after the refusals
    return len(cases)


def test_bad_inputs_raise_clear_errors():
    assert run_on_ranks(4, run_input_errors) == [8] * 4


def run_mismatched_settings(rank, world):
    megatron_2d.build_2d_groups(2 if rank == 0 else 1, 1, timeout=TIMEOUT)


def test_mismatched_group_settings_fail_fast_on_every_rank():
    with pytest.raises(RankFailure, match=r"build_2d_groups called with different arguments"):
        run_on_ranks(2, run_mismatched_settings, timeout_s=30)


def run_bad_layout(rank, world, kwargs):
    megatron_2d.build_2d_groups(timeout=TIMEOUT, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_parallel_size=3, window_size=1), r"head-parallel size 3 does not divide the context-parallel size 4"),
    (dict(head_parallel_size=1, window_size=3), r"window size 3 does not divide the context size cp = CP/hp = 4/1 = 4"),
    (dict(head_parallel_size=2, window_size=1, placement="ring_first"), r"placement 'ring_first' is not valid"),
    (dict(head_parallel_size=2, window_size=1, cp_rank_lists=[[0, 1], [1, 2]]), r"ranks \[1\] appear more than once"),
    (dict(head_parallel_size=2, window_size=1, cp_rank_lists=[[0, 1]]), r"ranks \[2, 3\] are missing"),
])
def test_bad_layouts_raise_on_every_rank(kwargs, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(4, run_bad_layout, kwargs, timeout_s=30)


def run_multi_group(rank, world):
    """Two CP groups of 4 ranks (strided like TP=2): each computes its own sequence independently."""
    lists = [[0, 2, 4, 6], [1, 3, 5, 7]]
    groups = megatron_2d.build_2d_groups(2, 2, "context_first", cp_rank_lists=lists, timeout=TIMEOUT)
    cp_index = groups.place.cp_index
    assert groups.place.cp_ranks == tuple(lists[rank % 2])
    q, k, v, dout = make_inputs(2 * 4 * 4, 1, 8, 2, 32, seed=10 + rank % 2)
    for t in (q, k, v):
        t.requires_grad_(True)
    reference_attention(q, k, v, True, 32 ** -0.5).backward(dout)
    sh = lambda x: megatron_2d.shard_sequence(x.detach(), cp_index, 4)  # noqa: E731
    ql, kl, vl = (sh(x).float().requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups)
    out.backward(sh(dout).float())
    return max(rel_err(ql.grad, sh(q.grad)), rel_err(kl.grad, sh(k.grad)), rel_err(vl.grad, sh(v.grad)))


def test_several_cp_groups():
    assert max(run_on_ranks(8, run_multi_group)) < TOLERANCE[torch.float32]
