"""Creation of the 2D process groups (collective), on top of the pure rank math in :mod:`topology`."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .call.options import BoundedCache
from .layout.block_calls import received_chunks
from .layout.choices import Placement
from .layout.topology import Layout2D, LayoutError, RankPlace, place_all_ranks
from .transport.comm import CommCounter, check_same_on_every_rank, collective_device, traffic_backend


@dataclass(eq=False)
class Groups2D:
    """One rank's view of 2D context parallelism: its place, its process groups, and a byte counter.

    Each object is its own: equal and hashed by identity (two Groups2D of one layout and place still have their own
    process groups, byte counter and cached call plans), so that it can key the call plans of a packed layout.

    Groups of a single rank are None (no communication is needed there). K/V and dK/dV use separate process
    groups so both can be in flight at once: the Double-Ring's inner and outer rings, and the whole context group,
    which carries the neighbour exchange (masks such as sliding windows where ranks see only some others' keys;
    K/V and dK/dV) and the Double-Ring's last dK/dV hop (``context_dkv_group``).
    """

    layout: Layout2D
    place: RankPlace
    head_group: dist.ProcessGroup | None
    inner_kv_group: dist.ProcessGroup | None
    inner_dkv_group: dist.ProcessGroup | None
    outer_kv_group: dist.ProcessGroup | None
    outer_dkv_group: dist.ProcessGroup | None
    context_kv_group: dist.ProcessGroup | None = None
    context_dkv_group: dist.ProcessGroup | None = None
    comm_bytes: CommCounter = field(default_factory=CommCounter)
    op_cache: BoundedCache = field(default_factory=BoundedCache, repr=False)
    """attention_2d's call plans (:mod:`megatron_2d.call.plan`: calls, transports, kernel, index tensors), one per
    signature, owned by these groups (a bounded cache)."""
    batch_layouts: BoundedCache = field(default_factory=BoundedCache, repr=False)
    """Packed layouts built for these groups from batch objects (Megatron's PackedSeqParams, by the core attention's
    first layer of a batch, for the others to reuse), keyed by the batch object's id: (batch object, layout)."""

    @property
    def head_parallel_size(self) -> int:
        return self.layout.head_parallel_size

    @property
    def context_size(self) -> int:
        return self.layout.context_size

    @property
    def inner_ring_size(self) -> int:
        return self.layout.inner_ring_size

    def received_chunks(self, context_rank: int) -> tuple[int, ...]:
        """Chunk ids in the order the all-to-all delivers them: by head rank, then first/second zigzag half."""
        return received_chunks(self.layout, context_rank)

    def process_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Every process group of this rank (the None ones of single-rank groups left out)."""
        return tuple(
            pg
            for pg in (
                self.head_group,
                self.inner_kv_group,
                self.inner_dkv_group,
                self.outer_kv_group,
                self.outer_dkv_group,
                self.context_kv_group,
                self.context_dkv_group,
            )
            if pg is not None
        )

    def destroy(self) -> None:
        """Destroy this rank's process groups (those still alive); the op's cached setup goes with them."""
        live = dist.distributed_c10d._world.pg_map
        for pg in self.process_groups():
            if pg in live:
                dist.destroy_process_group(pg)
        self.op_cache.clear()
        self.batch_layouts.clear()


def default_group_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (e.g. Megatron's --distributed-timeout-minutes), if readable."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = collective_device(pg)
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def _create(
    rank_lists: list[list[int]], timeout: datetime.timedelta | None, backend: str | None
) -> dist.ProcessGroup | None:
    """Create every group of one kind, on every rank in the same order; return this rank's (None if size 1)."""
    if len(rank_lists[0]) == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout, backend=backend)
    return mine


def warm_up_p2p(group: dist.ProcessGroup | None, ring: Sequence[int], position: int) -> None:
    """One batched ring step in both directions on a group whose point-to-point traffic may involve only some of
    its ranks (the context groups: neighbour exchange, the Double-Ring's last dK/dV hop). ``ring``: the group's
    global ranks in ring order, ``position`` this rank's place in it. Each rank sends one element to its next and
    its previous rank and receives one from each (one message each way on a ring of 2).

    ProcessGroupNCCL makes a group's communicator at its first call, and a batched P2P call uses the group's whole
    communicator, as collectives do (its ``pointToPoint``), so every rank must join the first batch
    (``batch_isend_irecv``'s documentation); later batches may involve some ranks only. NCCL (2.22 on, with
    NCCL_RUNTIME_CONNECT=1, the default) connects peers and allocates their buffers at first use: an all_reduce
    here would set up collective (ring/tree) channels on communicators that never run one, where this step
    connects only the +1 and -1 neighbours, the pairs a sliding window's neighbour exchange uses. gloo needs none."""
    if group is None or traffic_backend(group) != "nccl":
        return
    device, size = collective_device(group), len(ring)
    next_rank, prev_rank = ring[(position + 1) % size], ring[(position - 1) % size]
    peers = [next_rank] if next_rank == prev_rank else [next_rank, prev_rank]
    ops = [dist.P2POp(dist.isend, torch.zeros(1, device=device), peer, group) for peer in peers]
    ops += [dist.P2POp(dist.irecv, torch.empty(1, device=device), peer, group) for peer in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def build_2d_groups(
    head_parallel_size: int,
    inner_ring_size: int | None = None,
    placement: str = Placement.HEAD_FIRST,
    cp_rank_lists: Sequence[Sequence[int]] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
) -> Groups2D:
    """Build the 2D groups. Collective over the default group: every rank calls it with the same arguments.

    Args:
        head_parallel_size: hp, ranks per head group (all-to-all over heads).
        inner_ring_size: w, context ranks per inner ring (Double-Ring); cp / w inner rings form the outer ring.
            None (the default): w = cp, one ring.
        placement: "head_first" (head groups on adjacent ranks) or "context_first" (context rings adjacent).
        cp_rank_lists: global ranks of every CP group (each list ordered by CP rank); default one group of all ranks.
        timeout: timeout of the new process groups (when None: the default group's, else torch's default).
        backend: backend of the new groups (the default group's when None).
    """
    lists = [list(range(dist.get_world_size()))] if cp_rank_lists is None else [list(r) for r in cp_rank_lists]
    _check_same_arguments(head_parallel_size, inner_ring_size, placement, lists)  # before validating: no rank hangs
    layout = Layout2D(len(lists[0]) if lists else 0, head_parallel_size, inner_ring_size, placement)
    return _build(layout, lists, timeout, backend)


def build_groups_for_layout(
    layout: Layout2D,
    cp_rank_lists: Sequence[Sequence[int]],
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
) -> Groups2D:
    """:func:`build_2d_groups` for a validated layout (collective: every rank passes the same layout and lists)."""
    lists = [list(r) for r in cp_rank_lists]
    _check_same_arguments(layout.head_parallel_size, layout.inner_ring_size, layout.placement, lists)
    return _build(layout, lists, timeout, backend)


def _check_same_arguments(head_parallel_size, inner_ring_size, placement, lists: list[list[int]]) -> None:
    """LayoutError on every rank unless all ranks passed the same (hp, w, placement, cp_rank_lists)."""
    check_same_on_every_rank(
        (head_parallel_size, inner_ring_size, placement, lists),
        [dist.group.WORLD],
        "build_2d_groups called with different arguments (hp, w, placement, cp_rank_lists)",
        error=LayoutError,
    )


def _build(
    layout: Layout2D, lists: list[list[int]], timeout: datetime.timedelta | None, backend: str | None
) -> Groups2D:
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = default_group_timeout() if timeout is None else timeout
    places = place_all_ranks(layout, lists, world)

    def all_of(groups_of: Callable[[Sequence[int]], Sequence[Sequence[int]]]) -> list[list[int]]:
        """Every CP group's groups of one kind (``groups_of``: a Layout2D method, CP ranks -> rank lists)."""
        return [list(g) for cp_ranks in lists for g in groups_of(cp_ranks)]

    head = _create(all_of(layout.head_groups), timeout, backend)
    intra, inter = all_of(layout.inner_ring_groups), all_of(layout.outer_ring_groups)
    context = all_of(layout.context_groups)
    groups = Groups2D(
        layout=layout,
        place=places[rank],
        head_group=head,
        inner_kv_group=_create(intra, timeout, backend),
        inner_dkv_group=_create(intra, timeout, backend),
        outer_kv_group=_create(inter, timeout, backend),
        outer_dkv_group=_create(inter, timeout, backend),
        context_kv_group=_create(context, timeout, backend),
        context_dkv_group=_create(context, timeout, backend),
    )
    place = places[rank]
    warm_up_p2p(groups.context_kv_group, place.context_group, place.context_rank)
    warm_up_p2p(groups.context_dkv_group, place.context_group, place.context_rank)
    settle_gloo_connections(groups.process_groups())
    return groups


def settle_gloo_connections(groups: Sequence[dist.ProcessGroup]) -> None:
    """Wait until every rank has created its groups, when they are gloo's (``groups``: this rank's, the same kinds
    and backend on every rank; called on every rank of the world, as the groups' creation is).

    Creating a gloo group returns on a rank once its own side of each pair is connected; the peer may still be reading
    the handshake. A rank that went on and destroyed the group (a teardown or layout switch right after a build) closed
    the socket under it, and the peer's creation failed ("Connection closed by peer" in connectFullMesh). One barrier
    on the world, the same collective on every rank, closes that window. NCCL groups connect at first use
    (:func:`warm_up_p2p`) and need none."""
    if any(traffic_backend(group) == "gloo" for group in groups):
        dist.barrier()
