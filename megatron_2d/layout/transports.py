"""Which K/V transport one attention call takes: the one rule the op and the planner share (pure Python).

The rule reads three facts of the call: the context size cp, the ring tokens (the keys of each context rank's
block that other ranks may see: every key for zigzag shards, the long documents' prefix for the documents mode,
none when no document crosses a context rank) and whether every pair of context ranks sees some key of each
other (:attr:`megatron_2d.layout.block_calls.ContextCalls.dense`; for packed documents,
:meth:`megatron_2d.PackedSharding.neighbour_keys` being None).

    local        nothing moves: one context rank, or no key that another rank sees (LocalBlock)
    neighbour    some pair of context ranks sees nothing of each other: each block goes straight to the ranks that
                 see it, only the keys they read (NeighbourExchange)
    double_ring  every pair sees something: every block round the inner and outer rings (DoubleRing)

The op builds the transport of a kind from the transports' registry
(:func:`megatron_2d.transport.kinds.transport_classes`: each class registers by its kind); the planner charges the
kind's times (:mod:`megatron_2d.plan.windows`, :mod:`megatron_2d.plan.step`). A new transport is its module in
``transport/`` (registered), a member of :class:`TransportKind` and its rule here, and its cost in the planner.

    >>> transport_kind(context_size=4, ring_tokens=512, every_pair_sees=False)
    'neighbour'
    >>> transport_kind(context_size=4, ring_tokens=0, every_pair_sees=True)
    'local'
"""

from __future__ import annotations

from .choices import TRANSPORT_KINDS, TransportKind

__all__ = ["TRANSPORT_KINDS", "TransportKind", "transport_kind"]


def transport_kind(context_size: int, ring_tokens: int, every_pair_sees: bool) -> TransportKind:
    """The kind of transport (:class:`TransportKind`) for a context group of ``context_size`` ranks whose blocks
    offer ``ring_tokens`` keys to other ranks, ``every_pair_sees`` telling whether every pair sees some of them."""
    if context_size == 1 or ring_tokens == 0:
        return TransportKind.LOCAL
    return TransportKind.DOUBLE_RING if every_pair_sees else TransportKind.NEIGHBOUR
