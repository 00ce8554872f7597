"""The op's one table of transports: the transport class of each kind, registered by ``@TRANSPORTS.register``.

A transport is a class with a ``kind`` (a :class:`~megatron_2d.layout.choices.TransportKind`), its
``traffic_kinds`` and ``for_routes`` (the :class:`~megatron_2d.transport.base.Transport` contract), decorated with
``@TRANSPORTS.register`` in its module; ``megatron_2d/transport/__init__.py`` imports every such module, so the
table is whole once the package is imported (:mod:`megatron_2d.layout.registry`: one class per kind, whatever the
import order). A new transport is its module (imported there), its kind and rule in
:mod:`megatron_2d.layout.transports` and its cost in the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..layout.choices import TransportKind
from ..layout.registry import Registry

if TYPE_CHECKING:
    from .base import Transport

TRANSPORTS: Registry[type[Transport]] = Registry("transport kind", TransportKind, key="kind")
"""TransportKind -> its transport class."""


def transport_classes() -> dict[TransportKind, type[Transport]]:
    """kind -> the transport class of that kind, in the order of TransportKind (RuntimeError if one has none)."""
    return dict(TRANSPORTS.complete())
