"""Megatron's own hybrid (dynamic) CP schedule with the 2d backend on forked CPU ranks, against CP = 1.

megatron-core 0.19.2 schedules every sequence of a global batch onto a CP group of its own size
(``HybridCPDataLoaderWrapper``, ``BalancedCPScheduler``, ``hybrid_context_parallel_forward_backward``); the 2d backend
runs each group size with its own 2D layout. Each case trains one step of packed samples (SFTDataset's form, prompts
masked) on DP x CP = 4 and 8 ranks, the sequences landing in groups of 1, 2, 4 and 8 ranks, and compares the loss,
Megatron's grad norm and every gradient with the CP = 1 step of the same sequences through megatron-core's own
local attention (:mod:`megatron_2d_dev.dynamic_cp`). Layouts: the planner's rule, and given ones with K/V
heads replicated inside a group (hp above the 2 K/V heads), Double-Ring, context_first. TP 2 and 4 with sequence
parallelism (apex's LayerNorm stood in, megatron_2d_dev.sp_norms) x DP x CP 4 and 2 against the TP = 1, CP = 1
step: each rank's hidden states hold 1/TP of its sequence chunk until the QKV projection gathers them. MoE (4
experts, top 2, all-to-all dispatch at EP 1): the z-loss under hybrid CP (TP 1, and TP 2 + SP) with the bridge's
padding kept out of the router, against CP = 1; megatron-core's load-balancing loss under hybrid CP (refused: the
test shows why); the router losses at a static 2D CP size against CP = 1. Two forked worlds (4 and 8 ranks) run
every case, then the refusals the per-call path makes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.tiny_gpt import TinyGPTConfig, compare_results

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

RTOL = TOLERANCES[torch.float32].end_to_end
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


MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_token_dispatcher_type="alltoall",
    add_bias_linear=False,
)
"""4 experts, top 2: the routing and the load-balancing losses depend on the tokens (the generator's top 2 of 2 experts
make those losses constants)."""
ROUTERS = {
    "z_loss": dict(moe_z_loss_coeff=0.1),
    "aux_loss + seq_aux_loss + z_loss": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.05],
        moe_z_loss_coeff=0.1,
    ),
}
STATIC_SAMPLES = [[8, 16, 32], [24, 8], [8, 8, 16], [16, 8, 8]]
"""Documents of multiples of 2 x CP = 8 tokens: nothing padded, so the router sees the CP = 1 step's tokens."""


def moe(router=None, model=CFG):
    """``model`` with MoE MLPs (:data:`MOE`) and ``router``'s loss (:data:`ROUTERS`; None: plain top-k routing)."""
    return replace(model, config_overrides=dict(model.config_overrides, **MOE, **ROUTERS.get(router, {})))


def expected_sizes(world, longest=LONGEST):
    """(length, CP size) of every sequence, once per rank that runs it: Megatron's rule
    max(1, 2^ceil(log2(L / longest)))."""
    from megatron_2d.layout.dynamic import megatron_cp_size

    sizes = [(n, megatron_cp_size(n, longest)) for sample in SAMPLES[world] for n in sample]
    return sorted(x for n, g in sizes for x in [(n, g)] * g)


def run_world(rank, world):
    from megatron_2d_dev.dynamic_cp import hybrid_step, packed_samples, reference_step

    samples = packed_samples(SAMPLES[world], CFG.vocab_size, seed=world)
    out = {"reference": reference_step(CFG, samples)}
    from megatron_2d_dev.megatron_cpu import install_megatron_ddp_cpu_shims

    install_megatron_ddp_cpu_shims()  # MoE's all-to-all token dispatcher makes a CUDA stream
    if world == 8:
        out["reference mha"] = reference_step(MHA, samples)
        out["reference moe z_loss"] = reference_step(moe("z_loss"), samples)
        out["tp2 sp moe z_loss"] = sequence_parallel_step(samples, 2, "2=2x1,4=2x2", 2, 16, moe("z_loss"))
    for name, (size, cp, layouts) in CASES.items():
        if size == world and name not in SEQUENCE_PARALLEL:
            out[name] = hybrid_step(CFG, samples, cp, LONGEST, layouts)
        elif size == world:
            out[name] = sequence_parallel_step(samples, cp, layouts, *SEQUENCE_PARALLEL[name])
    if world == 4:
        out["refusals"] = refusals(samples)
        out["packed micro-batch"] = packed_microbatch(samples)
        out["moe"] = moe_cases(samples)
    return out


def moe_cases(samples):
    """MoE under hybrid CP at DP x CP = 4 (the samples' sequences padded by the bridge: 5 tokens to 6, 3 to 4, ...):
    the z-loss; megatron-core's load-balancing losses with their refusal lifted; the router losses at static CP 4 =
    2 x 2 (no padding) against CP = 1."""
    from megatron_2d.megatron import dynamic
    from megatron_2d_dev.dynamic_cp import hybrid_step, packed_samples, reference_step, static_step

    z, every = moe("z_loss"), moe("aux_loss + seq_aux_loss + z_loss")
    found = {"reference z_loss": reference_step(z, samples), "reference every loss": reference_step(every, samples)}
    found["hybrid z_loss"] = hybrid_step(z, samples, 1, LONGEST)
    problems = dynamic.moe_router_problems
    dynamic.moe_router_problems = lambda config: []
    try:  # what the refusal keeps users from: megatron-core 0.19.2's load-balancing losses under hybrid CP
        found["hybrid every loss unrefused"] = hybrid_step(every, samples, 1, LONGEST)
    finally:
        dynamic.moe_router_problems = problems
    unpadded = packed_samples(STATIC_SAMPLES, CFG.vocab_size, seed=7)
    found["static every loss"] = (static_step(every, unpadded, 4, 2), static_step(every, unpadded, 1, 1))
    return found


def sequence_parallel_step(samples, cp, layouts, tp, longest, model):
    """:func:`hybrid_step` of ``model`` at TP ``tp`` with sequence parallelism: LayerNorm through megatron-core's
    FusedLayerNorm (apex's function stood in, the route its local specs take when apex is installed), scoped to this
    step."""
    from megatron_2d_dev import sp_norms
    from megatron_2d_dev.dynamic_cp import hybrid_step

    cfg = replace(model, config_overrides=dict(model.config_overrides, sequence_parallel=True))
    with sp_norms.apex_layer_norm():
        return hybrid_step(cfg, samples, cp, longest, layouts, tensor_model_parallel_size=tp)


def refusals(samples):
    """What the per-call path refuses, on a model built under hybrid CP (DP x CP = 4)."""
    from megatron.core import parallel_state

    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d
    from megatron_2d_dev.dynamic_cp import dynamic_config
    from megatron_2d_dev.tiny_gpt import build_tiny_gpt, init_parallel, make_transformer_config

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
    from megatron_2d_dev.dynamic_cp import hybrid_model, packed_microbatch_step, packed_samples, reference_step

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


# ---- MoE ------------------------------------------------------------------------------------------------------------
def test_moe_z_loss_under_hybrid_cp_matches_cp1(results):
    """The z-loss sums over tokens, so it needs no group: under hybrid CP (TP 1 at DP x CP 4; TP 2 + SP at DP x CP 4,
    static CP 2) it equals CP = 1's once the bridge's padding is out of the router (left in, it moved the gradients
    by 76%: docs/megatron.md). The sequences are padded (lengths not multiples of 2 x g, or g x 2 x TP)."""
    assert_matches(results[4]["moe"]["hybrid z_loss"], results[4]["moe"]["reference z_loss"])
    tp2 = results[8]["tp2 sp moe z_loss"]
    assert_matches(tp2, results[8]["reference moe z_loss"])
    assert tp2["sequence_parallel"]
    padded = [(n, g) for n, g in results[4]["moe"]["hybrid z_loss"]["sizes"] if n % (2 * g)]
    assert padded and [(n, g) for n, g in tp2["sizes"] if n % (4 * g)]


def test_megatron_load_balancing_losses_under_hybrid_cp_are_why_they_are_refused(results):
    """megatron-core 0.19.2's load-balancing losses sum each micro-batch's expert counts over the static TP x CP
    group: at static CP 1 every rank balances its share of a sequence alone, and the router gradients differ from
    CP = 1's (measured 6%; at static CP > 1 the ranks wait on each other instead). When this test fails,
    megatron-core reduces over the micro-batch's group and the refusal (megatron_2d.megatron.dynamic.
    moe_router_problems) can go."""
    found = results[4]["moe"]
    errors = compare_results(found["hybrid every loss unrefused"], found["reference every loss"])
    router = {k: e for k, e in errors.items() if k.endswith("mlp.router.weight")}
    assert len(router) == 2 and max(router.values()) > 1e-2, router
    assert errors["loss"] < RTOL  # the loss itself is right: only the router's gradients are wrong


def test_moe_router_losses_at_a_static_2d_cp_size_match_cp1(results):
    """The load-balancing losses reduce over the static TP x CP group, which at a static CP size is the one holding
    the micro-batch: with aux_loss, seq_aux_loss and the z-loss, CP 4 as hp x cp = 2 x 2 equals CP = 1 (packed
    documents of multiples of 2 x CP: no padding)."""
    got, expected = results[4]["moe"]["static every loss"]
    assert_matches(got, expected)
