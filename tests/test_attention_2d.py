"""attention_2d on forked gloo ranks: forward output and dq/dk/dv against a single-process reference.

Every rank builds the same global tensors, shards them with the users' helper (shard_sequence, Megatron's zigzag),
runs the op, and compares its shard of out and of the gradients with the same shard of the reference.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import megatron_2d
import megatron_2d.attention  # noqa: F401  imported once here, not in every forked rank (PEP 562 exports)
import megatron_2d.groups
import megatron_2d.layout.topology
from megatron_2d.plan import ModelSpec, ParallelSpec, Scheme, evaluate, get_cluster
from megatron_2d.testing.distributed import GROUP_TIMEOUT, RankFailure, run_on_ranks
from megatron_2d.testing.reference import (
    TOLERANCES,
    norm_err,
    packed_reference_attention,
    reference_attention,
    rel_err,
    rounded,
)
from megatron_2d_dev.shared_worlds import run_by_world, run_each_on_ranks, selected_params

TIMEOUT = GROUP_TIMEOUT
SHARED_TIMEOUT_S = 180.0  # a shared world runs many layouts: a longer allowance before it counts as a livelock

# (world, hp, cp, w, placement): every world size, inner-only / outer-only / double rings, head-only and
# context-only. Where hp = 1 or cp = 1 both placements give the same rank map, so only head_first is listed;
# context_first runs wherever it is a different layout (hp > 1 and cp > 1).
BASE_LAYOUTS = [
    (1, 1, 1, 1),
    (2, 1, 2, 1),
    (2, 1, 2, 2),
    (2, 2, 1, 1),
    (4, 1, 4, 1),
    (4, 1, 4, 2),
    (4, 2, 2, 1),
    (4, 2, 2, 2),
    (4, 4, 1, 1),
    (8, 1, 8, 1),
    (8, 1, 8, 2),
    (8, 1, 8, 4),
    (8, 2, 4, 1),
    (8, 2, 4, 2),
    (8, 2, 4, 4),
    (8, 4, 2, 1),
    (8, 4, 2, 2),
    (8, 8, 1, 1),
]
PLACEMENTS = ["head_first", "context_first"]
LAYOUTS = [
    (n, hp, cp, w, p) for n, hp, cp, w in BASE_LAYOUTS for p in PLACEMENTS if p == "head_first" or (hp > 1 and cp > 1)
]


def layout_id(world, hp, cp, w, placement):
    return f"N{world}-hp{hp}-cp{cp}-w{w}-{placement}"


def head_variants(hp):
    """(hq, hkv) cases for head-parallel size hp: MHA, GQA whose K/V heads split over hp without replication,
    and GQA/MQA whose K/V heads must be replicated (one K/V head, and more than one), as far as hp allows."""
    cases = [(8, 8), (8, 1)]
    cases += [(8, hkv) for hkv in (2, 4) if hkv % hp == 0][:1]  # split without replication
    cases += {1: [], 2: [(12, 3)], 4: [(8, 2), (12, 3)], 8: [(8, 2), (8, 4)]}[hp]  # replicated, hkv > 1
    return cases


def variant_id(hq, hkv, hp):
    return f"hq{hq}-hkv{hkv}-rep{megatron_2d.kv_replication(hq, hkv, hp)}"


def make_inputs(seq, batch, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(seq, batch, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(seq, batch, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(seq, batch, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def run_case(
    groups,
    rank,
    world,
    dtype,
    causal,
    hq,
    hkv,
    d,
    batch=2,
    chunk=4,
    seed=0,
    kernel=None,
    scale=None,
    round_inputs=False,
):
    """Run one case on this rank: {out, dq, dk, dv: (rel_err vs the unrounded reference, norm_err vs the
    reference of the rounded inputs)}. ``round_inputs``: the global inputs are first rounded to ``dtype``, so the
    two references coincide and only the computation's own error is left."""
    (q, k, v, dout), ref = case_reference(world, dtype, causal, hq, hkv, d, batch, chunk, seed, scale, round_inputs)

    def shard(x):
        return megatron_2d.shard_sequence(x, rank, world, seq_dim=0)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, softmax_scale=scale, kernel=kernel)
    out.backward(shard(dout).to(dtype))
    assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.dtype == dtype and kl.grad.shape == kl.shape
    assert out.is_contiguous()  # Megatron views it as [s, b, h * d]
    pairs = dict(out=(out, ref[0]), dq=(ql.grad, ref[1]), dk=(kl.grad, ref[2]), dv=(vl.grad, ref[3]))
    return {key: (rel_err(a, shard(e)), norm_err(a, shard(e))) for key, (a, e) in pairs.items()}


def case_reference(world, dtype, causal, hq, hkv, d, batch=2, chunk=4, seed=0, scale=None, round_inputs=False, **_):
    """The global inputs of a :func:`run_case` case and their fp64 reference (out, dq, dk, dv). The test process
    calls it for every case before forking (:func:`computed_before_forking`) and the ranks inherit its cache: the
    reference depends on the case only, so every rank of every layout computing it again checked nothing more."""
    return _reference(
        2 * world * chunk,
        batch,
        hq,
        hkv,
        d,
        seed,
        causal,
        d**-0.5 if scale is None else scale,
        dtype if round_inputs else None,
    )


@functools.cache
def _reference(seq, batch, hq, hkv, d, seed, causal, scale, rounded_to):
    q, k, v, dout = make_inputs(seq, batch, hq, hkv, d, seed)
    if rounded_to is not None:
        q, k, v, dout = (rounded(x, rounded_to) for x in (q, k, v, dout))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref_out = reference_attention(*leaves, causal, scale)
    ref_out.backward(dout)
    return (q, k, v, dout), (ref_out.detach(), *(x.grad for x in leaves))


def computed_before_forking(world, cases):
    """Every case's reference, computed here once for the forked ranks (``cases``: :func:`run_case` keyword
    arguments besides groups, rank and world)."""
    for case in cases:
        case_reference(world, **case)


def check_case(groups, rank, world, dtype, causal, hq, hkv, d, **kwargs):
    """The max end-to-end relative error over out, dq, dk, dv of one case."""
    return max(rel for rel, _ in run_case(groups, rank, world, dtype, causal, hq, hkv, d, **kwargs).values())


def grid_cases(hp):
    """{key: run_case keyword arguments} of the fp32 grid at head-parallel size ``hp``."""
    f32 = torch.float32
    cases = {}
    for causal, (hq, hkv) in itertools.product([True, False], head_variants(hp)):
        d = 128 if hq == hkv else 64
        cases[(causal, variant_id(hq, hkv, hp), d)] = dict(dtype=f32, causal=causal, hq=hq, hkv=hkv, d=d)
    # a softmax scale other than 1/sqrt(d), with GQA, causal and full
    hq, hkv = head_variants(hp)[-1]
    for causal in (True, False):
        cases[(causal, "scale0.21", 32)] = dict(dtype=f32, causal=causal, hq=hq, hkv=hkv, d=32, scale=0.21)
    # batch 1, with the most K/V replication and without
    for hq, hkv in (head_variants(hp)[0], head_variants(hp)[-1]):
        cases[(True, "b1-" + variant_id(hq, hkv, hp), 32)] = dict(dtype=f32, causal=True, hq=hq, hkv=hkv, d=32, batch=1)
    return cases


def run_cases(rank, world, hp, w, placement, cases, case_fn):
    """``case_fn(groups, rank, world, **case)`` for every case, on one layout's groups (a shared world's call)."""
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    return {key: case_fn(groups, rank, world, **case) for key, case in cases.items()}


@pytest.fixture(scope="module")
def fp32_results(request):
    """The selected layouts' grids, one forked world per world size (megatron_2d_dev.shared_worlds)."""
    layouts = selected_params(request, "test_fp32_matches_reference", "world, hp, cp, w, placement")
    for world, hp, *_ in layouts:
        computed_before_forking(world, grid_cases(hp).values())
    calls = {x: (x[0], (run_cases, (x[1], x[3], x[4], grid_cases(x[1]), check_case))) for x in layouts}
    return run_by_world(calls, timeout_s=SHARED_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("world, hp, cp, w, placement", LAYOUTS, ids=[layout_id(*x) for x in LAYOUTS])
def test_fp32_matches_reference(fp32_results, world, hp, cp, w, placement):
    assert hp * cp == world
    results = fp32_results[(world, hp, cp, w, placement)]
    bad = {
        case: err
        for per_rank in results
        for case, err in per_rank.items()
        if not err < TOLERANCES[torch.float32].end_to_end
    }
    assert not bad, f"relative errors above {TOLERANCES[torch.float32].end_to_end}: {bad}"
    assert len(results[0]) == 2 * len(head_variants(hp)) + 2 + len({head_variants(hp)[0], head_variants(hp)[-1]})


def test_parametrization_is_distinct():
    """Every fp32 layout is a different rank map, and every head variant of an hp a different replication case."""
    maps = set()
    for world, hp, cp, w, placement in LAYOUTS:
        layout = megatron_2d.layout.topology.Layout2D(world, hp, w, placement)
        key = (
            world,
            w,
            tuple(map(tuple, layout.head_groups(range(world)))),
            tuple(map(tuple, layout.context_groups(range(world)))),
        )
        assert key not in maps, (world, hp, cp, w, placement)
        maps.add(key)
    for hp in (1, 2, 4, 8):
        ids = [variant_id(hq, hkv, hp) for hq, hkv in head_variants(hp)]
        assert len(set(ids)) == len(ids)
        reps = [megatron_2d.kv_replication(hq, hkv, hp) for hq, hkv in head_variants(hp)]
        assert (max(reps) > 1) == (hp > 1)
        if hp > 1:  # replication of more than one K/V head
            assert any(r > 1 and hkv > 1 for r, (_, hkv) in zip(reps, head_variants(hp)))


def run_torch_math_kernel(rank, world):
    groups = megatron_2d.build_2d_groups(2, 2, "context_first", timeout=TIMEOUT)
    return check_case(groups, rank, world, torch.float32, True, 8, 2, 64, kernel="torch_math")


@pytest.mark.distributed
def test_torch_math_kernel_in_the_ring():
    computed_before_forking(8, [dict(dtype=torch.float32, causal=True, hq=8, hkv=2, d=64)])
    assert max(run_on_ranks(8, run_torch_math_kernel)) < TOLERANCES[torch.float32].end_to_end


# ---- every dtype against the reference of its own rounded inputs, per output, at several CP sizes -----------

DTYPES = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
# (world, hp, w, placement): CP = 4 and 8, plain rings of 4 and 8 (where a low-precision accumulator hurts most:
# bf16 out 1.15x / 1.6x its bound at cp = 4 / 8, against 0.8x with fp32), a double ring, head-only, and 2D with a
# double ring. At cp = 2 a bf16 accumulator stays within 0.9x of the bound, so cp = 2 alone would not show it.
DTYPE_LAYOUTS = [
    (4, 1, 4, "head_first"),
    (4, 2, 1, "context_first"),
    (8, 1, 8, "head_first"),
    (8, 1, 2, "head_first"),
    (8, 2, 2, "context_first"),
    (8, 8, 1, "head_first"),
]


def dtype_cases():
    return {
        (name, causal, hkv): dict(
            dtype=DTYPES[name], causal=causal, hq=8, hkv=hkv, d=64, chunk=8, seed=1, round_inputs=True
        )
        for name, causal, hkv in itertools.product(DTYPES, [True, False], [2])
    }


@pytest.fixture(scope="module")
def dtype_results(request):
    """The selected layouts' dtype grids, one forked world per world size."""
    layouts = selected_params(request, "test_every_dtype_matches_its_rounded_reference", "world, hp, w, placement")
    cases = dtype_cases()
    for world in {x[0] for x in layouts}:
        computed_before_forking(world, cases.values())
    return run_by_world(
        {x: (x[0], (run_cases, (*x[1:], cases, run_case))) for x in layouts}, timeout_s=SHARED_TIMEOUT_S
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, w, placement", DTYPE_LAYOUTS, ids=[layout_id(n, hp, n // hp, w, p) for n, hp, w, p in DTYPE_LAYOUTS]
)
def test_every_dtype_matches_its_rounded_reference(dtype_results, world, hp, w, placement):
    """fp64, bf16 and fp16, forward and backward: each output's error against fp64 math on the same rounded
    inputs, within that output's bound (norm_err); the fp32 accumulators keep it flat as CP grows."""
    bad = {}
    for per_rank in dtype_results[(world, hp, w, placement)]:
        for (name, causal, hkv), errors in per_rank.items():
            tol = TOLERANCES[DTYPES[name]]
            for key, (rel, norm) in errors.items():
                if not (norm < tol.of(key) and rel < tol.end_to_end):
                    bad[(name, causal, hkv, key)] = (rel, norm)
    assert not bad, f"(dtype, causal, hkv, output): (rel_err, norm_err) above tolerance: {bad}"


# ---- bytes sent, against the closed-form volume ------------------------------------------------------------


def expected_bytes(world, hp, w, hq, hkv, s_local, batch, d, elt):
    """Closed-form bytes one rank sends for one forward+backward (see megatron_2d.transport.double_ring for the
    schedule)."""
    cp, nw = world // hp, world // hp // w
    heads_kv = math.lcm(hkv, hp)  # K/V heads after replication
    token_head_bytes = s_local * batch * d * elt
    # forward: q, k, v to heads and out back; backward: dout to heads, dq, dk, dv back
    a2a = (hp - 1) * token_head_bytes * (4 * hq + 4 * heads_kv) // hp
    kv_block = 2 * batch * (hp * s_local) * (heads_kv // hp) * d  # elements in one packed K/V block
    inner_kv, outer_kv = nw * (w - 1), nw - 1  # sends per pass (forward, then backward)
    # dK/dV: the own block's stays home, so round 0's rider starts at step 1; the last hop is inner only at w = cp,
    # and with w = 1 round 0 carries nothing over the outer ring
    inner_dkv = (nw - 1) * (w - 1) + max(w - 2, 0) + (1 if nw == 1 and w > 1 else 0)
    outer_dkv = nw - (1 if w == 1 else 0) if nw > 1 else 0
    inner = 2 * inner_kv * kv_block * elt + inner_dkv * kv_block * 4
    outer = 2 * outer_kv * kv_block * elt + outer_dkv * kv_block * 4
    assert inner_kv + outer_kv == cp - 1 and inner_dkv + outer_dkv == cp - 1
    return {"all_to_all": a2a, "inner_ring": inner, "outer_ring": outer, "neighbour": 0}  # causal: the ring


def run_bytes(rank, world, hp, w, placement, hkv, dtype, batch=2):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    q, k, v, dout = make_inputs(2 * world * 4, batch, 8, hkv, 64, seed=3)
    ql, kl, vl = (megatron_2d.shard_sequence(x, rank, world).to(dtype).requires_grad_(True) for x in (q, k, v))
    groups.comm_bytes.reset()
    megatron_2d.attention_2d(ql, kl, vl, groups).backward(megatron_2d.shard_sequence(dout, rank, world).to(dtype))
    return groups.comm_bytes.as_dict()


BYTE_CASES = [
    (8, 2, 2, "head_first", 8, torch.float32),
    (8, 4, 1, "context_first", 1, torch.bfloat16),  # K/V replicated 4x
    (8, 1, 4, "head_first", 2, torch.float32),  # w = cp: inner ring only
    (8, 1, 1, "head_first", 8, torch.float32),  # w = 1: outer ring only
    (4, 4, 1, "head_first", 2, torch.float16),  # all-to-all only
    (8, 2, 2, "context_first", 2, torch.bfloat16),  # 2D with a double ring
    (8, 1, 2, "head_first", 8, torch.bfloat16),  # double ring, no all-to-all
]


@pytest.mark.distributed
def test_bytes_batch_one():
    """Batch 1: the same bytes as the closed form."""
    hkvs = (8, 1)  # K/V split, and replicated
    calls = [(run_bytes, (2, 2, "context_first", hkv, torch.float32, 1)) for hkv in hkvs]
    for hkv, per_rank in zip(hkvs, run_each_on_ranks(8, calls)):
        expected = expected_bytes(8, 2, 2, 8, hkv, s_local=8, batch=1, d=64, elt=4)
        assert all(got == expected for got in per_rank), (per_rank[0], expected)


def run_head_exchange_path(rank, world):
    """Batch 1: which exchange functions ran, and the error."""
    import megatron_2d.head_all_to_all as exchange

    used = set()
    for name in ("to_heads", "to_tokens"):

        def recorded(*args, _fn=getattr(exchange, name), _name=name, **kwargs):  # noqa: B008  (bound per name)
            used.add(_name)
            return _fn(*args, **kwargs)

        setattr(exchange, name, recorded)
    groups = megatron_2d.build_2d_groups(2, 1, "context_first", timeout=TIMEOUT)
    return check_case(groups, rank, world, torch.float32, True, 8, 2, 32, batch=1), sorted(used)


@pytest.mark.distributed
def test_one_head_exchange_at_batch_one():
    """Batch 1 on gloo takes the collective all-to-all like any batch (docs/benchmarks.md: a point-to-point path
    measured no faster there), exactly."""
    computed_before_forking(4, [dict(dtype=torch.float32, causal=True, hq=8, hkv=2, d=32, batch=1)])
    for err, used in run_on_ranks(4, run_head_exchange_path):
        assert used == ["to_heads", "to_tokens"] and err < TOLERANCES[torch.float32].end_to_end, (used, err)


def planner_bytes(world, hp, w, placement, hkv, gpus_per_node):
    """The planner's (NVLink, network) bytes per rank for the op's case (bf16, one layer, fwd + bwd)."""
    model = ModelSpec("op", layers=1, hidden=8 * 64, heads=8, kv_heads=hkv, ffn_hidden=64, vocab=64)
    cluster = get_cluster("8xH100").with_(gpus_per_node=gpus_per_node)
    e = evaluate(
        Scheme("2d", hp, world // hp, w, placement),
        model,
        cluster,
        ParallelSpec(gpus=world, micro_batch=2),
        seq=2 * world * 4,
    ).estimate
    return e.intra_bytes, e.inter_bytes


@pytest.fixture(scope="module")
def byte_results(request):
    """The selected byte cases, one forked world per world size."""
    cases = selected_params(request, "test_bytes_match_closed_form", "world, hp, w, placement, hkv, dtype")
    return run_by_world({x: (x[0], (run_bytes, x[1:])) for x in cases})


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, w, placement, hkv, dtype",
    BYTE_CASES,
    ids=[f"N{n}-hp{h}-w{w}-{p}-hkv{k}-{str(dt)[6:]}" for n, h, w, p, k, dt in BYTE_CASES],
)
def test_bytes_match_closed_form(byte_results, world, hp, w, placement, hkv, dtype):
    per_rank = byte_results[(world, hp, w, placement, hkv, dtype)]
    elt = torch.tensor([], dtype=dtype).element_size()
    expected = expected_bytes(world, hp, w, 8, hkv, s_local=8, batch=2, d=64, elt=elt)
    assert all(got == expected for got in per_rank), (per_rank[0], expected)
    if dtype == torch.bfloat16:  # the planner counts bf16 K/V and all-to-all, fp32 dK/dV: the op's measured bytes
        measured = per_rank[0]
        total = sum(measured.values())
        assert planner_bytes(world, hp, w, placement, hkv, gpus_per_node=world) == (total, 0)
        rings = measured["inner_ring"] + measured["outer_ring"]
        if placement == "head_first" and hp > 1:  # head groups fill a node: all-to-all on NVLink only
            assert planner_bytes(world, hp, w, placement, hkv, gpus_per_node=hp) == (measured["all_to_all"], rings)
        if placement == "context_first" or hp == 1:  # context groups fill a node: rings on NVLink only
            cp = world // hp
            assert planner_bytes(world, hp, w, placement, hkv, gpus_per_node=cp) == (rings, measured["all_to_all"])


# ---- bad input gets a clear error ---------------------------------------------------------------------------


def run_input_errors(rank, world):
    groups = megatron_2d.build_2d_groups(4, 1, "head_first", timeout=TIMEOUT)
    q = torch.zeros(8, 1, 8, 16)
    cases = [
        (
            (torch.zeros(8, 1, 6, 16), torch.zeros(8, 1, 6, 16), torch.zeros(8, 1, 6, 16)),
            "head-parallel size 4 does not divide the 6 query heads on this rank; "
            "valid head-parallel sizes: [1, 2, 3, 6]",
        ),
        ((q, torch.zeros(8, 1, 3, 16), torch.zeros(8, 1, 3, 16)), "8 query heads are not a multiple of 3 K/V heads"),
        (
            (torch.zeros(7, 1, 8, 16), torch.zeros(7, 1, 8, 16), torch.zeros(7, 1, 8, 16)),
            "the local sequence length 7 must be even",
        ),
        ((q, torch.zeros(8, 1, 8, 16), torch.zeros(8, 1, 4, 16)), "k and v must agree on sequence, batch and heads"),
        ((q, torch.zeros(6, 1, 8, 16), torch.zeros(6, 1, 8, 16)), "must agree on sequence, batch and head dim"),
        ((q, q.double(), q), "q, k, v must share a dtype"),
        ((q.int(), q.int(), q.int()), "dtype torch.int32 is not supported"),
        ((q[0], q[0], q[0]), "q, k, v must be 4-D [s, b, heads, d]"),
        ((q, q.to("meta"), q.to("meta")), "q, k, v must be on one device"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as info:
            megatron_2d.attention_2d(*args, groups)
        assert message in str(info.value), (message, str(info.value))
    dist.barrier()  # every rank still reaches collectives after the refusals
    # new groups inherit the default group's timeout (run_on_ranks gives it 10 min), not torch's 30 min
    assert megatron_2d.groups.default_group_timeout() == datetime.timedelta(minutes=10) == GROUP_TIMEOUT
    return len(cases)


@pytest.mark.distributed
def test_bad_inputs_raise_clear_errors():
    assert run_on_ranks(4, run_input_errors) == [9] * 4


def run_mismatched_settings(rank, world):
    megatron_2d.build_2d_groups(2 if rank == 0 else 1, 1, timeout=TIMEOUT)


@pytest.mark.distributed
def test_mismatched_group_settings_fail_fast_on_every_rank():
    with pytest.raises(RankFailure, match=r"build_2d_groups called with different arguments"):
        run_on_ranks(2, run_mismatched_settings, timeout_s=30)


def run_bad_layout(rank, world, kwargs):
    megatron_2d.build_2d_groups(timeout=TIMEOUT, **kwargs)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(head_parallel_size=3, inner_ring_size=1),
            r"head-parallel size 3 does not divide the context-parallel size 4",
        ),
        (
            dict(head_parallel_size=1, inner_ring_size=3),
            r"inner ring size 3 does not divide the context size cp = CP/hp = 4/1 = 4",
        ),
        (dict(head_parallel_size=2, inner_ring_size=1, placement="ring_first"), r"placement 'ring_first' is not valid"),
        (
            dict(head_parallel_size=2, inner_ring_size=1, cp_rank_lists=[[0, 1], [1, 2]]),
            r"ranks \[1\] appear more than once",
        ),
        (dict(head_parallel_size=2, inner_ring_size=1, cp_rank_lists=[[0, 1]]), r"ranks \[2, 3\] are missing"),
    ],
)
def test_bad_layouts_raise_on_every_rank(kwargs, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(4, run_bad_layout, kwargs, timeout_s=30)


def run_multi_group(rank, world):
    """Two CP groups of 4 ranks (strided like TP=2): each computes its own sequence independently."""
    lists = [[0, 2, 4, 6], [1, 3, 5, 7]]
    groups = megatron_2d.build_2d_groups(2, 2, "context_first", cp_rank_lists=lists, timeout=TIMEOUT)
    cp_index = groups.place.cp_index
    assert groups.place.cp_ranks == tuple(lists[rank % 2])
    (q, k, v, dout), (_, dq, dk, dv) = _reference(2 * 4 * 4, 1, 8, 2, 32, 10 + rank % 2, True, 32**-0.5, None)
    sh = lambda x: megatron_2d.shard_sequence(x, cp_index, 4)  # noqa: E731
    ql, kl, vl = (sh(x).float().requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups)
    out.backward(sh(dout).float())
    return max(rel_err(ql.grad, sh(dq)), rel_err(kl.grad, sh(dk)), rel_err(vl.grad, sh(dv)))


@pytest.mark.distributed
def test_several_cp_groups():
    for seed in (10, 11):  # each CP group's reference, computed here once for its forked ranks
        _reference(2 * 4 * 4, 1, 8, 2, 32, seed, True, 32**-0.5, None)
    assert max(run_on_ranks(8, run_multi_group)) < TOLERANCES[torch.float32].end_to_end


# ---- CP rank lists in any order ------------------------------------------------------------------------------
# torch's new_group sorts its ranks, so a head group's group ranks need not be its head ranks (the placement's);
# the head all-to-all routes by head rank (batch 2 and batch 1) and the
# sinks slice follows the same head rank. Orders: reversed, shuffled, and two strided lists in descending order.
RANK_ORDERS = [
    (2, 2, "head_first", [[7, 6, 5, 4, 3, 2, 1, 0]]),
    (4, 1, "context_first", [[3, 0, 6, 5, 1, 7, 2, 4]]),
    (2, 1, "context_first", [[6, 4, 2, 0], [7, 5, 3, 1]]),
]


def run_rank_order(rank, world, hp, w, placement, lists):
    groups = megatron_2d.build_2d_groups(hp, w, placement, cp_rank_lists=lists, timeout=TIMEOUT)
    mine = next(i for i, ranks in enumerate(lists) if rank in ranks)
    cp_index, CP = groups.place.cp_index, len(lists[0])
    assert lists[mine][cp_index] == rank
    results = {}
    for batch, causal, packed in RANK_ORDER_CASES:
        (q, k, v, dout, sinks), (ref, *leaves) = rank_order_reference(mine, CP, batch, causal, packed)
        if packed:
            layout = megatron_2d.PackedSharding(torch.tensor([0, 5, 17, 18, 2 * CP * 4]), groups, mode="zigzag")
            shard = lambda x: layout.shard(x[:, 0] if x.dim() == 4 else x)  # noqa: E731
        else:
            shard = lambda x: megatron_2d.shard_sequence(x, cp_index, CP)  # noqa: E731
        local = [shard(x).float().requires_grad_(True) for x in (q, k, v)]
        local_sinks = sinks.float().requires_grad_(True)
        out = megatron_2d.attention_2d(
            *local, groups, causal=causal, sinks=local_sinks, packing=layout if packed else None
        )
        out.backward(shard(dout).float())
        pairs = (
            ("out", out, ref),
            ("dq", local[0].grad, leaves[0]),
            ("dk", local[1].grad, leaves[1]),
            ("dv", local[2].grad, leaves[2]),
        )
        errors = {key: rel_err(a, shard(e)) for key, a, e in pairs}
        results[(batch, causal, packed)] = (errors, local_sinks.grad.double(), leaves[3])
    return mine, results


RANK_ORDER_CASES = ((1, True, False), (2, False, False), (1, True, True))  # (batch, causal, packed)


@functools.cache
def rank_order_reference(mine, CP, batch, causal, packed):
    """CP group ``mine``'s inputs (q, k, v, dout, sinks) and fp64 reference (out, dq, dk, dv, d sinks), computed
    once in the test process for the forked ranks (:func:`case_reference`)."""
    g = torch.Generator().manual_seed(30 + mine)
    seq = 2 * CP * 4
    q, k, v, dout = (torch.randn(seq, batch, h, 32, generator=g, dtype=torch.float64) for h in (8, 2, 2, 8))
    sinks = torch.randn(8, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    if packed:
        cu = torch.tensor([0, 5, 17, 18, seq])
        ref = packed_reference_attention(*(x[:, 0] for x in leaves[:3]), cu, causal, 32**-0.5, sinks=leaves[3])
        ref.backward(dout[:, 0])
    else:
        ref = reference_attention(*leaves[:3], causal, 32**-0.5, sinks=leaves[3])
        ref.backward(dout)
    return (q, k, v, dout, sinks), (ref.detach(), *(x.grad for x in leaves))


@pytest.fixture(scope="module")
def rank_order_results(request):
    """The selected rank orders, in one forked world."""
    orders = selected_params(request, "test_cp_rank_lists_in_any_order", "hp, w, placement, lists")
    for *_, lists in orders:
        for mine, case in itertools.product(range(len(lists)), RANK_ORDER_CASES):
            rank_order_reference(mine, len(lists[0]), *case)  # computed here once for the forked ranks
    return run_each_on_ranks(8, [(run_rank_order, order) for order in orders]), orders


@pytest.mark.distributed
@pytest.mark.parametrize("hp, w, placement, lists", RANK_ORDERS, ids=["reversed", "shuffled", "strided-descending"])
def test_cp_rank_lists_in_any_order(rank_order_results, hp, w, placement, lists):
    """Exact with CP rank lists that are not ascending: out, dq, dk, dv per rank, and the sinks' gradient summed
    over each CP group."""
    per_call, orders = rank_order_results
    per_rank = per_call[orders.index((hp, w, placement, lists))]
    bad = {}
    for case in per_rank[0][1]:
        for mine in range(len(lists)):
            ranks = [r for r in per_rank if r[0] == mine]
            for _, results in ranks:
                errors, _, _ = results[case]
                bad.update(
                    {(mine, case, key): e for key, e in errors.items() if not e < TOLERANCES[torch.float32].end_to_end}
                )
            summed = sum(results[case][1] for _, results in ranks)
            err = rel_err(summed, ranks[0][1][case][2])
            if not err < TOLERANCES[torch.float32].end_to_end:
                bad[(mine, case, "dsinks")] = err
    assert not bad, bad
