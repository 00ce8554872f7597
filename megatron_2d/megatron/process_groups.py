"""2D process groups for Megatron's CP groups, owned by the model that builds them and handed to its layers.

When they are built. Building them is collective over the whole world: every rank gathers every CP group's ranks,
checks that all ranks ask for the same layout and creates every group in the same order. A pipeline stage that holds
no 2d attention layer (a Mamba-only stage of a hybrid pattern such as ``'M-|*-'``, a GPT stage of
``--pipeline-model-parallel-layout`` without decoder layers) must take part all the same, or the other ranks wait
for it forever. So the model's construction builds them, on every rank and before any layer, whatever the rank
builds: :func:`build_model_groups`, called by

  * ``HybridStack2D`` (every HybridModel route: pretrain_hybrid.py patched or with ``--spec``, and Python users of
    the hybrid specs), with the settings of its spec's CoreAttention2D;
  * the GPT spec functions, ``get_gpt_layer_spec_2d(config)`` and ``gpt_layer_spec_2d`` (pretrain_gpt.py patched
    or with ``--spec``, examples/pretrain_gpt_2d.py): Megatron's GPT builder calls them on every rank, once per
    virtual pipeline stage.

Models built twice from one config, and virtual pipeline stages, find them built (one set per CP group and settings,
the same decision on every rank). A model built without either (layers from a hand-made ModuleSpec of
CoreAttention2D, or the ready ``GPT_LAYER_SPEC_2D``, which Megatron does not call) builds them at its first 2d layer,
which is safe only when every rank builds one; once a model's construction has built its groups, a layer asking for
others is refused (building them then would leave the ranks without that layer behind). Nothing is built in forward,
nor by the launch checks (on the patched routes those run before torch.distributed is initialized).

Hybrid (dynamic) CP (:mod:`.dynamic`): the same registry builds, at the same moment, the 2D groups of every CP group
size and slice of the DP x CP groups (:meth:`GroupRegistry.build_dynamic`), one set per (DP x CP group, layouts).

Ownership: a :class:`GroupRegistry` holds the groups one model builds, one set per (CP group, settings), so the
layers of one model share their groups and their byte counter, and two models get their own groups and counters
even when their settings are equal. A registry per CP group (shared by every model on it, as Megatron's own groups
are) cannot tell which model's construction built what: its mark refused a second model whose layers build at first
use. So the registry is the model's, and its anchor is the one object that spans the model: its TransformerConfig
(:func:`group_registry`). Megatron hands the config to the spec function of every virtual pipeline stage and of
every model built from it, before any ``pg_collection`` exists (megatron-core 0.19.2's GPTModel makes its collection
inside, after the spec), so the config is what lets the second stage find the first one's groups. Models built from
one config instance share them knowingly (they are one model's layers as far as the config can tell); a deep copy
of the config keeps the same registry.

How the layers get it: handed over, not looked up. The GPT spec functions and ``HybridStack2D`` put the model's
registry into CoreAttention2D's ModuleSpec params (``groups_2d``) when they build the groups; each layer takes its
groups from the registry it is given and keeps it as ``layer.groups_2d`` (which :func:`destroy_2d_groups` finds). A
Python user who builds the model's ``ProcessGroupCollection`` may carry a registry there instead
(``pg_collection.groups_2d``, :data:`PG_ATTRIBUTE`, as the collection carries Megatron's hierarchical CP groups):
:func:`model_registry` takes the spec's, then the collection's. Only a layer given neither (the ready
``GPT_LAYER_SPEC_2D`` on the stock pretrain_gpt.py, a hand-made spec) falls back to its config's registry: no
explicit path reaches it there. Nothing is cached at module level: the only module state is a weak set of the live
registries, for :func:`destroy_2d_groups` with no argument.
"""

from __future__ import annotations

import logging
import weakref

import torch.distributed as dist

from ..groups import Groups2D, build_groups_for_layout
from .dynamic import DynamicGroups, build_dynamic_groups, check_dynamic_config, dynamic_layouts, is_dynamic
from .fields import fields_2d
from .settings import Settings2D, layer_settings, uses_2d

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[GroupRegistry] = weakref.WeakSet()
_ATTRIBUTE = "_megatron_2d_group_registry"  # the model config's registry (group_registry)
PG_ATTRIBUTE = "groups_2d"
"""The name that carries a model's :class:`GroupRegistry`: CoreAttention2D's spec param and attribute, and the
attribute of a ``ProcessGroupCollection`` that carries one (:func:`model_registry`)."""


def all_cp_rank_lists(cp_group: dist.ProcessGroup | None) -> list[list[int]]:
    """The global ranks of every CP group of the job (each ordered by CP rank). Collective over the world."""
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(cp_ranks_of(cp_group)))
    lists: list[list[int]] = []
    for ranks in gathered:
        if ranks not in lists:
            lists.append(ranks)
    return sorted(lists)


def cp_ranks_of(cp_group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``cp_group`` in CP rank order (this rank alone when None)."""
    return tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else (dist.get_rank(),)


class GroupRegistry:
    """The 2D groups of one model, one set per (CP group, settings): built by :meth:`build` at the model's
    construction (collective), or at first use by a model built without it."""

    def __init__(self) -> None:
        self._built: dict[tuple, Groups2D] = {}
        self._dynamic: dict[tuple, DynamicGroups] = {}
        self._built_at_construction = False
        _LIVE.add(self)

    def __deepcopy__(self, memo) -> GroupRegistry:
        return self  # a copied config belongs to the same model: same groups, same byte counter

    def build(self, cp_group: dist.ProcessGroup | None, settings: Settings2D) -> Groups2D:
        """This rank's 2D groups inside ``cp_group`` for ``settings``, built unless they are (collective: every
        rank calls it in the same order, with its own CP group and the same settings), and the model's groups
        marked as built at its construction (see :meth:`groups_for`)."""
        self._built_at_construction = True
        return self._get(cp_group, settings)

    def groups_for(self, cp_group: dist.ProcessGroup | None, settings: Settings2D) -> Groups2D:
        """This rank's 2D groups inside ``cp_group`` (Megatron's CP group) for a layer: those :meth:`build` made;
        built here on first use (collective) only when the model's construction built none. ValueError for
        groups its construction did not build."""
        key = self._key(cp_group, settings)
        if key not in self._built and self._built_at_construction:
            built = [f"CP ranks {list(ranks)} with {s}" for ranks, s in self._built]
            raise ValueError(
                f"a 2d attention layer asks for the 2D groups of CP ranks {list(key[0])} with {settings}, but "
                f"the model's construction built {built}: building them now would leave the ranks that build no "
                f"such layer (e.g. pipeline stages without attention) behind in the collectives; build the layer "
                f"with the model's own spec settings and process groups"
            )
        return self._get(cp_group, settings)

    def _key(self, cp_group: dist.ProcessGroup | None, settings: Settings2D) -> tuple:
        cp_ranks = cp_ranks_of(cp_group)
        if len(cp_ranks) != settings.context_parallel_size:
            raise ValueError(
                f"the CP group has {len(cp_ranks)} ranks {list(cp_ranks)} but the 2D settings are for "
                f"context_parallel_size {settings.context_parallel_size}"
            )
        return (cp_ranks, settings)

    def _get(self, cp_group: dist.ProcessGroup | None, settings: Settings2D) -> Groups2D:
        key = self._key(cp_group, settings)
        if key not in self._built:
            self._built[key] = build_groups_for_layout(settings.layout, all_cp_rank_lists(cp_group))
        return self._built[key]

    def build_dynamic(self, config) -> DynamicGroups:
        """The 2D groups of every CP group size of hybrid (dynamic) CP for ``config`` (:mod:`.dynamic`), built unless
        they are (collective: every rank calls it in the same order), printed once on rank 0, and the model's
        groups marked as built at its construction."""
        self._built_at_construction = True
        return self._get_dynamic(config, announce=True)

    def dynamic_for(self, config) -> DynamicGroups:
        """A layer's hybrid-CP groups: those :meth:`build_dynamic` made; built here (collective) only when the
        model's construction built none. ValueError for groups its construction did not build."""
        key = self._dynamic_key(config)
        if key not in self._dynamic and self._built_at_construction:
            raise ValueError(
                f"a 2d attention layer asks for the hybrid context-parallel groups of DP x CP ranks {list(key[0])}, "
                f"but the model's construction built other groups: build the layer with the model's own config "
                f"and process groups"
            )
        return self._get_dynamic(config, announce=False)

    @staticmethod
    def _dynamic_key(config) -> tuple:
        group = _megatron_dp_cp_group()
        return (cp_ranks_of(group), fields_2d(config).cp_2d_dynamic_layouts, config.max_seqlen_per_dp_cp_rank)

    def _get_dynamic(self, config, announce: bool) -> DynamicGroups:
        key = self._dynamic_key(config)
        if key not in self._dynamic:
            layouts = dynamic_layouts(config, len(key[0]))
            self._dynamic[key] = build_dynamic_groups(layouts, _megatron_dp_cp_group())
            if dist.get_rank() == 0:
                logger.info("megatron_2d: %s", layouts.describe(fields_2d(config).cp_2d_placement))
        return self._dynamic[key]

    def destroy(self) -> None:
        """Destroy the process groups built so far and forget them."""
        for groups in self._built.values():
            groups.destroy()
        for dynamic in self._dynamic.values():
            dynamic.destroy()
        self._built.clear()
        self._dynamic.clear()


def group_registry(config) -> GroupRegistry:
    """The registry of the model ``config`` configures (made on first use; TransformerConfig2D makes it when built,
    so that per-layer deep copies of the config share it)."""
    registry = getattr(config, _ATTRIBUTE, None)
    if registry is None:
        registry = GroupRegistry()
        setattr(config, _ATTRIBUTE, registry)
    return registry


def model_registry(config, pg_collection=None, given: GroupRegistry | None = None) -> GroupRegistry:
    """The registry a model's 2d layers take their groups from: ``given`` (CoreAttention2D's ``groups_2d`` spec
    param, set by the spec functions and HybridStack2D), else the one ``pg_collection`` carries as ``groups_2d``, else
    (the ready spec, hand-made specs: no explicit path) the model config's, :func:`group_registry`."""
    carried = getattr(pg_collection, PG_ATTRIBUTE, None)
    for source, registry in (("groups_2d", given), (f"pg_collection.{PG_ATTRIBUTE}", carried)):
        if registry is not None:
            if not isinstance(registry, GroupRegistry):
                raise TypeError(f"{source} is a {type(registry).__name__}, not a megatron_2d GroupRegistry")
            return registry
    return group_registry(config)


def groups_for(
    cp_group: dist.ProcessGroup | None, settings: Settings2D, registry: GroupRegistry | None = None
) -> Groups2D:
    """This rank's 2D groups inside ``cp_group``, from ``registry`` (built there on first use); without a registry,
    new groups that belong to the caller. Collective when it builds."""
    if registry is None:
        return build_groups_for_layout(settings.layout, all_cp_rank_lists(cp_group))
    return registry.groups_for(cp_group, settings)


def build_model_groups(
    config, cp_group: dist.ProcessGroup | None = None, registry: GroupRegistry | None = None, **overrides
) -> Groups2D | None:
    """Build the 2D groups that the 2d core attention layers of the model ``config`` configures will ask for, on
    this rank as on every other, whether or not this rank builds such a layer (collective over the world; see the
    module docstring for who calls it). Settings: the config's with the layer spec's ``overrides``
    (:func:`.settings.layer_settings`); ``cp_group``: the layers' CP group, megatron's by default; ``registry``:
    the model's (:func:`model_registry`), the config's by default. Builds nothing
    (None) before torch.distributed and megatron's parallel state are initialized (a spec made for inspection),
    or when no layer would build groups (CP > 1 without the "2d" backend: the layers delegate or refuse)."""
    if cp_group is None:
        cp_group = _megatron_cp_group()
        if cp_group is None:
            return None
    cp_size = dist.get_world_size(cp_group)
    if cp_size > 1 and not uses_2d(config.cp_comm_type):
        return None
    registry = registry if registry is not None else group_registry(config)
    if is_dynamic(config):  # hybrid CP: every group size's groups; the layers check their settings
        check_dynamic_config(config)
        return registry.build_dynamic(config).static_groups(cp_group)
    return registry.build(cp_group, layer_settings(config, cp_size, **overrides))


def _megatron_cp_group() -> dist.ProcessGroup | None:
    """megatron's CP group, or None before torch.distributed and megatron's parallel state are initialized."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_context_parallel_group()


def _megatron_dp_cp_group() -> dist.ProcessGroup | None:
    """megatron's data-parallel x context-parallel group (hybrid CP cuts its groups from it)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def destroy_2d_groups(owner=None) -> None:
    """Destroy 2D groups (call with megatron's destroy_model_parallel): those of ``owner`` (a GroupRegistry; a model
    config: its registry; a module: its config's and those its 2d layers hold), or, with no argument, those of every
    live registry."""
    if owner is None:
        registries = list(_LIVE)
    elif isinstance(owner, GroupRegistry):
        registries = [owner]
    else:
        registries = [group_registry(getattr(owner, "config", owner))]
        modules = owner.modules() if callable(getattr(owner, "modules", None)) else ()
        held = dict.fromkeys(getattr(m, PG_ATTRIBUTE, None) for m in modules)
        registries += [r for r in held if isinstance(r, GroupRegistry) and r not in registries]
    for registry in registries:
        registry.destroy()
