"""No string literal of a choice outside its enum module (:mod:`megatron_2d.layout.choices`) and the argument parsers:
the library compares, dispatches, keys and defaults on the enums' members (issue 44, item 2).

The scan reads the source with ``ast`` and looks where a literal acts as a choice: a comparison (``==``, ``!=``,
``in`` / ``not in`` a tuple, list or set of literals), a dict key, a default argument, a ``getattr`` name, a call's
argument and an assignment's value (a class attribute such as a kernel's ``name``).
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
    "testing/",  # the reference and test helpers a user imports (their literals are test inputs)
)
"""Paths (relative to the package; a trailing / is a folder) the scan skips."""

OTHER_MEANINGS: dict[str, frozenset[str]] = {
    "kernels/pieces.py": frozenset({"full"}),  # a piece's mask (full, causal, anti), not a recompute mode
    "kernels/piece_kernel.py": frozenset({"full"}),  # the same masks
    "layout/topology.py": frozenset({"a2a"}),  # the head group's all-to-all path of send_peers, not a plan kind
    "layout/zero_sharding.py": frozenset({"none"}),  # Hybrid ZeRO's sharded states, not a recompute mode
    "megatron/attention_settings.py": frozenset({"local", "none", "full"}),  # Megatron's CUDA graph settings
    "megatron/checkpoint_plus.py": frozenset({"full"}),  # Megatron's --recompute-granularity
    "megatron/mla.py": frozenset({"selective"}),  # Megatron's --recompute-granularity
    "megatron/core_attention.py": frozenset({"latent"}),  # a tensor's name in an error message, not an MLA ring
    # the planner's traffic kinds (links.TRAFFIC_KINDS) and a layout's link paths ("a2a", "inner", "outer")
    "plan/attention_time.py": frozenset({"p2p", "a2a"}),
    "plan/hybrid.py": frozenset({"a2a"}),
    "plan/link_classes.py": frozenset({"a2a"}),
    "plan/links.py": frozenset({"p2p", "a2a"}),
    "plan/memory_options.py": frozenset({"a2a"}),
    "plan/planner.py": frozenset({"a2a"}),
    "plan/report.py": frozenset({"a2a"}),
    "plan/console.py": frozenset({"full", "none"}),  # a sliding window given as "full" / "none" (no window)
    "plan/grid.py": frozenset({"2d", "none"}),  # the grid's outcome labels (2d / stock / tie ... / none)
    "plan/paper.py": frozenset({"none"}),  # a table cell where no plan fits
}
"""module path -> strings that are a choice's string with another meaning there."""

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
    enum_members = {  # the members of enums defined here (a StrEnum of another concern may share a string)
        id(statement)
        for sub in ast.walk(node)
        if isinstance(sub, ast.ClassDef) and any(ast.unparse(base).endswith("Enum") for base in sub.bases)
        for statement in sub.body
    }

    listed = set()  # the literal collections of membership tests, noted once as such

    def note(expr: ast.AST, where: str) -> None:
        if isinstance(expr, ast.IfExp):  # a if c else b
            note(expr.body, where)
            note(expr.orelse, where)
            return
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
                    listed.add(id(right))
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
        elif isinstance(sub, ast.Call):
            if getattr(sub.func, "id", None) in ("getattr", "setattr", "hasattr") and len(sub.args) >= 2:
                note(sub.args[1], f"{sub.func.id} name")
            else:
                for argument in [*sub.args, *(keyword.value for keyword in sub.keywords)]:
                    note(argument, "call argument")
        elif isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub.value is not None and id(sub) not in enum_members:
            note(sub.value, "assignment")
        elif isinstance(sub, ast.Return) and sub.value is not None:
            note(sub.value, "return value")
        elif isinstance(sub, (ast.Tuple, ast.List, ast.Set)) and id(sub) not in listed and all(map(_string, sub.elts)):
            for element in sub.elts:
                note(element, "list of names")
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
        ("x = f(mode='documents')\n", "call argument 'documents'"),
        ("class K:\n    name = 'torch_math'\n", "assignment 'torch_math'"),
        ("def f(x):\n    return 'local' if x else None\n", "return value 'local'"),
        ("ORDER = ('te_fused', 'other')\n", "list of names 'te_fused'"),
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
        "class Kind(StrEnum):\n    LOCAL = 'local'\n"
    )
    (tmp_path / "module.py").write_text(source)
    assert choice_literals(tmp_path, ()) == []
