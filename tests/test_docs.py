"""The README and docs/ against the tree: pure and fast (no torch, no ranks).

- every module of megatron_2d/ appears in docs/architecture.md's module map, and the map is exactly what
  ``python tools/module_map.py --write`` writes (docstring lines and line counts included)
- README.md is short (at most 160 lines) and has no line over 120 characters
- every relative link in README.md and docs/*.md points to an existing file
- the tree as docs/architecture.md shows it: every folder of megatron_2d/ and dev/ states its one concern in its
  ``__init__`` docstring and is in the doc's tree; the root holds at most 8 modules; every library file the "Where
  to add" table names exists
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAP_START, MAP_END = "<!-- module map: python tools/module_map.py -->", "<!-- end of module map -->"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _module_map_tool():
    spec = importlib.util.spec_from_file_location("module_map", REPO / "tools" / "module_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules_in_map(text: str) -> set:
    """The module names of the map between its markers: the first cell of each table row, in backticks."""
    if MAP_START not in text or MAP_END not in text:
        raise AssertionError(f"docs/architecture.md has no module map between {MAP_START!r} and {MAP_END!r}")
    table = text.split(MAP_START, 1)[1].split(MAP_END, 1)[0]
    return set(re.findall(r"^\|\s*`([\w.]+)`\s*\|", table, flags=re.M))


def missing_from_map(tree_modules, text: str) -> set:
    return set(tree_modules) - modules_in_map(text)


def test_every_module_of_the_tree_is_in_the_architecture_map():
    tree = {m.name for m in _module_map_tool().modules(REPO)}
    assert "megatron_2d.attention" in tree and "megatron_2d.plan.cli" in tree
    text = ARCHITECTURE.read_text(encoding="utf-8")
    missing, stale = tree - modules_in_map(text), modules_in_map(text) - tree
    assert not missing and not stale, (
        f"docs/architecture.md's module map is out of date (regenerate it with python tools/module_map.py): "
        f"missing {sorted(missing)}, no longer in the tree {sorted(stale)}"
    )


def test_the_architecture_map_is_the_generated_one():
    tools = _module_map_tool()
    text = ARCHITECTURE.read_text(encoding="utf-8")
    generated = tools.with_map(text, tools.map_block(tools.modules(REPO)))
    assert text == generated, (
        "docs/architecture.md's module map differs from the tree (docstring lines or line counts): regenerate it "
        "with `python tools/module_map.py --write`"
    )


def test_the_map_check_fails_when_a_module_is_left_out():
    tools = _module_map_tool()
    mods = tools.modules(REPO)
    full = f"{MAP_START}\n{tools.markdown_table(mods)}\n{MAP_END}"
    assert not missing_from_map([m.name for m in mods], full)
    dropped = [m for m in mods if m.name != "megatron_2d.attention"]
    partial = f"{MAP_START}\n{tools.markdown_table(dropped)}\n{MAP_END}"
    assert missing_from_map([m.name for m in mods], partial) == {"megatron_2d.attention"}


def test_module_map_reads_docstrings_without_importing(tmp_path):
    pkg = tmp_path / "megatron_2d" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "megatron_2d" / "__init__.py").write_text('"""Top.\n\nMore."""\nimport torch_not_installed\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "thing.py").write_text('\n"""\n  First line | with a pipe.\nsecond\n"""\nx = 1\n')
    mods = _module_map_tool().modules(tmp_path)
    assert [(m.name, m.summary, m.lines) for m in mods] == [
        ("megatron_2d", "Top.", 4),
        ("megatron_2d.sub", "", 0),
        ("megatron_2d.sub.thing", "First line | with a pipe.", 6),
    ]
    assert "First line \\| with a pipe." in _module_map_tool().markdown_table(mods)


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; keep it at most 160 and move detail to docs/"


def test_no_readme_line_over_120_characters():
    long = [
        (i, len(line))
        for i, line in enumerate((REPO / "README.md").read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def _markdown_files():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_to_existing_files(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, in-page anchors
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)}: links to missing files: {broken}"


CONFLICT_MARKER = re.compile(r"^(<<<<<<<|>>>>>>>) ", re.M)


def conflict_markers(text: str) -> list[int]:
    """Line numbers of merge-conflict markers left in ``text``."""
    return [text.count("\n", 0, m.start()) + 1 for m in CONFLICT_MARKER.finditer(text)]


def test_no_merge_conflict_markers_left_in_the_tree():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = {}
    for name in tracked:
        path = REPO / name
        if path.suffix in {".py", ".md", ".toml", ".txt", ".sh", ".patch", ".cfg"} and path.is_file():
            lines = conflict_markers(path.read_text(encoding="utf-8", errors="replace"))
            if lines:
                found[name] = lines
    assert not found, f"merge-conflict markers left in: {found}"


def test_the_conflict_check_finds_markers():
    assert conflict_markers("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\n") == [2, 6]


PACKAGE = REPO / "megatron_2d"
DEV_PACKAGE = REPO / "dev" / "megatron_2d_dev"  # the development distribution, never shipped


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_every_folder_states_its_concern_and_is_in_the_tree():
    tree = _section(ARCHITECTURE.read_text(), "The tree")
    folders = sorted({p.parent for root in (PACKAGE, DEV_PACKAGE) for p in root.rglob("*.py")} - {PACKAGE})
    assert len(folders) >= 8, folders
    for folder in folders:
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.relative_to(REPO)} has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(REPO)} states no concern"
        assert re.search(rf"^\s+{folder.name}/\s", tree, re.M), f"{folder.name}/ is not in the architecture tree"


def test_the_root_holds_at_most_8_modules():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 8, modules


def test_the_where_to_add_table_names_existing_files():
    table = _section(ARCHITECTURE.read_text(), "Where to add")
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", table))
    assert {"packing/modes.py", "layout/transports.py", "kernels/__init__.py", "megatron/fields.py"} <= named
    missing = [n for n in sorted(named) if not ((PACKAGE / n).exists() or (REPO / n).exists())]
    assert not missing, f"the Where to add table names files that do not exist: {missing}"
