"""Who owns the 2D process groups of a Megatron model (the config that builds it, no module-level cache), and when
they are built: at the model's construction, with the same collectives on every rank whatever the rank builds."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_2d.megatron.process_groups import GroupRegistry, destroy_2d_groups, group_registry, groups_for
from megatron_2d.megatron.settings import Settings2D
from megatron_2d.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _ownership(rank, world):
    settings = Settings2D(world, 1, 2, "head_first")
    first, second = SimpleNamespace(), SimpleNamespace()  # two models' configs with equal settings
    a = group_registry(first).groups_for(dist.group.WORLD, settings)
    b = group_registry(second).groups_for(dist.group.WORLD, settings)
    found = {
        "same_registry_same_groups": group_registry(first).groups_for(dist.group.WORLD, settings) is a,
        "deepcopy_shares": group_registry(copy.deepcopy(first)) is group_registry(first),
        "own_groups": a is not b and a.comm_bytes is not b.comm_bytes,
        "unowned_is_new": groups_for(dist.group.WORLD, settings) is not a,
        "layout_passed_through": a.layout is settings.layout,
        "registry_type": isinstance(group_registry(first), GroupRegistry),
    }
    live = dist.distributed_c10d._world.pg_map
    destroy_2d_groups(first)  # only the first model's groups
    found["destroyed_first_only"] = (
        all(pg not in live for pg in a.process_groups())
        and all(pg in live for pg in b.process_groups())
        and bool(b.process_groups())
    )
    destroy_2d_groups()
    found["destroyed_all"] = all(pg not in live for pg in b.process_groups())
    return found


def test_each_model_config_owns_its_groups_and_byte_counter():
    for found in run_on_ranks(2, _ownership):
        assert all(found.values()), found


def _refusal_after_construction(rank, world):
    registry = GroupRegistry()
    built = registry.build(dist.group.WORLD, Settings2D(world, 1, 1, "head_first"))
    found = {"hit": registry.groups_for(dist.group.WORLD, Settings2D(world, 1, 1, "head_first")) is built}
    try:
        registry.groups_for(dist.group.WORLD, Settings2D(world, 2, 1, "head_first"))
    except ValueError as err:
        found["refusal"] = str(err)
    destroy_2d_groups(registry)
    return found


def test_a_layer_asking_for_groups_the_construction_did_not_build_is_refused():
    """Once the model's construction has built its groups, a layer that asks for others would build them alone
    (its ranks only): refused on the spot, before any collective."""
    for found in run_on_ranks(2, _refusal_after_construction):
        assert found["hit"]
        assert found["refusal"].startswith(
            "a 2d attention layer asks for the 2D groups of CP ranks [0, 1] with Settings2D(context_parallel_size=2, "
            "head_parallel_size=2, inner_ring_size=1, placement='head_first'), but the model's construction built "
            '["CP ranks [0, 1] with Settings2D(context_parallel_size=2, head_parallel_size=1'
        ), found["refusal"]


# --- model construction: the same collectives on every rank, whatever the rank builds ----------------------------

COLLECTIVES = (
    "all_gather_object",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "reduce_scatter_tensor",
    "new_group",
    "new_subgroups_by_enumeration",
)


@contextlib.contextmanager
def recorded_collectives(calls: list):
    """Every torch.distributed collective (and group creation) called through ``torch.distributed`` inside, as
    (name, the ranks of its group or the rank lists it creates), appended to ``calls``."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name, original):
        def call(*args, **kwargs):
            if name == "new_subgroups_by_enumeration":
                what = [list(r) for r in (args[0] if args else kwargs["ranks_per_subgroup_list"])]
            elif name == "new_group":
                what = list(args[0] if args else kwargs.get("ranks") or [])
            else:
                group = kwargs.get("group")
                what = "world" if group is None else dist.get_process_group_ranks(group)
            calls.append((name, what))
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, recording(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _construction(rank, world):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_2d.megatron import TransformerConfig2D, get_gpt_layer_spec_2d
    from megatron_2d.megatron.core_attention import CoreAttention2D
    from megatron_2d.megatron.hybrid_spec import hybrid_stack_spec_2d_local
    from megatron_2d_dev import tiny_gpt as tg
    from megatron_2d_dev import tiny_hybrid as th
    from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

    install_hybrid_cpu_shims()
    out = {"stage": None}
    tg.init_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)
    out["stage"] = parallel_state.get_pipeline_model_parallel_rank()

    def layers_2d(model):
        return [m for m in model.modules() if isinstance(m, CoreAttention2D)]

    # HybridModel 'M-|*-': stage 0 holds Mamba and MLP layers only
    pattern = "M-|*-"
    cfg = th.tiny_hybrid_config(pattern, (1, 1, "head_first"))
    config = tg.make_transformer_config(cfg)
    calls: list = []
    with recorded_collectives(calls):
        first = th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local, config=config)
    out["hybrid"] = calls
    registry = group_registry(config)
    out["hybrid layers"] = len(layers_2d(first))
    out["hybrid layers share the registry's groups"] = all(
        m.groups is registry.groups_for(parallel_state.get_context_parallel_group(), m.settings)
        for m in layers_2d(first)
    )
    calls = []
    with recorded_collectives(calls):
        th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local, config=config)
    out["hybrid, built again from the same config"] = calls

    # GPTModel with --pipeline-model-parallel-layout 'Ett|L': stage 1 holds no decoder layer
    cfg = tg.TinyGPTConfig(
        config_class=TransformerConfig2D,
        cp_comm_type="2d",
        config_overrides=dict(cp_2d_head_parallel_size=2, pipeline_model_parallel_layout="Ett|L"),
    )
    config = tg.make_transformer_config(cfg)
    calls = []
    with recorded_collectives(calls):
        spec = get_gpt_layer_spec_2d(config, use_transformer_engine=False)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=False,
        )
    out["gpt"] = calls
    out["gpt layers"] = len(layers_2d(model))

    # interleaved (virtual) pipeline, layout 'E|tt|tt|L': two chunks per rank, each built from the same config (as
    # Megatron's builder does); stage 0's first chunk and stage 1's second hold no decoder layer
    tg.init_parallel(pipeline_model_parallel_size=2, context_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    cfg.num_layers = 4
    cfg.config_overrides["pipeline_model_parallel_layout"] = "E|tt|tt|L"
    config = tg.make_transformer_config(cfg)
    out["virtual"] = []
    for vp_stage in range(2):
        calls = []
        with recorded_collectives(calls):
            spec = get_gpt_layer_spec_2d(config, vp_stage, use_transformer_engine=False)
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=cfg.vocab_size,
                max_sequence_length=cfg.seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=False,
                vp_stage=vp_stage,
            )
        out["virtual"].append((calls, len(layers_2d(chunk))))
    destroy_2d_groups()
    return out


@pytest.mark.megatron
def test_model_construction_runs_the_same_collectives_on_every_rank_whatever_it_builds():
    """PP 2 x CP 2 (hp x cp = 1 x 2 for the hybrid, 2 x 1 for GPT): a HybridModel 'M-|*-' (stage 0 builds no
    attention layer), a GPTModel with pipeline layout 'Ett|L' (stage 1 builds no decoder layer) and one with the
    interleaved layout 'E|tt|tt|L' (two chunks per rank, one of them empty) build their 2D groups with the same
    collectives on every rank, once: built again from the same config, a model or chunk runs none.
    (Before the groups were built at construction, the stage with attention waited for the other forever.)"""
    results = run_on_ranks(4, _construction, timeout_s=60)
    by_stage = {stage: [r for r in results if r["stage"] == stage] for stage in (0, 1)}
    assert [r["hybrid layers"] for r in by_stage[0]] == [0, 0] and [r["hybrid layers"] for r in by_stage[1]] == [1, 1]
    assert [r["gpt layers"] for r in by_stage[0]] == [2, 2] and [r["gpt layers"] for r in by_stage[1]] == [0, 0]
    for key in ("hybrid", "gpt"):
        calls = [r[key] for r in results]
        assert calls[0], f"{key}: no collective recorded"
        assert ("all_gather_object", "world") in calls[0] and any(
            c[0] == "new_subgroups_by_enumeration" for c in calls[0]
        )
        assert all(c == calls[0] for c in calls), f"{key}: ranks ran different collectives: {calls}"
        # the build ends once every rank has connected its gloo groups (groups.settle_gloo_connections): a rank that
        # went on and destroyed them at once failed its peer's creation ("Connection closed by peer", 1 run in 10)
        assert calls[0][-1] == ("barrier", "world"), f"{key}: the build does not end with a world barrier: {calls[0]}"
    assert all(r["hybrid layers share the registry's groups"] for r in results)
    # virtual pipeline: the first chunk builds the groups on every rank, the second finds them built
    assert [[n for _, n in r["virtual"]] for r in results] == [[0, 2], [0, 2], [2, 0], [2, 0]]
    first_chunk = [r["virtual"][0][0] for r in results]
    assert first_chunk[0] and all(c == first_chunk[0] for c in first_chunk), first_chunk
    assert all(r["virtual"][1][0] == [] for r in results)
    assert all(r["hybrid, built again from the same config"] == [] for r in results)
