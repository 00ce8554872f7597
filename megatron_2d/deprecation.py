"""Renamed keywords, config fields and command-line flags: the old name keeps working for one release, with a
DeprecationWarning naming the new one; giving both names with different values is an error naming both.

Renamed after 0.1.0 (the Double-Ring window was ``window_size``, which is also Megatron's sliding window):

    build_2d_groups(window_size=)          -> ring_window=
    Layout2D(window_size=), .window_size   -> ring_window
    Groups2D.window_size                   -> ring_window
    cp_2d_window_size (config field)       -> cp_2d_ring_window
    --cp-2d-window-size                    -> --cp-2d-ring-window
    double_ring_window= (layer spec keyword, CoreAttention2D spec param) -> ring_window=
    PackedLayout.placement (the documents mode's document sharding) -> PackedLayout.sharding
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of a renamed setting: ``old`` still works this release; use ``new``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keywords(**old_to_new: str) -> Callable:
    """Decorator: keyword ``old`` of the function is accepted as ``new`` (with :func:`warn_renamed`); a call that
    gives both (``new`` by keyword or by position) is a TypeError naming both."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        name = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                if new in signature.bind_partial(*args, **kwargs).arguments:
                    raise TypeError(f"{name}() got both {new}= and its deprecated name {old}=; give {new}= only")
                warn_renamed(f"{name}({old}=)", f"{name}({new}=)")
                kwargs[new] = value
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def renamed_field(obj: Any, old: str, new: str, default: Any) -> None:
    """Config field ``old`` (default None) renamed to ``new`` (default ``default``): when ``old`` is set, warn and
    copy it into ``new`` (``old`` becomes None, so a copy of the config does not warn again); ValueError naming both
    when ``new`` is also set, to something else."""
    old_value = getattr(obj, old)
    if old_value is None:
        return
    new_value = getattr(obj, new)
    if new_value != default and new_value != old_value:
        raise ValueError(
            f"{new}={new_value!r} and its deprecated name {old}={old_value!r} are both set, to different "
            f"values; set {new} only"
        )
    warn_renamed(old, new, stacklevel=4)
    setattr(obj, new, old_value)
    setattr(obj, old, None)


class RenamedFlag(argparse.Action):
    """The old spelling of a renamed flag: stores into its own dest (absent unless given: ``default`` is
    argparse.SUPPRESS), so whatever reads the new one (the config's deprecated field) can tell both apart, and says
    it is deprecated (a DeprecationWarning, and a line on stderr, which a launch shows whatever the warning
    filters). ``new_flag``: the spelling to use instead."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        self.new_flag = new_flag
        kwargs.setdefault("default", argparse.SUPPRESS)
        kwargs.setdefault("help", f"deprecated spelling of {new_flag}")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        message = f"{option_string} is deprecated and will be removed in the next release; use {self.new_flag}"
        print(f"megatron_2d: {message}", file=sys.stderr)
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)
