"""Who owns the 2D process groups of a Megatron model: the config that builds it (no module-level cache)."""

from __future__ import annotations

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
