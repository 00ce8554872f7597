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
