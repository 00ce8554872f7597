"""The K/V transport contract of the ring attention, the pieces every transport shares, and the trivial transport.

A transport shows ``compute`` every K/V block this rank's queries see, this rank's own first, and in backward
brings home the dK/dV partials other ranks computed on its block. :class:`Transport` is the contract;
:class:`~megatron_2d.transport.double_ring.DoubleRing` (every block round the inner and outer rings),
:class:`~megatron_2d.transport.neighbour_exchange.NeighbourExchange` (each block straight to the ranks that see it) and
:class:`LocalBlock` (no other rank's keys are visible: nothing moves) implement it, and so does the one-process
:class:`megatron_2d.testing.loopback.LoopbackTransport`.

Blocks and riders: kv [b, S, ...] is this rank's block (K and V side by side on the last dim, or whatever the
caller's compute reads, e.g. MLA's latent); a dK/dV "rider" has the block's format, in the rider dtype. A partial
gradient covers keys [k_start, k_end) of one source block, as its last-dim pieces ((dk, dv), or (d block,)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from ..layout.choices import TransportKind
from ..layout.registry import Registry
from .comm import CommKind

if TYPE_CHECKING:
    from ..groups import Groups2D

# compute(block, source_context_rank, first_key) -> None (forward) or a list of (k_start, k_end, parts): the partial
# gradient of the source's keys [k_start, k_end), as the block's last-dim pieces (dk, dv) or the whole (d block,);
# ``block`` holds the source's keys from ``first_key`` on
Partials = list[tuple[int, int, tuple[torch.Tensor, ...]]]
ComputeFn = Callable[[torch.Tensor, int, int], Partials | None]


@dataclass(frozen=True)
class KeyRoutes:
    """What the transport of a kind needs to know of one mask besides the groups."""

    keys: Mapping | None = None
    """neighbour: the keys of src's block dst's calls read, per (dst, src) (hulls, or KeyIntervals)."""
    offsets: Sequence[int] | None = None
    """neighbour: the offsets dst - src (mod cp) some pair needs (None: found from ``keys``)."""
    ring_keys: int | None = None
    """double_ring: the first keys of each block that travel (None: all)."""


class Transport(Protocol):
    """How the K/V blocks of one context group reach the ranks whose queries see them.

    ``kind``: the kind of :func:`megatron_2d.layout.transports.transport_kind` it is the transport of, and
    ``for_routes(groups, routes)`` builds it for one rank from its groups and the :class:`KeyRoutes` of a mask (the
    class registers with ``@TRANSPORTS.register``; the op finds it through
    :func:`megatron_2d.transport.kinds.transport_classes`).

    ``run(kv, compute, dkv_dtype)``:
        kv        this rank's whole block [b, S, ...] (read only: received blocks go to buffers of the transport's
                  own). What leaves the rank is the transport's business: the whole block, only the key prefix
                  other ranks see (packed documents' ring prefix), or only the keys each other rank sees.
        compute   called once per visible block, the own block first (see :data:`ComputeFn`); a source whose
                  keys this rank does not see is not visited.
        dkv_dtype None in forward, which returns None. In backward the dtype the dK/dV partials accumulate and
                  travel in; returns this rank's dK/dV [b, S, ...] (shaped like ``kv``, in ``dkv_dtype``): its own
                  block's partials plus every partial other ranks computed on its keys.
    ``traffic_kinds``: what it sends, as the kinds (:data:`megatron_2d.transport.comm.COMM_KINDS`) under which every
    byte it sends is added to its groups' ``comm_bytes`` ("inner_ring" / "outer_ring" for the Double-Ring, "neighbour"
    for the neighbour exchange, none for a local block); the planner's traffic model counts the same kinds.
    No host-device synchronisation: transfers are posted and awaited, never read on the host.
    """

    kind: ClassVar[TransportKind]
    traffic_kinds: ClassVar[tuple[CommKind, ...]]

    @classmethod
    def for_routes(cls, groups: Groups2D, routes: KeyRoutes) -> Transport: ...

    def run(
        self, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None = None
    ) -> torch.Tensor | None: ...


TRANSPORTS: Registry[type[Transport]] = Registry("transport kind", TransportKind, key="kind")
"""TransportKind -> its transport class, each registered by ``@TRANSPORTS.register`` in its module (the op's table:
:func:`megatron_2d.transport.kinds.transport_classes`, which imports them all)."""


def _pieces(rows: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(view of ``rows`` [..., D], part) for each part, the parts' last dims laid side by side along D."""
    offset = 0
    for part in parts:
        width = part.shape[-1]
        yield rows[..., offset : offset + width], part
        offset += width


def gather_partials(buffer: torch.Tensor, partials: Partials, first_key: int = 0) -> torch.Tensor:
    """Write a block's partial gradients into the uninitialised ``buffer`` [b, keys from first_key, ...] (the
    block's format: K and V side by side on the last dim): when the partials' key ranges are disjoint, each is
    copied into place and only the keys none covers are zeroed (one pass over the buffer); overlapping partials are
    summed onto zeros. Returns buffer."""
    ranges = sorted((k_start - first_key, k_end - first_key) for k_start, k_end, _ in partials)
    if any(prev[1] > nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
        buffer.zero_()
        add_partials(buffer, partials, first_key)
        return buffer
    for k_start, k_end, parts in partials:
        for dst, part in _pieces(buffer[:, k_start - first_key : k_end - first_key], parts):
            dst.copy_(part)
    covered = 0
    for start, end in ranges + [(buffer.shape[1], buffer.shape[1])]:
        if start > covered:
            buffer[:, covered:start].zero_()
        covered = max(covered, end)
    return buffer


def add_partials(rider: torch.Tensor, partials: Partials, first_key: int = 0) -> None:
    """Add a block's partial gradients (keys [k_start, k_end)) into its rider [b, keys from first_key, ...]."""
    for k_start, k_end, parts in partials:
        for dst, part in _pieces(rider[:, k_start - first_key : k_end - first_key], parts):
            dst.add_(part)


def home_gradient(
    whole: torch.Tensor, own_partials: Partials, last_hop: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """A rank's gradient shaped like its whole block ``whole`` [b, keys, ...]: its own block's partials plus the
    rider of the last hop (None when nothing travels), which covers the first keys. A rider over every key becomes
    the result itself, the partials added onto it in place (no copy)."""
    if last_hop is not None and last_hop.shape == whole.shape:
        add_partials(last_hop, own_partials)
        return last_hop
    home = gather_partials(torch.empty(whole.shape, dtype=dtype, device=whole.device), own_partials)
    if last_hop is not None:
        home[:, : last_hop.shape[1]].add_(last_hop)
    return home


@TRANSPORTS.register
class LocalBlock:
    """The transport when no other context rank's keys are visible (whole documents only): nothing moves."""

    kind: ClassVar[TransportKind] = TransportKind.LOCAL
    traffic_kinds: ClassVar[tuple[CommKind, ...]] = ()

    def __init__(self, context_rank: int) -> None:
        self.context_rank = context_rank

    @classmethod
    def for_routes(cls, groups: Groups2D, routes: KeyRoutes) -> LocalBlock:
        return cls(groups.place.context_rank)

    def run(self, kv: torch.Tensor, compute: ComputeFn, dkv_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """:meth:`Transport.run` for the own block only."""
        partials = compute(kv, self.context_rank, 0)
        return None if dkv_dtype is None else home_gradient(kv, partials, None, dkv_dtype)
