#!/usr/bin/env python
"""Print the module map of megatron_2d/ and dev/megatron_2d_dev/ as a markdown table: module, first docstring line,
line count.

    python tools/module_map.py                 # the table docs/architecture.md holds, on stdout
    python tools/module_map.py --write         # written into docs/architecture.md between its markers
    python tools/module_map.py --root DIR      # another checkout's megatron_2d/

tests/test_docs.py checks that docs/architecture.md holds exactly what ``--write`` writes (line counts included).

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


MAP_START, MAP_END = "<!-- module map: python tools/module_map.py -->", "<!-- end of module map -->"
ARCHITECTURE = Path("docs") / "architecture.md"


def map_block(mods: list[Module]) -> str:
    """The map as docs/architecture.md holds it between its markers: the table and the totals line."""
    return f"{markdown_table(mods)}\n\n{len(mods)} modules, {sum(m.lines for m in mods)} lines.\n"


def with_map(text: str, block: str) -> str:
    """``text`` (docs/architecture.md) with the map between its markers replaced by ``block``."""
    if MAP_START not in text or MAP_END not in text:
        raise ValueError(f"no module map between {MAP_START!r} and {MAP_END!r}")
    head, rest = text.split(MAP_START, 1)
    return f"{head}{MAP_START}\n{block}{MAP_END}{rest.split(MAP_END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository root holding megatron_2d/")
    parser.add_argument("--write", action="store_true", help="write the map into the root's docs/architecture.md")
    args = parser.parse_args(argv)
    block = map_block(modules(args.root))
    if args.write:
        doc = args.root / ARCHITECTURE
        doc.write_text(with_map(doc.read_text(encoding="utf-8"), block), encoding="utf-8")
    else:
        print(block, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
