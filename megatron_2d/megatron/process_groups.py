"""2D process groups for Megatron's CP groups, owned by the model configuration that builds them.

Building them is collective over the whole world (every rank creates every group in the same order), so it
happens at model construction, which all ranks run together, never in forward.

Ownership: a :class:`GroupRegistry` holds the groups one model builds, one set per (CP group, settings). It lives
on the model's TransformerConfig (``group_registry(config)``), so the layers of one model share their groups and
their byte counter, and two models built from two configs get their own groups and counters even when their
settings are equal. Models built from one config instance share them knowingly (they are one model's layers as
far as the config can tell); a deep copy of the config (Megatron makes one per layer in some GQA x TP cases) keeps
the same registry. Nothing is cached at module level: the only module state is a weak set of the live registries,
for :func:`destroy_2d_groups` with no argument.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from ..groups import Groups2D, build_groups_for_layout
from .settings import Settings2D

_LIVE: weakref.WeakSet[GroupRegistry] = weakref.WeakSet()
_ATTRIBUTE = "_megatron_2d_group_registry"


def all_cp_rank_lists(cp_group: dist.ProcessGroup | None) -> list[list[int]]:
    """The global ranks of every CP group of the job (each ordered by CP rank). Collective over the world."""
    mine = dist.get_process_group_ranks(cp_group) if cp_group is not None else [dist.get_rank()]
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(mine))
    lists: list[list[int]] = []
    for ranks in gathered:
        if ranks not in lists:
            lists.append(ranks)
    return sorted(lists)


class GroupRegistry:
    """The 2D groups of one model: built on first use (collective), one set per (CP group, settings)."""

    def __init__(self) -> None:
        self._built: dict[tuple, Groups2D] = {}
        _LIVE.add(self)

    def __deepcopy__(self, memo) -> GroupRegistry:
        return self  # a copied config belongs to the same model: same groups, same byte counter

    def groups_for(self, cp_group: dist.ProcessGroup | None, settings: Settings2D) -> Groups2D:
        """This rank's 2D groups inside ``cp_group`` (Megatron's CP group), built on first use (collective)."""
        cp_ranks = tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else (dist.get_rank(),)
        if len(cp_ranks) != settings.context_parallel_size:
            raise ValueError(
                f"the CP group has {len(cp_ranks)} ranks {list(cp_ranks)} but the 2D settings are for "
                f"context_parallel_size {settings.context_parallel_size}"
            )
        key = (cp_ranks, settings)
        if key not in self._built:
            self._built[key] = build_groups_for_layout(settings.layout, all_cp_rank_lists(cp_group))
        return self._built[key]

    def destroy(self) -> None:
        """Destroy the process groups built so far and forget them."""
        for groups in self._built.values():
            groups.destroy()
        self._built.clear()


def group_registry(config) -> GroupRegistry:
    """The registry of the model ``config`` configures (made on first use; TransformerConfig2D makes it when built,
    so that per-layer deep copies of the config share it)."""
    registry = getattr(config, _ATTRIBUTE, None)
    if registry is None:
        registry = GroupRegistry()
        setattr(config, _ATTRIBUTE, registry)
    return registry


def groups_for(
    cp_group: dist.ProcessGroup | None, settings: Settings2D, registry: GroupRegistry | None = None
) -> Groups2D:
    """This rank's 2D groups inside ``cp_group``, from ``registry`` (built there on first use); without a registry,
    new groups that belong to the caller. Collective when it builds."""
    if registry is None:
        return build_groups_for_layout(settings.layout, all_cp_rank_lists(cp_group))
    return registry.groups_for(cp_group, settings)


def destroy_2d_groups(owner=None) -> None:
    """Destroy 2D groups (call with megatron's destroy_model_parallel): those of ``owner`` (a GroupRegistry, a model
    config, or a module with ``.config``), or, with no argument, those of every live registry."""
    if owner is None:
        registries = list(_LIVE)
    elif isinstance(owner, GroupRegistry):
        registries = [owner]
    else:
        registries = [group_registry(getattr(owner, "config", owner))]
    for registry in registries:
        registry.destroy()
