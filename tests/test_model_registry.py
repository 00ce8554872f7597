"""Which GroupRegistry a model's 2d layers take their groups from (process_groups.model_registry): the one their
spec hands over, else the one their ProcessGroupCollection carries, else their config's; and destroy_2d_groups on a
module reaches the registries its layers hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_2d.megatron.process_groups import GroupRegistry, destroy_2d_groups, group_registry, model_registry


def test_the_spec_registry_then_the_collections_then_the_configs():
    config = SimpleNamespace()
    given, carried = GroupRegistry(), GroupRegistry()
    collection = SimpleNamespace(groups_2d=carried)
    assert model_registry(config, collection, given) is given
    assert model_registry(config, collection) is carried
    assert model_registry(config, SimpleNamespace()) is group_registry(config)
    assert model_registry(config) is group_registry(config)


def test_a_carrier_that_is_not_a_registry_is_refused():
    with pytest.raises(TypeError, match="groups_2d is a dict, not a megatron_2d GroupRegistry"):
        model_registry(SimpleNamespace(), None, {})
    with pytest.raises(TypeError, match="pg_collection.groups_2d is a str, not a megatron_2d GroupRegistry"):
        model_registry(SimpleNamespace(), SimpleNamespace(groups_2d="groups"))


class _Counting(GroupRegistry):
    def __init__(self) -> None:
        super().__init__()
        self.destroyed = 0

    def destroy(self) -> None:
        self.destroyed += 1
        super().destroy()


def test_destroying_a_modules_groups_reaches_the_registries_its_layers_hold():
    config, held = SimpleNamespace(), _Counting()
    own = group_registry(config)
    layer = torch.nn.Module()
    layer.groups_2d = held
    model = torch.nn.Sequential(layer, torch.nn.Linear(1, 1))
    model.config = config
    other = _Counting()  # another model's: left alone
    destroy_2d_groups(model)
    assert (held.destroyed, other.destroyed) == (1, 0)
    assert isinstance(own, GroupRegistry)


def _layers_take_the_handed_registry(rank, world):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_2d.megatron import TransformerConfig2D
    from megatron_2d.megatron.core_attention import CoreAttention2D
    from megatron_2d_dev import tiny_gpt as tg

    tg.init_parallel(context_parallel_size=2)
    cfg = tg.TinyGPTConfig(config_class=TransformerConfig2D, cp_comm_type="2d")
    cfg.config_overrides = dict(cp_2d_head_parallel_size=2)
    config = tg.make_transformer_config(cfg)
    cp = parallel_state.get_context_parallel_group()

    def layer(pg_collection, **params):
        return CoreAttention2D(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, pg_collection=pg_collection, **params
        )

    given, carried = GroupRegistry(), GroupRegistry()
    by_spec = layer(ProcessGroupCollection.use_mpu_process_groups(["tp", "cp"]), groups_2d=given)
    collection = ProcessGroupCollection.use_mpu_process_groups(["tp", "cp"])
    collection.groups_2d = carried
    by_collection = layer(collection)
    found = {
        "spec's": by_spec.groups_2d is given and by_spec.groups is given.groups_for(cp, by_spec.settings),
        "collection's": by_collection.groups_2d is carried
        and by_collection.groups is carried.groups_for(cp, by_collection.settings),
        "own groups": by_spec.groups is not by_collection.groups,
    }
    destroy_2d_groups(given)
    destroy_2d_groups(carried)
    found["config's registry untouched"] = not group_registry(config)._built
    return found


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_layer_takes_its_groups_from_the_registry_it_is_handed():
    """CP 2: a CoreAttention2D handed a registry by its spec (groups_2d) or by its ProcessGroupCollection builds its
    groups there (first use), not in its config's registry."""
    from megatron_2d.testing.distributed import run_on_ranks

    for found in run_on_ranks(2, _layers_take_the_handed_registry):
        assert all(found.values()), found
