"""Transformer Engine layer specs on CPU: named placeholder classes where megatron-core left TE's classes out.

Without Transformer Engine, megatron-core 0.19.2 leaves some ``TE*`` names of
``megatron.core.extensions.transformer_engine`` as ``None`` and others as ``MagicMock`` objects, and the spec modules
that imported them by name (``models.backends``, ``extensions.transformer_engine_spec_provider``,
``models.gpt.gpt_layer_specs``, ``models.hybrid.hybrid_layer_specs``, ``models.hybrid.hybrid_block``, ...) hold the
same objects; ``gpt_layer_specs`` sets ``TESpecProvider = None``. Inside :func:`te_spec_placeholders`:

  T1. each such ``TE*`` name, in the extension module and in every loaded ``megatron`` module holding the same
      object under that name, becomes a placeholder class ``type(name, bases, {})`` (one per name, shared): no
      bases, except where a spec builder reads a class attribute (:data:`PLACEHOLDER_BASES`);
  T2. every ``TESpecProvider = None`` becomes the real class of ``extensions.transformer_engine_spec_provider``
      (which imports fine without TE);
  T3. the extension module's ``HAVE_TE`` reads True and megatron-core's cached TE version is :data:`TE_VERSION`, so
      version-gated spec branches take the path a TE install takes (TENorm for q/k norms, TE expert linears);
  T4. the modules that build specs at import (:data:`BUILT_AT_IMPORT`) are re-executed, so their ready specs hold
      the placeholders.

Specs are ModuleSpec trees and are never instantiated here, so no placeholder is ever called. Everything is restored
on exit (the re-executed modules get their previous namespace back). With Transformer Engine installed, the context
changes nothing and the real classes are compared. Test support only.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from unittest import mock

TE_VERSION = "2.12.0"
"""The TE version megatron-core sees inside the context: above every threshold its spec builders test (1.7, 1.9,
1.13)."""

PLACEHOLDER_BASES = {"TEFusedMLP": "MLP", "TEFusedMLPWithGroupedLinear": "TEFusedMLP"}
"""The bases megatron-core's extension module gives the TE classes whose class attributes the spec builders read
(``TEFusedMLP.as_mlp_submodule``, from MLP): another placeholder's name, or "MLP" for megatron-core's MLP."""

BUILT_AT_IMPORT = ("megatron.core.models.hybrid.hybrid_layer_specs",)
"""Modules whose spec objects are made when they are imported (``hybrid_stack_spec``)."""

_MISSING = object()


def _left_out(value) -> bool:
    """Whether megatron-core put ``value`` in for a TE class it could not import."""
    return value is None or isinstance(value, mock.NonCallableMock)


def _megatron_modules():
    return [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "megatron" and m is not None]


def _placeholders(names, module_name: str) -> dict[str, type]:
    from megatron.core.transformer.mlp import MLP

    made: dict[str, type] = {}

    def make(name: str) -> type:
        if name not in made:
            base = PLACEHOLDER_BASES.get(name)
            bases = () if base is None else (MLP,) if base == "MLP" else (make(base),)
            made[name] = type(name, bases, {"__module__": module_name})
        return made[name]

    for name in names:
        make(name)
    return made


@contextlib.contextmanager
def te_spec_placeholders() -> Iterator[dict[str, list[str]]]:
    """Within: TE layer specs build on CPU (T1-T4 above). Yields {module name: names rebound in it}."""
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.utils as mcore_utils

    if te_ext.HAVE_TE:  # the real classes are there
        yield {}
        return
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from packaging.version import Version

    originals = {n: v for n, v in vars(te_ext).items() if n.startswith("TE") and _left_out(v)}
    placeholders = _placeholders(originals, te_ext.__name__)
    saved: list[tuple[object, str, object]] = []  # (module, name, previous value)
    rebound: dict[str, list[str]] = {}

    def rebind(module, name, value) -> None:
        saved.append((module, name, vars(module).get(name, _MISSING)))
        setattr(module, name, value)
        rebound.setdefault(module.__name__, []).append(name)

    namespaces = {name: dict(vars(importlib.import_module(name))) for name in BUILT_AT_IMPORT}
    saved_version = mcore_utils._te_version
    try:
        for module in _megatron_modules():
            for name, original in originals.items():
                if vars(module).get(name, _MISSING) is original:
                    rebind(module, name, placeholders[name])
            if "TESpecProvider" in vars(module) and vars(module)["TESpecProvider"] is None:
                rebind(module, "TESpecProvider", TESpecProvider)
        rebind(te_ext, "HAVE_TE", True)
        mcore_utils._te_version = Version(TE_VERSION)
        for name in BUILT_AT_IMPORT:
            importlib.reload(sys.modules[name])
        yield rebound
    finally:
        mcore_utils._te_version = saved_version
        for module, name, value in reversed(saved):
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)
        for name, namespace in namespaces.items():
            module_vars = vars(sys.modules[name])
            module_vars.clear()
            module_vars.update(namespace)
