"""Megatron's own hybrid (dynamic) CP schedule with the 2d backend on forked CPU ranks, against CP = 1.

megatron-core 0.19.2 schedules every sequence of a global batch onto a CP group of its own size
(``HybridCPDataLoaderWrapper``, ``BalancedCPScheduler``, ``hybrid_context_parallel_forward_backward``); the 2d backend
runs each group size with its own 2D layout. Each case trains one step of packed samples (SFTDataset's form, prompts
masked) on DP x CP = 4 and 8 ranks, the sequences landing in groups of 1, 2, 4 and 8 ranks, and compares the loss,
Megatron's grad norm and every gradient with the CP = 1 step of the same sequences through megatron-core's own
local attention (:mod:`megatron_2d.testing.dynamic_cp`). Layouts: the planner's rule, and given ones with K/V
heads replicated inside a group (hp above the 2 K/V heads), Double-Ring, context_first. TP 2 and 4 with sequence
parallelism (apex's LayerNorm stood in, megatron_2d.testing.sp_norms) x DP x CP 4 and 2 against the TP = 1, CP = 1
step: each rank's hidden states hold 1/TP of its sequence chunk until the QKV projection gathers them. Two forked
worlds (4 and 8 ranks) run every case, then the refusals the per-call path makes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCE
from megatron_2d.testing.tiny_gpt import TinyGPTConfig, compare_results

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

RTOL = TOLERANCE[torch.float32]
CFG = TinyGPTConfig(num_attention_heads=8, num_query_groups=2, hidden_size=64, seq_length=128)
LONGEST = 8  # max_seqlen_per_dp_cp_rank: L <= 8 on one rank, <= 16 on 2, <= 32 on 4, <= 64 on 8
SAMPLES = {
    4: [[6, 12, 20], [4, 30], [10, 8, 5], [16, 3, 7]],
    8: [[6, 12, 20], [4, 30, 50], [10, 8, 4], [16, 2, 6], [40, 5], [7, 9], [3, 3, 3], [24]],
}
CASES = {  # name: (world, context_parallel_size, cp_2d_dynamic_layouts)
    "dpcp4 cp1 rule": (4, 1, None),
    "dpcp4 cp2 replicated": (4, 2, "2=2x1,4=4x1"),
    "dpcp4 cp4 context_first": (4, 4, "4=2x2@context_first"),
    "dpcp8 cp2 double-ring": (8, 2, "2=2x1,4=4x1,8=2x4/2"),
    "dpcp8 cp1 replicated x4": (8, 1, "8=8x1"),
    "tp2 sp dpcp4 cp2": (8, 2, "2=2x1,4=2x2"),  # TP 2 + SP: 4 heads, 1 K/V head per TP rank (replicated at hp 2)
    "tp4 sp dpcp2 cp1 mha": (8, 1, "2=2x1"),  # TP 4 + SP: 2 heads and 2 K/V heads per TP rank
}
MHA = TinyGPTConfig(num_attention_heads=8, hidden_size=64, seq_length=128)
"""CFG with 8 K/V heads (TP 4 needs the K/V heads divisible by 4)."""
SEQUENCE_PARALLEL = {"tp2 sp dpcp4 cp2": (2, 16, CFG), "tp4 sp dpcp2 cp1 mha": (4, 32, MHA)}
"""Cases with sequence parallelism: (TP, max_seqlen_per_dp_cp_rank, model). 16 and 32 put the world's longest
sequence, 50 tokens, on all 4 and 2 DP x CP ranks. At TP 4 the bridge pads each sequence to a multiple of
g x lcm(2, 4) (e.g. 9 tokens on one rank to 12, not 10): GPTModel's embedding scatters each rank's tokens over TP."""


def expected_sizes(world, longest=LONGEST):
    """(length, CP size) of every sequence, once per rank that runs it: Megatron's rule
    max(1, 2^ceil(log2(L / longest)))."""
    from megatron_2d.layout.dynamic import megatron_cp_size

    sizes = [(n, megatron_cp_size(n, longest)) for sample in SAMPLES[world] for n in sample]
    return sorted(x for n, g in sizes for x in [(n, g)] * g)


def run_world(rank, world):
    from megatron_2d.testing.dynamic_cp import hybrid_step, packed_samples, reference_step

    samples = packed_samples(SAMPLES[world], CFG.vocab_size, seed=world)
    out = {"reference": reference_step(CFG, samples)}
    if world == 8:
        out["reference mha"] = reference_step(MHA, samples)
    for name, (size, cp, layouts) in CASES.items():
        if size == world and name not in SEQUENCE_PARALLEL:
            out[name] = hybrid_step(CFG, samples, cp, LONGEST, layouts)
        elif size == world:
            out[name] = sequence_parallel_step(samples, cp, layouts, *SEQUENCE_PARALLEL[name])
    if world == 4:
        out["refusals"] = refusals(samples)
        out["packed micro-batch"] = packed_microbatch(samples)
    return out


def sequence_parallel_step(samples, cp, layouts, tp, longest, model):
    """:func:`hybrid_step` of ``model`` at TP ``tp`` with sequence parallelism: LayerNorm through megatron-core's
    FusedLayerNorm (apex's function stood in, the route its local specs take when apex is installed), scoped to this
    step."""
    from megatron_2d.testing import sp_norms
    from megatron_2d.testing.dynamic_cp import hybrid_step

    cfg = replace(model, config_overrides=dict(model.config_overrides, sequence_parallel=True))
    with sp_norms.apex_layer_norm():
        return hybrid_step(cfg, samples, cp, longest, layouts, tensor_model_parallel_size=tp)


def refusals(samples):
    """What the per-call path refuses, on a model built under hybrid CP (DP x CP = 4)."""
    from megatron.core import parallel_state

    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d
    from megatron_2d.testing.dynamic_cp import dynamic_config
    from megatron_2d.testing.tiny_gpt import build_tiny_gpt, init_parallel, make_transformer_config

    init_parallel(context_parallel_size=1, seed=CFG.seed, hybrid_context_parallel=True)
    dyn = dynamic_config(CFG, LONGEST, None)
    config = make_transformer_config(dyn)
    model = build_tiny_gpt(dyn, get_gpt_layer_spec_2d(config, use_transformer_engine=False), config)
    core = model.decoder.layers[0].self_attention.core_attention
    found = {}
    two = parallel_state.get_hybrid_data_context_parallel_groups(group_size=2)
    for what, call in {
        "size": lambda: core.dynamic.for_batch(3, two),
        "group": lambda: core.dynamic.for_batch(4, two),
        "missing group": lambda: core.dynamic.for_batch(2, None),
        "size 1 with a group": lambda: core.dynamic.for_batch(1, two),
    }.items():
        try:
            call()
            found[what] = None
        except ValueError as err:
            found[what] = str(err)
    found["no collective at g=1"] = one_rank_batch_sends_nothing(model, samples)
    found.update(bypassing_self_attention(core))
    return found


def packed_microbatch(samples):
    """A micro-batch of two sequences (16 and 12 tokens: 28, a multiple of 2 x 2) on groups of 2, against CP = 1."""
    from megatron_2d.testing.dynamic_cp import hybrid_model, packed_microbatch_step, packed_samples, reference_step

    sample = packed_samples([[16, 12]], CFG.vocab_size, seed=5)
    expected = reference_step(CFG, sample)
    model, _ = hybrid_model(CFG, 1, LONGEST, "2=2x1")
    return packed_microbatch_step(model, sample[0], 2), expected


def one_rank_batch_sends_nothing(model, samples):
    """A g = 1 micro-batch's forward and backward on this rank alone, with every torch.distributed collective and
    point-to-point call on a group of several ranks made to raise (Megatron's own calls on the one-rank TP group
    stay local): None when none was made, else the error."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    sample = {k: v[:6] for k, v in samples[0].items() if k in ("tokens", "labels", "loss_mask", "position_ids")}
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_to_all_single",
        "batch_isend_irecv",
        "barrier",
        "broadcast",
        "isend",
        "irecv",
        "send",
        "recv",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
    )
    saved = {n: getattr(dist, n) for n in names}

    def refuse(name):
        def call(*args, **kwargs):
            group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            if group is None or dist.get_world_size(group) > 1:  # one-rank groups (TP = 1) stay local
                raise RuntimeError(f"torch.distributed.{name} called on a group of several ranks")
            return saved[name](*args, **kwargs)

        return call

    cu = torch.tensor([0, 6], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6, local_cp_size=1
    )
    try:
        for n in names:
            setattr(dist, n, refuse(n))
        out = model(
            sample["tokens"].unsqueeze(0),
            sample["position_ids"].unsqueeze(0),
            None,
            labels=sample["labels"].unsqueeze(0),
            packed_seq_params=params,
        )
        out.sum().backward()
        return None
    except RuntimeError as err:
        return str(err)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def bypassing_self_attention(core):
    """What the core attention says of batches that did not come through SelfAttention2D under hybrid CP: a hybrid
    micro-batch (refused), a THD batch without its group (refused), an sbhd batch at the static CP size 1 (runs:
    the static groups are the one-rank slice)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 4], dtype=torch.int32)
    found = {}
    for name, local_cp_size in (("bypass", 1), ("no group", None)):
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=4,
            max_seqlen_kv=4,
            local_cp_size=local_cp_size,
        )
        q = torch.zeros(4, 8, 8)
        try:
            core(q, q[:, :2], q[:, :2], None, packed_seq_params=params)
            found[name] = None
        except ValueError as err:
            found[name] = str(err)
    q = torch.randn(4, 1, 8, 8)
    found["sbhd shape"] = tuple(core(q, q[:, :, :2], q[:, :, :2], None).shape)
    return found


@pytest.fixture(scope="module")
def results():
    return {world: run_on_ranks(world, run_world, timeout_s=240)[0] for world in (4, 8)}


def assert_matches(actual, expected):
    errors = compare_results(actual, expected)
    assert len(expected["grads"]) >= 10
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, f"relative errors above {RTOL}: {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_schedule_matches_cp1(results, case):
    world = CASES[case][0]
    got = results[world][case]
    _, longest, model = SEQUENCE_PARALLEL.get(case, (1, LONGEST, CFG))
    assert got["sizes"] == expected_sizes(world, longest)  # every sequence ran on the group size Megatron's rule gives
    assert_matches(got, results[world]["reference" if model is CFG else "reference mha"])


def test_sequences_land_in_groups_of_1_2_4_and_8(results):
    assert {g for _, g in results[4]["dpcp4 cp1 rule"]["sizes"]} == {1, 2, 4}
    assert {g for _, g in results[8]["dpcp8 cp2 double-ring"]["sizes"]} == {1, 2, 4, 8}
    for case, groups in {"tp2 sp dpcp4 cp2": {1, 2, 4}, "tp4 sp dpcp2 cp1 mha": {1, 2}}.items():
        assert results[8][case]["sequence_parallel"] and {g for _, g in results[8][case]["sizes"]} == groups
    assert not results[8]["dpcp8 cp2 double-ring"]["sequence_parallel"]


def test_per_call_refusals(results):
    found = results[4]["refusals"]
    assert "local_cp_size 3 is not a CP group size of this run" in found["size"]
    assert "holds ranks" in found["group"] and "hybrid CP group of 4 ranks" in found["group"]
    assert "local_cp_size is 2 but it carries no cp_group" in found["missing group"]
    assert "local_cp_size is 1 but its cp_group has 2 ranks" in found["size 1 with a group"]
    assert found["no collective at g=1"] is None
    assert "reached the 2d core attention without its layout" in found["bypass"]
    assert "SelfAttention2D" in found["bypass"]
    assert "every micro-batch brings its CP group" in found["no group"]
    assert found["sbhd shape"] == (4, 1, 64)


def test_a_micro_batch_of_several_sequences_runs_the_sequence_layout(results):
    """Megatron's dev branch packs hybrid micro-batches (several sequences, one group size): the 2d backend runs
    them in Megatron's per-sequence split (the sequence layout on the group's 2D groups)."""
    got, expected = results[4]["packed micro-batch"]
    assert_matches(got, expected)
