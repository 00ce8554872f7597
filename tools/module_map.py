#!/usr/bin/env python
"""Print the module map of megatron_2d/ and dev/megatron_2d_dev/ as a markdown table: module, first docstring line,
line count.

    python tools/module_map.py                 # the table in docs/architecture.md
    python tools/module_map.py --root DIR      # another checkout's megatron_2d/

Reads the source files only (ast), so it needs neither torch nor megatron-core. Modules are listed package by
package (the top-level package first), each package's __init__.py before its other modules; the library first,
then the development distribution (dev/, never shipped).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_2d"
PACKAGES = (PACKAGE, "dev/megatron_2d_dev")  # folders relative to the repository root: the library, the dev tools


class Module(NamedTuple):
    name: str  # dotted, e.g. megatron_2d.plan.cli
    path: str  # relative to the repository root, e.g. megatron_2d/plan/cli.py
    summary: str  # first line of the module docstring ("" when it has none)
    lines: int


def first_docstring_line(source: str) -> str:
    """The first non-empty line of the module docstring of ``source`` ("" when there is none)."""
    try:
        doc = ast.get_docstring(ast.parse(source))
    except SyntaxError:
        return ""
    for line in (doc or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def module_name(path: Path, root: Path) -> str:
    """megatron_2d/plan/cli.py -> megatron_2d.plan.cli; megatron_2d/plan/__init__.py -> megatron_2d.plan."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _order(path: Path, root: Path):
    rel = path.relative_to(root)
    return (len(rel.parts) > 2, rel.parent.as_posix(), rel.name != "__init__.py", rel.name)


def modules(root: Path = REPO) -> list[Module]:
    """Every .py file under ``root``/megatron_2d and ``root``/dev/megatron_2d_dev (when there), in map order."""
    out = []
    for folder in (root / p for p in PACKAGES):
        out += _package_modules(folder, root)
    return out


def _package_modules(folder: Path, root: Path) -> list[Module]:
    out = []
    for path in sorted(folder.rglob("*.py"), key=lambda p: _order(p, folder.parent)):
        if "__pycache__" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        out.append(
            Module(
                module_name(path, folder.parent),
                path.relative_to(root).as_posix(),
                first_docstring_line(source),
                len(source.splitlines()),
            )
        )
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(mods: list[Module]) -> str:
    rows = ["| module | concern (first docstring line) | lines |", "|---|---|---:|"]
    rows += [f"| `{m.name}` | {_cell(m.summary)} | {m.lines} |" for m in mods]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository root holding megatron_2d/")
    args = parser.parse_args(argv)
    mods = modules(args.root)
    print(markdown_table(mods))
    print(f"\n{len(mods)} modules, {sum(m.lines for m in mods)} lines.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
