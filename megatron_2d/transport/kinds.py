"""The op's one table of transports: the transport class of each kind, as registered by ``@TRANSPORTS.register``.

A transport is a class with a ``kind`` (a :class:`~megatron_2d.layout.choices.TransportKind`), its
``traffic_kinds`` and ``for_routes`` (the :class:`~megatron_2d.transport.base.Transport` contract), decorated with
``@TRANSPORTS.register`` (:data:`megatron_2d.transport.base.TRANSPORTS`) in its module; this module imports every
such module, so the table is whole once it is imported (:mod:`megatron_2d.layout.registry`: one class per kind,
whatever the import order). A new transport is its module (imported here), its kind and rule in
:mod:`megatron_2d.layout.transports` and its cost in the planner.
"""

from __future__ import annotations

from ..layout.choices import TransportKind
from . import double_ring, neighbour_exchange  # noqa: F401 (each registers its transport)
from .base import TRANSPORTS, Transport

__all__ = ["TRANSPORTS", "transport_classes"]


def transport_classes() -> dict[TransportKind, type[Transport]]:
    """kind -> the transport class of that kind, in the order of TransportKind (RuntimeError if one has none)."""
    return dict(TRANSPORTS.complete())
