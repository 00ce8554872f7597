"""The public API is stable: a change to it is a change to tests/public_api.txt and an entry in CHANGELOG.md.

The snapshot holds what users write against: the names megatron_2d and megatron_2d.megatron export and the
signature of each callable (the op's keywords included), the fields of ``TransformerConfig2D`` beyond megatron-core's
``TransformerConfig`` with their defaults, the layer-spec functions, every ``--cp-2d-*`` flag of ``pretrain_gpt.py``
(its choices and default) and every flag of the planner's command line. Changed on purpose: list the change and its
migration under "Unreleased" in CHANGELOG.md, then ``python tests/test_public_api.py --write``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).resolve().parent / "public_api.txt"
SPEC_FUNCTIONS = (
    ("megatron_2d.megatron.spec", "get_gpt_layer_spec_2d"),
    ("megatron_2d.megatron.spec", "gpt_layer_spec_2d"),
    ("megatron_2d.megatron.hybrid_spec", "get_hybrid_stack_spec_2d"),
)


def _signature(obj) -> str:
    if inspect.isclass(obj) and any(base.__name__ == "TransformerConfig" for base in obj.__mro__[1:]):
        return " (a TransformerConfig: its 2D fields are listed as TransformerConfig2D's)"
    target = obj.__init__ if inspect.isclass(obj) and not dataclasses.is_dataclass(obj) else obj
    try:
        return str(inspect.signature(target))
    except (TypeError, ValueError):  # a constant, or a builtin without a signature
        return f"= {obj!r}" if isinstance(obj, (str, int, float, tuple)) else f"<{type(obj).__name__}>"


def _exports(module_name: str) -> list[str]:
    import importlib

    module = importlib.import_module(module_name)
    return [f"{module_name}.{name}{_signature(getattr(module, name))}" for name in sorted(module.__all__)]


def _config_fields() -> list[str]:
    from megatron.core.transformer import TransformerConfig

    from megatron_2d.megatron import TransformerConfig2D

    stock = {f.name for f in dataclasses.fields(TransformerConfig)}
    return [
        f"TransformerConfig2D.{f.name} = {f.default!r}"
        for f in dataclasses.fields(TransformerConfig2D)
        if f.name not in stock
    ]


def _flags(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        if not action.option_strings or action.dest == "help":
            continue
        choices = f" choices={list(action.choices)}" if action.choices else ""
        out.append(f"{prefix} {'/'.join(action.option_strings)} default={action.default!r}{choices}")
    return out


def public_api() -> str:
    """The snapshot's text: one line per public name, field and flag."""
    import importlib

    from megatron_2d.megatron.arguments import add_2d_arguments
    from megatron_2d.plan.cli import build_parser

    lines = _exports("megatron_2d") + _exports("megatron_2d.megatron") + _config_fields()
    for module, name in SPEC_FUNCTIONS:
        lines.append(f"{module}.{name}{_signature(getattr(importlib.import_module(module), name))}")
    lines += _flags(add_2d_arguments(argparse.ArgumentParser(add_help=False)), "pretrain_gpt.py")
    lines += _flags(build_parser(), "python -m megatron_2d.plan")
    return "\n".join(lines) + "\n"


@pytest.mark.megatron
def test_public_api_is_the_recorded_one():
    now, recorded = public_api(), SNAPSHOT.read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), now.splitlines(True), "recorded", "now"))
    assert now == recorded, (
        "the public API changed: list the change and its migration in CHANGELOG.md, then regenerate "
        f"tests/public_api.txt with `python tests/test_public_api.py --write`:\n{diff}"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_public_api.py --write")
    SNAPSHOT.write_text(public_api())
    print(f"wrote {SNAPSHOT}")
