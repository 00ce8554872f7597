"""The one registry style: a class per member of a choice enum, registered by a class decorator (pure Python).

Kernels (:data:`megatron_2d.kernels.KERNELS`, by :class:`~.choices.Kernel`), transports
(:data:`megatron_2d.transport.base.TRANSPORTS`, by :class:`~.choices.TransportKind`) and packing modes
(:data:`megatron_2d.packing.modes.MODES`, by :class:`~.choices.PackingMode`) are each one :class:`Registry`. A class
names its member in one class attribute (the registry's ``key``: a kernel's ``name``, a transport's ``kind``) and
carries whatever else the registry's users need (a kernel its optional package and availability check); it
registers itself with ``@REGISTRY.register`` where it is defined, and the module users read the table from imports
every such module (``kernels/__init__.py``, ``transport/kinds.py``; the packing modes are one module), so the table
is whole once that is imported. The key becomes its enum member; a second class claiming a member, or a
class claiming a name the enum does not list (unless the registry takes extra names: a test's own packing mode), is
refused when it registers, so the import order cannot change which class holds a member. Iteration follows the
enum's order, then extra names in registration order.

    >>> from .choices import Placement
    >>> PLACES = Registry("placement", Placement, key="placement")
    >>> @PLACES.register
    ... class HeadFirst:
    ...     placement = "head_first"
    >>> PLACES["head_first"] is HeadFirst, type(HeadFirst.placement).__name__, PLACES.missing()
    (True, 'Placement', ['context_first'])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from .choices import StrEnum, check_choice

C = TypeVar("C", bound=type)


class Registry(Mapping, Generic[C]):
    """member -> the one class of that member (a read-only mapping; :meth:`register` fills it)."""

    def __init__(
        self, what: str, enum: type[StrEnum], base: type | None = None, key: str = "name", extras: bool = False
    ) -> None:
        """A registry of ``what`` (named in errors) keyed by the members of ``enum``: classes (subclasses of
        ``base`` when given) naming their member in the class attribute ``key``; ``extras``: names outside the enum
        are taken too."""
        self.what, self.enum, self.base, self.key, self.extras = what, enum, base, key, extras
        self._classes: dict[str, C] = {}

    def register(self, cls: C) -> C:
        """Class decorator: register ``cls`` under the member its ``key`` attribute names (set to the member)."""
        name = getattr(cls, self.key, None) if isinstance(cls, type) else None
        if not isinstance(name, str) or (self.base is not None and not issubclass(cls, self.base)):
            kind = "a class" if self.base is None else f"a {self.base.__name__} subclass"
            raise TypeError(f"a {self.what} is {kind} with a {self.key}, got {cls!r}")
        if name in tuple(self.enum):
            name = self.enum(name)
        elif not self.extras:
            raise ValueError(
                f"{cls.__qualname__}.{self.key} {name!r} is not one of {list(self.enum)} "
                f"(megatron_2d.layout.choices.{self.enum.__name__}): add the member there"
            )
        if name in self._classes:
            raise ValueError(
                f"{self.what} {name!r} is registered already ({self._classes[name].__qualname__}); "
                f"{cls.__qualname__} claims it too: one class per {self.what}"
            )
        setattr(cls, self.key, name)
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove the class of ``name`` (a test's own class, after the test)."""
        del self._classes[name]

    def missing(self) -> list[StrEnum]:
        """The members no class is registered for."""
        return [member for member in self.enum if member not in self._classes]

    def complete(self) -> Registry[C]:
        """Itself, once every member has its class; else RuntimeError naming the members without one."""
        missing = self.missing()
        if missing:
            raise RuntimeError(f"{self.what}s without a class: {missing} (each needs a class registered)")
        return self

    def lookup(self, value, setting: str) -> C:
        """The class of ``value``, or ValueError naming ``setting``, the value and the registered names (the check
        of a setting naming a member, on every route it comes in by)."""
        return self._classes[check_choice(setting, value, tuple(self))]

    def __getitem__(self, name: str) -> C:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        members = [member for member in self.enum if member in self._classes]
        return iter(members + [name for name in self._classes if name not in members])

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return f"Registry({self.what}: {', '.join(f'{k}={c.__qualname__}' for k, c in self.items())})"
