"""No string literal of a choice outside its enum module (:mod:`megatron_2d.layout.choices`) and the argument parsers:
the library compares, dispatches, keys and defaults on the enums' members (issue 44, item 2).

The scan reads the source with ``ast`` and looks where a literal acts as a choice: a comparison (``==``, ``!=``,
``in`` / ``not in`` a tuple, list or set of literals), a dict key, a default argument and a ``getattr`` name.
Docstrings and messages are prose, not choices, and are not read. A choice's string may mean something else in a
module (a mask called "full", a traffic kind "p2p"): such a use is listed in :data:`OTHER_MEANINGS`, with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_2d
from megatron_2d.layout import choices

PACKAGE = Path(megatron_2d.__file__).parent

EXCLUDED = (
    "layout/choices.py",  # the enums themselves
    "megatron/arguments.py",  # the argument parsers (flags keep taking the strings)
    "testing/",  # test machinery and benchmarks (moving out of the package)
    "bench/",
    # being rewritten in parallel (issue 44: the op's options, the planner); the merge shrinks this tuple
    "attention.py",
    "latent_attention.py",
    "groups.py",
    "kept_forward.py",
    "megatron/core_attention.py",
    "megatron/process_groups.py",
    "plan/",
)
"""Paths (relative to the package; a trailing / is a folder) the scan skips."""

OTHER_MEANINGS: dict[str, frozenset[str]] = {}
"""module path -> strings that are a choice's string with another meaning there (none at present)."""

CHOICE_ENUMS = tuple(
    value
    for value in vars(choices).values()
    if isinstance(value, type) and issubclass(value, choices.StrEnum) and value is not choices.StrEnum
)
CHOICE_STRINGS = frozenset(member.value for enum in CHOICE_ENUMS for member in enum)


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _choice_literals(node: ast.AST) -> list[tuple[int, str, str]]:
    """(line, string, where) for each choice literal in a choice position under ``node``."""
    found = []

    def note(expr: ast.AST, where: str) -> None:
        text = _string(expr)
        if text in CHOICE_STRINGS:
            found.append((expr.lineno, text, where))

    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            for op, left, right in zip(sub.ops, [sub.left, *sub.comparators], sub.comparators):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    note(left, "comparison")
                    note(right, "comparison")
                elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                    for element in right.elts:
                        note(element, "membership")
        elif isinstance(sub, ast.Dict):
            for key in sub.keys:
                if key is not None:
                    note(key, "dict key")
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for default in [*sub.args.defaults, *sub.args.kw_defaults]:
                if default is not None:
                    note(default, "default argument")
        elif isinstance(sub, ast.Call) and getattr(sub.func, "id", None) in ("getattr", "setattr", "hasattr"):
            if len(sub.args) >= 2:
                note(sub.args[1], f"{sub.func.id} name")
    return found


def scanned_modules(root: Path = PACKAGE, excluded: tuple[str, ...] = EXCLUDED) -> list[Path]:
    def skipped(relative: str) -> bool:
        return any(relative.startswith(e) if e.endswith("/") else relative == e for e in excluded)

    return [path for path in sorted(root.rglob("*.py")) if not skipped(path.relative_to(root).as_posix())]


def choice_literals(root: Path = PACKAGE, excluded: tuple[str, ...] = EXCLUDED) -> list[str]:
    """'path:line: where "string"' for every choice literal in the scanned modules."""
    out = []
    for path in scanned_modules(root, excluded):
        relative = path.relative_to(root).as_posix()
        allowed = OTHER_MEANINGS.get(relative, frozenset())
        for line, text, where in _choice_literals(ast.parse(path.read_text(), str(path))):
            if text not in allowed:
                out.append(f"{relative}:{line}: {where} {text!r}")
    return out


def test_the_choice_strings_are_the_enums_members():
    assert {"head_first", "zigzag", "accumulator", "latent", "bitwise", "cpu_flash", "outputs"} <= CHOICE_STRINGS
    assert {"double_ring", "2d", "ckpt++"} <= CHOICE_STRINGS


def test_no_choice_is_a_string_literal_outside_its_enum_module():
    found = choice_literals()
    assert not found, "use the enum member (megatron_2d.layout.choices) instead of:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("if placement == 'head_first':\n    pass\n", "comparison 'head_first'"),
        ("ok = kind in ('local', 'other')\n", "membership 'local'"),
        ("TABLE = {'zigzag': 1}\n", "dict key 'zigzag'"),
        ("def f(dtype='accumulator'):\n    pass\n", "default argument 'accumulator'"),
        ("def f(*, ring='latent'):\n    pass\n", "default argument 'latent'"),
        ("x = getattr(obj, 'cpu_flash')\n", "getattr name 'cpu_flash'"),
    ],
)
def test_the_scan_finds_each_kind_of_choice_literal(tmp_path, source, expected):
    (tmp_path / "module.py").write_text(source)
    assert [f.split(": ", 1)[1] for f in choice_literals(tmp_path, ())] == [expected]


def test_the_scan_reads_no_prose(tmp_path):
    """Docstrings, messages and strings that are not choices are not flagged."""
    source = (
        'def f(x):\n    """head_first or context_first."""\n'
        "    if x == 'tokens':\n        raise ValueError('zigzag is not one of ...')\n"
        "    return x in ('a', 'b')\n"
    )
    (tmp_path / "module.py").write_text(source)
    assert choice_literals(tmp_path, ()) == []
