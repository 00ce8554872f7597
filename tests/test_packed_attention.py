"""Packed documents (THD) through attention_2d on forked gloo ranks, against a per-document reference.

Every rank builds the same packed global tensors, shards them with the users' helper (``PackedSharding.shard``),
runs the op, and compares its slots of out and of dq/dk/dv with the same slots of a single-process fp64
reference in which each document attends only to itself.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it on first use: once here, not in every forked rank
import pytest
import torch

import megatron_2d
import megatron_2d.attention  # noqa: F401  imported once here, not in every forked rank (PEP 562 exports)
import megatron_2d.packed_sharding  # noqa: F401
from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.packing.calls import Runs
from megatron_2d.packing.modes import PackingMode, mode_class, mode_names, register, unregister
from megatron_2d.packing.sharding import PackingCost, shard_documents, zigzag_slots
from megatron_2d.packing.views import context_rank_of
from megatron_2d.testing.distributed import GROUP_TIMEOUT, RankFailure, run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, packed_reference_attention, rel_err, rounded
from megatron_2d_dev.shared_worlds import run_by_world, run_each_on_ranks, selected_params

TIMEOUT = GROUP_TIMEOUT
SHARED_TIMEOUT_S = 180.0  # a shared world runs many layouts: a longer allowance before it counts as a livelock

LENGTHS = {
    "mixed": [1, 37, 200, 5, 64, 3, 90, 400, 11],  # length 1, lengths divisible by nothing
    "one_long": [7, 700, 30, 2, 61],  # one document longer than all the rest together
    "single": [480],  # one document: the sbhd op's sequence
    "per_sequence": [1, 37, 200, 5, 64, 3, 90, 400, 11, 1, 4],  # 816 = 17 * 48: the sequence mode at every CP here
}


def layout_case_keys(world):
    """(mode, lengths name, causal) of every case run on a layout of ``world`` ranks: zigzag and documents on the
    hand-picked lengths, the sequence mode (which cuts the stream into 2*CP chunks, so 2*CP must divide T) on
    ``per_sequence``."""
    assert all(sum(LENGTHS["per_sequence"]) % (2 * n) == 0 for n, _, _, _ in LAYOUTS)
    return [
        (mode, name, causal)
        for mode in PACKING_MODES
        for name in LENGTHS
        if (name == "per_sequence") == (mode == "sequence")
        for causal in ((True, False) if name in ("mixed", "per_sequence") else (True,))
    ]


# (world, hp, w, placement): worlds 1, 2, 4, 6, 8; the layouts (hp x cp x w) 1x8x2, 2x4x2, 4x2x1, 8x1x1,
# 2x3x1 at world 6; context_first wherever it is a different rank map
LAYOUTS = [
    (1, 1, 1, "head_first"),
    (2, 1, 2, "head_first"),
    (2, 2, 1, "head_first"),
    (4, 1, 2, "head_first"),
    (4, 2, 1, "context_first"),
    (6, 2, 1, "context_first"),
    (6, 1, 3, "head_first"),
    (8, 1, 2, "head_first"),
    (8, 2, 2, "context_first"),
    (8, 4, 1, "head_first"),
    (8, 8, 1, "head_first"),
]


def packed_inputs(lengths, hq, hkv, d, seed=0):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    g = torch.Generator().manual_seed(seed)
    T = int(cu[-1])
    q, k, v, dout = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    return cu, q, k, v, dout


class PackedCase(NamedTuple):
    """One case's inputs (rounded to ``dtype``, fp64) and its fp64 per-document reference with gradients."""

    causal: bool
    dtype: torch.dtype
    window: tuple[int, int]
    d: int
    cu: np.ndarray
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    sink: torch.Tensor | None
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsink: torch.Tensor | None


@functools.cache
def packed_case(lengths, causal, hq, hkv, d=16, dtype=torch.float32, window=(-1, -1), sinks=False, seed=0):
    """The case's inputs and reference, computed once in the test process and handed to the forked ranks (which
    inherit it): the reference depends on the case only, not on the layout or the rank, so every rank of every
    layout computing it again (85% of the ranks' CPU time) checked nothing more."""
    cu, q, k, v, dout = packed_inputs(list(lengths), hq, hkv, d, seed)
    q, k, v, dout = (rounded(x, dtype) for x in (q, k, v, dout))
    sink = torch.linspace(-1.0, 1.0, hq, dtype=torch.float64) if sinks else None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v) + ((sink,) if sinks else ())]
    ref = packed_reference_attention(
        *leaves[:3], cu, causal, d**-0.5, window=window, sinks=leaves[3] if sinks else None
    )
    ref.backward(dout)
    grads = [x.grad for x in leaves]
    return PackedCase(
        causal, dtype, window, d, cu, q, k, v, dout, sink, ref.detach(), *grads[:3], grads[3] if sinks else None
    )


def run_packed(groups, mode, case: PackedCase):
    """One case on this rank: (errors by output, padding checks, sink gradient of this rank's rows, the reference's
    sink gradient)."""
    layout = megatron_2d.PackedSharding(torch.tensor(case.cu, dtype=torch.int32), groups, mode=mode)
    dtype = case.dtype
    ql, kl, vl = (layout.shard(x).to(dtype).requires_grad_(True) for x in (case.q, case.k, case.v))
    local_sink = None if case.sink is None else case.sink.float().requires_grad_(True)
    out = megatron_2d.attention_2d(
        ql, kl, vl, groups, causal=case.causal, sliding_window=case.window, sinks=local_sink, packing=layout
    )
    out.backward(layout.shard(case.dout).to(dtype))
    pad = layout.local_indices() < 0
    grads = (out, ql.grad, kl.grad, vl.grad)
    padding = {
        "no_nan": all(bool(torch.isfinite(x).all()) for x in grads),
        "pad_zero": all(bool((x[pad] == 0).all()) for x in grads),
        "pad_slots": int(pad.sum()),
    }
    # max |error| on this rank's slots over max |reference| of the whole tensor (a rank may hold only tokens
    # whose reference gradient is exactly zero, e.g. first tokens of documents for dq)
    errs = {
        name: ((a.double() - layout.shard(e)).abs().max() / e.abs().max()).item()
        for name, (a, e) in dict(
            out=(out, case.out), dq=(ql.grad, case.dq), dk=(kl.grad, case.dk), dv=(vl.grad, case.dv)
        ).items()
    }
    sink_grad = None if local_sink is None else local_sink.grad.double()
    return errs, padding, sink_grad, case.dsink


def layout_heads(hp):
    return (8, 2) if hp in (4, 8) else (8, 1)  # GQA with K/V replication whenever hp > 1


def layout_inputs(world, hp):
    """The cases of a layout of ``world`` ranks, by (mode, lengths name, causal)."""
    hq, hkv = layout_heads(hp)
    return {
        (m, name, causal): packed_case(tuple(LENGTHS[name]), causal, hq, hkv)
        for m, name, causal in layout_case_keys(world)
    }


def layout_cases(rank, world, hp, w, placement, cases):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    return {key: run_packed(groups, key[0], case)[:2] for key, case in cases.items()}


@pytest.fixture(scope="module")
def fp32_results(request):
    """The selected layouts' cases, one forked world per world size (megatron_2d_dev.shared_worlds)."""
    layouts = selected_params(request, "test_packed_fp32_matches_per_document_reference", "world, hp, w, placement")
    calls = {x: (x[0], (layout_cases, (*x[1:], layout_inputs(x[0], x[1])))) for x in layouts}
    return run_by_world(calls, timeout_s=SHARED_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, w, placement", LAYOUTS, ids=[f"N{n}-hp{hp}-cp{n // hp}-w{w}-{p}" for n, hp, w, p in LAYOUTS]
)
def test_packed_fp32_matches_per_document_reference(fp32_results, world, hp, w, placement):
    results = fp32_results[(world, hp, w, placement)]
    tol = TOLERANCES[torch.float32].end_to_end
    expected = set(layout_case_keys(world))
    assert ("sequence", "per_sequence", True) in expected and len(PACKING_MODES) == 3
    for rank, per_rank in enumerate(results):
        assert set(per_rank) == expected
        for case, (errs, padding) in per_rank.items():
            assert max(errs.values()) < tol, (rank, case, errs)
            assert padding["no_nan"] and padding["pad_zero"], (rank, case, padding)
    # zigzag pads every document to a multiple of 2*CP: padding slots exist and were checked
    assert world == 1 or any(
        p["pad_slots"] for per_rank in results for (m, _, _), (_, p) in per_rank.items() if m == "zigzag"
    )


ONE_TOKEN_DOCUMENTS = [1] * 40 + [5, 9]  # issue 25's reproduction: garbage dq/dk reported at world 8


def one_token_inputs():
    # the sequence mode cuts the stream into 2*CP chunks: a last document of 10 tokens makes T = 64
    return {
        mode: packed_case(tuple(ONE_TOKEN_DOCUMENTS + ([10] if mode == "sequence" else [])), True, 8, 8)
        for mode in PACKING_MODES
    }


def one_token_documents(rank, world, hp, w, cases):
    groups = megatron_2d.build_2d_groups(hp, w, "head_first", timeout=TIMEOUT)
    return {mode: run_packed(groups, mode, case)[:2] for mode, case in cases.items()}


@pytest.fixture(scope="module")
def one_token_results(request):
    """The selected layouts, in one forked world."""
    layouts = selected_params(request, "test_one_token_documents_at_world_8", "hp, w")
    per_call = run_each_on_ranks(8, [(one_token_documents, (*x, one_token_inputs())) for x in layouts])
    return dict(zip(layouts, per_call))


@pytest.mark.distributed
@pytest.mark.parametrize("hp, w", [(1, 2), (4, 1), (2, 2)], ids=["hp1-cp8-w2", "hp4-cp2-w1", "hp2-cp4-w2"])
def test_one_token_documents_at_world_8(one_token_results, hp, w):
    """The reported case (fp32, causal, hq = hkv = 8, d = 16, forty one-token documents) in every mode."""
    for per_rank in one_token_results[(hp, w)]:
        assert set(per_rank) == set(PACKING_MODES)
        for mode, (errs, padding) in per_rank.items():
            assert max(errs.values()) < TOLERANCES[torch.float32].end_to_end, (mode, errs)
            assert padding["no_nan"] and padding["pad_zero"], (mode, padding)


def tiny_documents(rank, world, case):
    groups = megatron_2d.build_2d_groups(1, 2, "head_first", timeout=TIMEOUT)
    return {mode: run_packed(groups, mode, case)[:2] for mode in ("zigzag", "documents")}


@pytest.mark.distributed
def test_thousand_tiny_documents():
    lengths = tuple((np.arange(1000) % 3 + 1).tolist())  # 1000 documents of 1-3 tokens
    for per_rank in run_on_ranks(4, tiny_documents, packed_case(lengths, True, 4, 2)):
        for mode, (errs, padding) in per_rank.items():
            assert max(errs.values()) < TOLERANCES[torch.float32].end_to_end, (mode, errs)
            assert padding["no_nan"] and padding["pad_zero"]


def bf16_and_masks_inputs():
    cases = {}
    for mode in PACKING_MODES:
        lengths = tuple(LENGTHS["per_sequence" if mode == "sequence" else "mixed"])
        cases[(mode, "bf16")] = packed_case(lengths, True, 8, 2, dtype=torch.bfloat16)
        cases[(mode, "fp16")] = packed_case(lengths, True, 8, 2, dtype=torch.float16)
        cases[(mode, "window")] = packed_case(lengths, True, 8, 2, window=(20, 0))
        cases[(mode, "sinks")] = packed_case(lengths, True, 8, 2, sinks=True)
    return cases


def bf16_and_masks(rank, world, cases):
    groups = megatron_2d.build_2d_groups(2, 2, "context_first", timeout=TIMEOUT)
    out = {}
    for (mode, kind), case in cases.items():
        errs, _, sink_grad, ref_sink_grad = run_packed(groups, mode, case)
        out[(mode, kind)] = (errs, sink_grad, ref_sink_grad) if kind == "sinks" else errs
    return out


@pytest.mark.distributed
def test_packed_bf16_fp16_windows_and_sinks():
    """bf16/fp16 within their end-to-end tolerance (inputs rounded to the dtype, so the error is the op's own
    plus the output rounding), a sliding window within documents, and learnable sinks whose per-rank gradients
    sum to the reference's."""
    results = run_on_ranks(8, bf16_and_masks, bf16_and_masks_inputs())
    for mode in PACKING_MODES:
        for dtype in ("bf16", "fp16"):
            tol = TOLERANCES[torch.bfloat16 if dtype == "bf16" else torch.float16].end_to_end
            assert all(max(r[(mode, dtype)].values()) < tol for r in results), (mode, dtype)
        assert all(max(r[(mode, "window")].values()) < TOLERANCES[torch.float32].end_to_end for r in results)
        assert all(max(r[(mode, "sinks")][0].values()) < TOLERANCES[torch.float32].end_to_end for r in results)
        total = sum(r[(mode, "sinks")][1] for r in results)
        assert rel_err(total, results[0][(mode, "sinks")][2]) < TOLERANCES[torch.float32].end_to_end


def single_document_equals_sbhd(rank, world):
    """One document whose length splits into 2*CP chunks: zigzag THD slots are the sbhd zigzag shard, so the op
    must give the sbhd op's result."""
    groups = megatron_2d.build_2d_groups(2, 1, "head_first", timeout=TIMEOUT)
    cu, q, k, v, dout = packed_inputs([2 * world * 24], 8, 2, 16)
    layout = megatron_2d.PackedSharding(cu, groups, mode="zigzag")
    thd = megatron_2d.attention_2d(*(layout.shard(x).float() for x in (q, k, v)), groups, packing=layout)
    sbhd = megatron_2d.attention_2d(
        *(megatron_2d.shard_sequence(x, rank, world).unsqueeze(1).float() for x in (q, k, v)), groups
    )
    return rel_err(thd, sbhd.squeeze(1)), layout.padding_fraction


@pytest.mark.distributed
def test_single_document_equals_the_sbhd_op():
    for err, padding in run_on_ranks(4, single_document_equals_sbhd):
        assert padding == 0.0
        assert err < 1e-6


# -- the layouts themselves -------------------------------------------------------------------------------
def te_partitioned_indices(cu_seqlens_padded, total_tokens, world, rank):
    """Transformer Engine's thd_get_partitioned_indices as its CUDA kernel states it (one local token at a
    time; an independent statement of the layout, not the implementation under test)."""
    cu_s = [c // world for c in cu_seqlens_padded]
    out = []
    for token in range(total_tokens // world):
        seq = max(i for i in range(len(cu_s) - 1) if cu_s[i] <= token)
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu_s[seq] * world + seq_len // 2 * offset)
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_zigzag_slots_equal_transformer_engine_partitioning(cp_size):
    """Megatron's get_batch_on_this_cp_rank index_selects TE's thd_get_partitioned_indices(cu_seqlens_padded,
    T_padded, CP, rank) from the padded stream; our zigzag slots, mapped to that stream, are the same indices."""
    lengths = np.array([1, 37, 200, 5, 64, 3, 90, 400, 11])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    padded = -(-lengths // (2 * cp_size)) * (2 * cp_size)
    cu_pad = np.concatenate([[0], np.cumsum(padded)])
    slots = zigzag_slots(cu, cp_size, padded)
    assert cp_size == 1 or (slots == zigzag_slots(cu, cp_size)).all()  # the default padding is this one
    for rank in range(cp_size):
        expected = te_partitioned_indices(cu_pad.tolist(), int(cu_pad[-1]), cp_size, rank)
        # our slot -> padded-stream index: document start in the padded stream + position in the document
        pos_stream = []
        doc_of_expected = np.searchsorted(cu_pad, expected, side="right") - 1
        for e, doc in zip(expected, doc_of_expected):
            pos = e - cu_pad[doc]
            pos_stream.append(cu[doc] + pos if pos < lengths[doc] else -1)
        assert slots[rank].tolist() == pos_stream


@pytest.mark.slow
def test_documents_sharding_chooses_by_cost_and_keeps_short_documents_whole():
    """The documents sharding shards the k longest documents for the k whose sharding predicts the shortest
    step (checked against every k sharded for real), under a GPU-like and a CPU-like cost; whatever it chooses, every
    real token is placed once, whole documents lie contiguous on their owner, only sharded ones are padded."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(5.5, 1.0, size=400).astype(np.int64))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    desc = np.sort(lengths)[::-1]
    costs = [
        PackingCost.from_hardware(445, 450),
        PackingCost(pair_s=3e-9, ring_token_s=5e-6, call_s=1e-4, ring_step_s=1e-3, overlap=0.0),
    ]
    for cp, cost in [(2, costs[0]), (4, costs[1]), (8, costs[0]), (8, costs[1])]:
        p = shard_documents(cu, cp=cp, hp=2, cost=cost)
        every_k = [shard_documents(cu, cp, 2, long_threshold=int(desc[k]), cost=cost).predicted_s for k in range(40)]
        assert p.predicted_s <= min(every_k) + 1e-12 and len(p.long_docs) < 40
        owner_ok = (p.owner[p.long_docs] == -1).all() and (np.delete(p.owner, p.long_docs) >= 0).all()
        assert owner_ok
        real = p.views[p.views >= 0]
        assert sorted(real.tolist()) == list(range(int(cu[-1])))
        for doc in np.flatnonzero(p.owner >= 0)[:50]:
            view = p.views[p.owner[doc]].tolist()
            start = view.index(int(cu[doc]))
            assert view[start : start + lengths[doc]] == list(range(cu[doc], cu[doc + 1]))
        # the loads it reports, measured independently from the views: each token's visible pairs (its position in
        # its document + 1) summed per view (numpy over each view's tokens: one Python step per token took 10 s)
        load = np.array(
            [int((t - cu[np.searchsorted(cu, t, side="right") - 1] + 1).sum()) for t in (v[v >= 0] for v in p.views)]
        )
        assert load.max() / load.mean() - 1 == pytest.approx(p.pair_imbalance, abs=1e-9)
        padding = (p.views < 0).sum() - (
            p.view_len * cp - p.long_prefix * cp - (p.views[:, p.long_prefix :] >= 0).sum()
        )
        assert padding == (-lengths[p.long_docs] % (2 * cp)).sum()  # only the sharded pad, to 2*cp


def test_cost_model_prefers_whole_documents_when_the_ring_is_dear():
    """The same batch: a dear ring (slow links, no overlap) keeps documents whole despite the imbalance; a cheap
    one shards until the ranks balance."""
    lengths = np.array([3228, 2350, 1322, 1269, 1182, 985, 945, 869, 515, 426] + [40] * 100)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cheap = PackingCost(pair_s=1e-9, ring_token_s=1e-12, overlap=1.0)
    dear = PackingCost(pair_s=1e-9, ring_token_s=1e-4, overlap=0.0)
    balanced, whole = shard_documents(cu, 8, 1, cost=cheap), shard_documents(cu, 8, 1, cost=dear)
    assert len(whole.long_docs) == int((lengths > cu[-1] / 8).sum()) < len(balanced.long_docs)
    assert balanced.pair_imbalance < 0.05 < whole.pair_imbalance


# -- bad input --------------------------------------------------------------------------------------------
def refusals(rank, world):
    groups = megatron_2d.build_2d_groups(2, 1, "head_first", timeout=TIMEOUT)
    other = megatron_2d.build_2d_groups(1, 2, "head_first", timeout=TIMEOUT)
    messages = {}

    def refused(name, fn):
        try:
            fn()
        except (ValueError, TypeError) as err:
            messages[name] = str(err)

    refused("not_increasing", lambda: megatron_2d.PackedSharding([0, 5, 5, 9], groups))
    refused("not_zero", lambda: megatron_2d.PackedSharding([2, 5, 9], groups))
    refused("float", lambda: megatron_2d.PackedSharding(torch.tensor([0.0, 4.0]), groups))
    refused("differing", lambda: megatron_2d.PackedSharding([0, 5, 9 + rank], groups))
    layout = megatron_2d.PackedSharding([0, 5, 40], groups)
    q = torch.randn(layout.local_tokens, 4, 8)
    refused("T_mismatch", lambda: megatron_2d.attention_2d(q[:-1], q[:-1], q[:-1], groups, packing=layout))
    refused("shard_T", lambda: layout.shard(torch.randn(39, 4, 8)))
    refused("other_groups", lambda: megatron_2d.attention_2d(q, q, q, other, packing=layout))
    refused("thd_without_packing", lambda: megatron_2d.attention_2d(q, q, q, groups))
    refused("mode", lambda: megatron_2d.PackedSharding([0, 5], groups, mode="whole"))
    return messages


@pytest.mark.distributed
def test_bad_packed_input_is_refused_with_the_values():
    for messages in run_on_ranks(4, refusals):
        assert set(messages) == {
            "not_increasing",
            "not_zero",
            "float",
            "differing",
            "T_mismatch",
            "shard_T",
            "other_groups",
            "thd_without_packing",
            "mode",
        }, messages
        assert "cu_seqlens[1] = 5 and cu_seqlens[2] = 5" in messages["not_increasing"]
        assert "cu_seqlens[0] = 2" in messages["not_zero"]
        assert "differ across the ranks" in messages["differing"]
        assert "t_local" in messages["T_mismatch"] and "T = 40" in messages["shard_T"]
        assert "other groups" in messages["other_groups"]
        assert "packing=" in messages["thd_without_packing"]
        assert "'whole'" in messages["mode"]


def disagreeing_cu_seqlens(rank, world, hp, differ_by):
    """Build a layout where ranks differ in cu_seqlens only across ``differ_by`` ("head_group": each head group
    agrees within itself; "context_group": each context group agrees within itself); every rank must refuse."""
    groups = megatron_2d.build_2d_groups(hp, 1, "head_first", timeout=TIMEOUT)
    place = groups.place
    extra = place.context_rank if differ_by == "head_group" else place.head_rank
    try:
        megatron_2d.PackedSharding([0, 5, 9 + extra], groups)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def disagreeing_results(request):
    """The selected cases, one forked world per world size."""
    cases = selected_params(
        request, "test_cu_seqlens_that_differ_anywhere_in_the_cp_group_are_refused", "world, hp, differ_by"
    )
    return run_by_world({x: (x[0], (disagreeing_cu_seqlens, x[1:])) for x in cases})


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, differ_by",
    [
        (4, 2, "head_group"),
        (4, 2, "context_group"),
        (2, 1, "head_group"),
        (4, 1, "head_group"),
        (4, 4, "context_group"),
    ],
    ids=["hp2-cp2-across-head-groups", "hp2-cp2-across-context-groups", "hp1-cp2", "hp1-cp4", "hp4-cp1"],
)
def test_cu_seqlens_that_differ_anywhere_in_the_cp_group_are_refused(disagreeing_results, world, hp, differ_by):
    """Ranks that agree with their own head group (or context group) but not with the rest of the CP group are
    refused on every rank: the check spans the whole CP group, at hp = 1 too."""
    for message in disagreeing_results[(world, hp, differ_by)]:
        assert message is not None and "differ across the ranks" in message, message


@pytest.mark.distributed
def test_a_failing_rank_fails_the_test():
    with pytest.raises(RankFailure):
        run_on_ranks(
            2, lambda rank, world: megatron_2d.PackedSharding([0, 5 + rank], megatron_2d.build_2d_groups(1, 1))
        )


def test_whole_documents_balance_tokens_as_well_as_pairs():
    """Two ranks, equal attention pairs but unequal tokens after the big documents (one of 2000 tokens against
    four of 1000 ~ the same pairs): the 2000 one-token documents must even the tokens out, not the pairs alone."""
    lengths = np.array([2000, 1000, 1000, 1000, 1000] + [1] * 2000)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    p = shard_documents(cu, cp=2, hp=1, long_threshold=10**9)  # everything whole
    assert len(p.long_docs) == 0
    tokens = (p.views >= 0).sum(axis=1)
    assert tokens.max() / tokens.mean() - 1 < 0.01, tokens
    assert p.token_imbalance < 0.01 and p.pair_imbalance < 0.01


@pytest.mark.parametrize("mode", PACKING_MODES)
@pytest.mark.parametrize("CP, hp, placement", [(8, 1, "head_first"), (8, 2, "context_first"), (6, 3, "head_first")])
def test_planned_work_is_each_documents_own_attention(mode, CP, hp, placement):
    """Kernel calls cover exactly the visible (query, key) pairs: summed over every context rank and source block,
    sum L(L+1)/2 for causal and sum L^2 without a mask, nothing across documents or on padding; and the zigzag
    ring order keeps each document to a few calls per block however many head ranks deliver its chunks."""
    from megatron_2d.groups import Groups2D
    from megatron_2d.layout.band import SlidingWindow
    from megatron_2d.layout.topology import Layout2D, place_all_ranks

    lengths = np.array(LENGTHS["mixed"] + LENGTHS["one_long"] + [21])  # 1632 = 34 * 48
    cu = np.concatenate([[0], np.cumsum(lengths)])
    layout = Layout2D(CP, hp, 1, placement)
    places = place_all_ranks(layout, [list(range(CP))], CP)
    total = {True: 0, False: 0}
    for place in places.values():
        if place.head_rank:  # one head rank per context rank: its view
            continue
        packed = megatron_2d.PackedSharding(cu, Groups2D(layout, place, None, None, None, None, None), mode=mode)
        for causal in (True, False):
            by_source = packed.calls(causal, SlidingWindow())
            total[causal] += sum(c.flops_units for calls in by_source.values() for c in calls)
            if mode == "zigzag" and causal:
                assert sum(len(calls) for calls in by_source.values()) <= 4 * len(lengths) * (CP // hp)
    assert total[True] == int((lengths * (lengths + 1) // 2).sum())
    assert total[False] == int((lengths**2).sum())


# -- sliding windows in packed batches: bytes follow the window ------------------------------------------
LONG = [2 * 4 * c for c in (28, 32, 36)]  # three long documents, each > T / cp at CP = 4: chunks 28..36


def packed_window_bytes(rank, world, cases):
    groups = megatron_2d.build_2d_groups(1, 1, "head_first", timeout=TIMEOUT)
    out = {}
    for mode in ("zigzag", "documents"):
        for left, case in cases.items():
            groups.comm_bytes.reset()
            errs, padding, _, _ = run_packed(groups, mode, case)
            out[(mode, left)] = (max(errs.values()), groups.comm_bytes.as_dict())
    return out


@pytest.fixture(scope="module")
def window_bytes_results(request):
    """The selected windows, in one forked world."""
    lefts = selected_params(request, "test_packed_window_bytes_follow_closed_form", "left")
    calls = [
        (packed_window_bytes, ({x: packed_case(tuple(LONG), True, 4, 2, window=(x, 0)) for x in (left, -1)},))
        for left in lefts
    ]
    return dict(zip(lefts, run_each_on_ranks(4, calls)))


@pytest.mark.distributed
@pytest.mark.parametrize("left", [1, 5, 28])
def test_packed_window_bytes_follow_closed_form(window_bytes_results, left):
    """hp = 1, CP = 4, three long documents (every chunk at least ``left`` long): context rank r sends each
    neighbour (r-1 and r+1, where they exist) the last ``left`` keys of one chunk per document, K and V in forward
    and again in backward, and gets back their dK/dV partials (fp32): neighbours * D * left * 2 * g * d * (4 + 4 + 4)
    bytes, packed together whatever lies between the documents' slices. Without the window the ring runs."""
    world, g, d = 4, 2, 16
    for rank, per_rank in enumerate(window_bytes_results[left]):
        neighbours = (rank > 0) + (rank < world - 1)
        for mode in ("zigzag", "documents"):
            err, windowed = per_rank[(mode, left)]
            _, ring = per_rank[(mode, -1)]
            assert err < TOLERANCES[torch.float32].end_to_end, (mode, err)
            assert windowed["neighbour"] == neighbours * len(LONG) * left * 2 * g * d * 12, (rank, mode, windowed)
            assert windowed["inner_ring"] == windowed["outer_ring"] == 0 and ring["neighbour"] == 0
            assert windowed["neighbour"] <= sum(ring.values()) * left / 28 / 2


# -- a packing mode of the test's own: the PackingMode interface is all a mode needs ---------------------
class ContiguousMode(PackingMode):
    """The packed stream cut into CP contiguous pieces of K = T / CP tokens, CP rank i holding the i-th (documents
    masked, no padding); a context rank's view is its hp ranks' pieces by head rank, all of it on the ring. Not a
    library mode (causal work is unbalanced: the last rank computes most); it is written against the interface
    only, registered here, and runs through PackedSharding and attention_2d without any library file knowing it."""

    name = "contiguous"

    def __init__(self, cu_seqlens, layout, **options) -> None:
        super().__init__(cu_seqlens, layout)
        T, CP, cp, hp = self.total_tokens, layout.cp_size, layout.context_size, layout.head_parallel_size
        if T % CP:
            raise ValueError(f"the contiguous mode needs T = {T} divisible by CP = {CP}")
        K, cu = T // CP, self.cu_seqlens
        bounds = np.union1d(cu, np.arange(CP) * K)  # a run starts at every document and every piece
        start = bounds[:-1]
        doc = np.searchsorted(cu, start, side="right") - 1
        index = start // K  # the CP rank holding the run
        head_rank = index % hp if layout.placement == "head_first" else index // cp
        view = context_rank_of(layout, index)
        self.runs = Runs(view, head_rank * K + start - index * K, np.diff(bounds), doc, start - cu[doc])
        self.view_len = self.ring_tokens = hp * K


@pytest.fixture
def contiguous_mode():
    register(ContiguousMode)
    yield ContiguousMode
    unregister(ContiguousMode.name)


def test_a_registered_mode_is_a_mode_everywhere_a_name_is_checked(contiguous_mode):
    assert mode_names() == (*PACKING_MODES, "contiguous") and PACKING_MODES == ("zigzag", "documents", "sequence")
    assert mode_class("contiguous", "cp_2d_packing") is ContiguousMode
    with pytest.raises(ValueError, match="registered already"):
        register(ContiguousMode)
    with pytest.raises(TypeError, match="PackingMode subclass"):
        register(int)


@pytest.mark.slow
def test_a_library_mode_not_listed_in_the_choices_fails_the_import():
    """The registry checks the library's modes against layout.choices.PACKING_MODES (the flag's choices) when
    imported: a subprocess whose PACKING_MODES lacks one cannot import the modes."""
    import subprocess
    import sys

    code = (
        "import megatron_2d.layout.choices as c\n"
        "c.PACKING_MODES = ('zigzag', 'documents')\n"
        "import megatron_2d.packing.modes\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "list a new mode's name there too" in done.stderr, done.stderr


def test_an_unregistered_mode_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"'contiguous' is not one of \['zigzag', 'documents', 'sequence'\]"):
        mode_class("contiguous", "PackedSharding mode")


@pytest.mark.parametrize("CP, hp, placement", [(8, 1, "head_first"), (8, 2, "context_first"), (6, 3, "head_first")])
def test_a_test_modes_calls_are_each_documents_own_attention(contiguous_mode, CP, hp, placement):
    """The mode's slots are its pieces, and its kernel calls (derived by the library from its runs alone) cover
    exactly each document's visible pairs."""
    from megatron_2d.groups import Groups2D
    from megatron_2d.layout.band import SlidingWindow
    from megatron_2d.layout.topology import Layout2D, place_all_ranks

    lengths = np.array(LENGTHS["mixed"] + LENGTHS["one_long"] + [21])  # 1632 = 34 * 48
    cu = np.concatenate([[0], np.cumsum(lengths)])
    layout = Layout2D(CP, hp, 1, placement)
    places = place_all_ranks(layout, [list(range(CP))], CP)
    total = {True: 0, False: 0}
    for place in places.values():
        packed = megatron_2d.PackedSharding(
            cu, Groups2D(layout, place, None, None, None, None, None), mode="contiguous"
        )
        K = int(cu[-1]) // CP
        assert (packed.local_indices().numpy() == np.arange(place.cp_index * K, (place.cp_index + 1) * K)).all()
        assert (packed.slots == np.arange(CP * K).reshape(CP, K)).all()
        if place.head_rank:  # one head rank per context rank: its view
            continue
        for causal in (True, False):
            total[causal] += sum(
                c.flops_units for calls in packed.calls(causal, SlidingWindow()).values() for c in calls
            )
    assert total[True] == int((lengths * (lengths + 1) // 2).sum())
    assert total[False] == int((lengths**2).sum())


CONTIGUOUS_LAYOUTS = [
    (2, 1, 1, "head_first"),
    (4, 2, 1, "context_first"),
    (8, 2, 2, "head_first"),
    (8, 4, 1, "context_first"),
]


def contiguous_inputs(hp):
    hq, hkv = layout_heads(hp)
    lengths = tuple(LENGTHS["per_sequence"])  # T = 816: divisible by every CP here
    return {
        key: packed_case(lengths, causal, hq, hkv, window=window)
        for key, causal, window in ((True, True, (-1, -1)), (False, False, (-1, -1)), ("window", True, (20, 0)))
    }


def contiguous_cases(rank, world, hp, w, placement, cases):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    out = {}
    for key, case in cases.items():
        groups.comm_bytes.reset()
        errs, padding, _, _ = run_packed(groups, "contiguous", case)
        sent = groups.comm_bytes.as_dict()
        out[key] = errs, padding, sent["neighbour"] + sent["inner_ring"] + sent["outer_ring"]
    return out


@pytest.fixture(scope="module")
def contiguous_results(request):
    """The selected layouts, one forked world per world size, with the test's mode registered while they run."""
    layouts = selected_params(request, "test_a_test_mode_runs_exactly_through_attention_2d", "world, hp, w, placement")
    calls = {x: (x[0], (contiguous_cases, (*x[1:], contiguous_inputs(x[1])))) for x in layouts}
    register(ContiguousMode)
    try:
        return run_by_world(calls, timeout_s=SHARED_TIMEOUT_S)
    finally:
        unregister(ContiguousMode.name)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, hp, w, placement",
    CONTIGUOUS_LAYOUTS,
    ids=[f"N{n}-hp{hp}-cp{n // hp}-w{w}-{p}" for n, hp, w, p in CONTIGUOUS_LAYOUTS],
)
def test_a_test_mode_runs_exactly_through_attention_2d(contiguous_results, world, hp, w, placement):
    """Forward and backward of the test's own mode against the per-document fp64 reference (causal, unmasked,
    a sliding window), on forked ranks: PackedSharding, the head all-to-all, the ring or neighbour exchange (K/V
    bytes counted) and the kernel calls all come from the mode's runs."""
    for rank, per_rank in enumerate(contiguous_results[(world, hp, w, placement)]):
        assert set(per_rank) == {True, False, "window"}
        for case, (errs, padding, kv_bytes) in per_rank.items():
            assert max(errs.values()) < TOLERANCES[torch.float32].end_to_end, (rank, case, errs)
            assert padding["no_nan"] and padding["pad_zero"] and padding["pad_slots"] == 0, (rank, case, padding)
            assert (kv_bytes > 0) == (world > hp), (rank, case, kv_bytes)  # K/V cross context ranks


@pytest.mark.megatron
def test_a_test_mode_in_the_megatron_checks(contiguous_mode):
    """The Megatron glue asks the mode: a mode without a Megatron split keeps the configured name (its batches
    carry their layout), and Mamba / GDN layers are refused for a mode that does not say it keeps Megatron's
    per-document order; uneven loss masks need --calculate-per-token-loss."""
    from types import SimpleNamespace

    from megatron_2d.megatron import launch_checks
    from megatron_2d.megatron.fields import NEEDS_2D, check_values

    config = SimpleNamespace(
        cp_2d_packing="contiguous", context_parallel_size=2, dataloader_inter_document_masking=True
    )
    check_values(config, NEEDS_2D)  # the config route's check of cp_2d_packing asks the registry
    assert launch_checks.packing_mode(config) == "contiguous" and launch_checks.megatron_split(config) is None
    with pytest.raises(ValueError, match="cp_2d_packing='contiguous' cannot run a model with Mamba"):
        launch_checks.check_hybrid_layers(config, "M*")
    args = SimpleNamespace(cp_2d_packing="contiguous", context_parallel_size=2, sft=True, cp_comm_type="2d")
    assert "--calculate-per-token-loss" in launch_checks.loss_scaling_problem(args)
