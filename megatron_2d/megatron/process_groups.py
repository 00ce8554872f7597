"""2D process groups for Megatron's CP groups, reached from the CP group a module receives in pg_collection.

Building them is collective over the whole world (every rank creates every group in the same order), so it
happens at model construction, which all ranks run together, never in forward. One set of groups is kept per
(CP group, settings); a module looks its groups up from ``pg_collection.cp``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from ..groups import Groups2D, build_2d_groups
from .settings import Settings2D

_BUILT: Dict[Tuple, Groups2D] = {}


def all_cp_rank_lists(cp_group: Optional[dist.ProcessGroup]) -> List[List[int]]:
    """The global ranks of every CP group of the job (each ordered by CP rank). Collective over the world."""
    mine = dist.get_process_group_ranks(cp_group) if cp_group is not None else [dist.get_rank()]
    gathered: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(mine))
    lists: List[List[int]] = []
    for ranks in gathered:
        if ranks not in lists:
            lists.append(ranks)
    return sorted(lists)


def groups_for(cp_group: Optional[dist.ProcessGroup], settings: Settings2D) -> Groups2D:
    """This rank's 2D groups inside ``cp_group`` (Megatron's CP group), built on first use (collective)."""
    cp_ranks = tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else (dist.get_rank(),)
    if len(cp_ranks) != settings.context_parallel_size:
        raise ValueError(f"the CP group has {len(cp_ranks)} ranks {list(cp_ranks)} but the 2D settings are for "
                         f"context_parallel_size {settings.context_parallel_size}")
    key = (cp_ranks, settings)
    if key not in _BUILT:
        _BUILT[key] = build_2d_groups(settings.head_parallel_size, settings.double_ring_window, settings.placement,
                                      cp_rank_lists=all_cp_rank_lists(cp_group))
    return _BUILT[key]


def destroy_2d_groups() -> None:
    """Forget the built groups (call with megatron's destroy_model_parallel)."""
    live = dist.distributed_c10d._world.pg_map
    for groups in _BUILT.values():
        for pg in (groups.head_group, groups.inner_kv_group, groups.inner_dkv_group,
                   groups.outer_kv_group, groups.outer_dkv_group):
            if pg is not None and pg in live:
                dist.destroy_process_group(pg)
    _BUILT.clear()
