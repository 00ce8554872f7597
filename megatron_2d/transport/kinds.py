"""The op's one table of transports: every transport class of this folder, by its kind, found on first use.

A transport is a class in a module of ``transport/`` with a ``kind`` (one of
:data:`megatron_2d.layout.transports.TRANSPORT_KINDS`), its ``traffic_kinds`` and ``for_routes`` (the
:class:`~megatron_2d.transport.base.Transport` contract). The table is read from the folder's modules, so that a new
transport is its module, its kind and rule in :mod:`megatron_2d.layout.transports` and its cost in the planner, and
no list of transports elsewhere; it must hold one class for every kind of the rule, and nothing else.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from ..layout.transports import TRANSPORT_KINDS
from .base import Transport


@functools.cache
def transport_classes() -> dict[str, type[Transport]]:
    """kind -> the transport class of that kind, in the order of TRANSPORT_KINDS (every module of this folder is
    imported on the first call)."""
    return find_transports(__name__.rsplit(".", 1)[0])


def find_transports(package: str) -> dict[str, type[Transport]]:
    """kind -> the one class of that kind (a ``kind`` string and ``for_routes``) in the modules of ``package``, in
    the order of TRANSPORT_KINDS. Raises RuntimeError when a kind has no class, two classes claim one, or a class
    claims a kind the rule does not know."""
    found: dict[str, list[type]] = {}
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and cls.__module__ == module.__name__
                and isinstance(getattr(cls, "kind", None), str)
                and callable(getattr(cls, "for_routes", None))
            ):
                found.setdefault(cls.kind, []).append(cls)
    several = {kind: [c.__qualname__ for c in classes] for kind, classes in found.items() if len(classes) > 1}
    unknown = sorted(set(found) - set(TRANSPORT_KINDS))
    missing = [kind for kind in TRANSPORT_KINDS if kind not in found]
    if several or unknown or missing:
        raise RuntimeError(
            f"{package} must hold one transport class per kind of layout.transports.TRANSPORT_KINDS "
            f"{TRANSPORT_KINDS}: kinds with several {several}, kinds the rule does not know {unknown}, kinds "
            f"without a class {missing}"
        )
    return {kind: found[kind][0] for kind in TRANSPORT_KINDS}
