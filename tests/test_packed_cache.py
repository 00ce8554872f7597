"""The packed op's setup cache (on the PackedSharding) is per Groups2D object: another Groups2D of the same layout and
place (its own process groups and byte counter) never gets the setup built for a first one, not even when it lands
at the address of one since collected. One process: groups without process groups (hp = cp = 1) build setups."""

from __future__ import annotations

import gc

import numpy as np
import torch

from megatron_2d import attention
from megatron_2d.call import plan as call_plan
from megatron_2d.call.options import AttentionOptions
from megatron_2d.groups import Groups2D
from megatron_2d.layout.topology import Layout2D
from megatron_2d.packed_sharding import PackedSharding
from megatron_2d.testing.loopback import virtual_groups

CU = np.array([0, 5, 12, 16])


def _setup(groups: Groups2D, packing: PackedSharding):
    q = torch.empty(packing.local_tokens, 1, 1, 8)  # [t_local, 1, hq, dk]
    return tuple(call_plan.prepare(q, 8, groups, AttentionOptions(softmax_scale=0.25), packing))


def _twin(groups: Groups2D) -> Groups2D:
    """Another Groups2D of the same layout and place (check_packed lets it use the same PackedSharding)."""
    return Groups2D(groups.layout, groups.place, None, None, None, None, None)


def test_each_groups_object_gets_its_own_setup():
    first = virtual_groups(Layout2D(1, 1, 1), 0)
    packing = PackedSharding(CU, first)
    heads, rc = _setup(first, packing)
    assert _setup(first, packing) == (heads, rc)  # cached
    second = _twin(first)
    attention.check_packing(second, packing)  # the same layout and place: the op accepts the layout for it
    heads2, rc2 = _setup(second, packing)
    assert heads2.counter is second.comm_bytes and heads.counter is first.comm_bytes
    assert rc2 is not rc and len(packing.op_cache) == 2


def test_a_collected_groups_setup_is_never_met_again(monkeypatch):
    """Every object at one address (as a Groups2D built after another is collected may be): the entry of a dead one
    is not the next one's."""
    monkeypatch.setattr(attention, "id", lambda obj: 0, raising=False)  # the op's id(): every object at address 0
    owner = virtual_groups(Layout2D(1, 1, 1), 0)
    packing = PackedSharding(CU, owner)
    first = _twin(owner)
    stale_heads, _ = _setup(first, packing)
    del first
    gc.collect()
    second = _twin(owner)
    heads, _ = _setup(second, packing)
    assert heads is not stale_heads and heads.counter is second.comm_bytes
    third = _twin(owner)  # alive together with the second, at the same (faked) address
    assert _setup(third, packing)[0].counter is third.comm_bytes
    assert _setup(second, packing)[0] is heads
