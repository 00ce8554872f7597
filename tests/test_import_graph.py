"""The package's import graph, read from the source with ``ast``: no module imports itself through others (lazy
imports inside functions count; imports under ``if TYPE_CHECKING:`` do not run and are left out), and the planner
(megatron_2d.plan) imports nothing from the benchmarks, the test support or the Megatron integration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_2d

PACKAGE = Path(megatron_2d.__file__).parent
NAME = PACKAGE.name
PLAN_MAY_NOT_IMPORT = ("megatron_2d.bench", "megatron_2d.testing", "megatron_2d.megatron")


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, packages as their __init__.py."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth (functions, classes, try blocks), except under TYPE_CHECKING."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: dict[str, Path], package: str = NAME) -> set[str]:
    """The package's modules that ``name`` imports: ``from .x import y`` is module x.y when that is a module, else
    x; ``import a.b.c`` is the longest known prefix."""
    is_package = path.name == "__init__.py"

    def known_prefix(dotted: str) -> str:
        while dotted not in known and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_package else 0))]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        out.update(known_prefix(t) for t in targets if t == package or t.startswith(package + "."))
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "megatron_2d.plan.cli" in graph["megatron_2d.plan.__main__"]
    loops = cycles(graph)
    assert not loops, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in loops
    )


def test_plan_imports_no_bench_testing_or_megatron():
    bad = {
        (m, t)
        for m, targets in import_graph().items()
        if m.startswith("megatron_2d.plan")
        for t in targets
        if t.startswith(PLAN_MAY_NOT_IMPORT)
    }
    assert not bad, f"the planner must stand alone; it imports: {sorted(bad)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        # a lazy import inside a function closes a loop
        ({"a": "from . import b\n", "b": "def f():\n    from .a import x\n"}, [["pkg.a", "pkg.b"]]),
        # a loop through three modules, by absolute imports
        (
            {"a": "import pkg.b\n", "b": "from pkg.c import y\n", "c": "import pkg.a as a\n"},
            [["pkg.a", "pkg.b", "pkg.c"]],
        ),
        # imports for type checking only do not run: no loop
        (
            {
                "a": "from .b import B\n",
                "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
            },
            [],
        ),
    ],
)
def test_the_walker_finds_loops(tmp_path, source, expected):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in source.items():
        (pkg / f"{name}.py").write_text(text)
    known = modules(pkg)
    graph = {name: imports_of(name, path, known, "pkg") for name, path in known.items()}
    assert cycles(graph) == expected


def private_imports(root: Path = PACKAGE, package: str = NAME) -> list[str]:
    """``module: from source import _name`` for every private name (one leading underscore) a module of the package
    takes from another of its modules."""
    found = []
    for name, path in modules(root).items():
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not (node.level or (node.module or "").split(".")[0] == package):
                continue
            found += [
                f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_private_names_cross_modules():
    assert private_imports() == []


def test_the_private_import_check_can_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def _helper():\n    pass\n")
    (package / "b.py").write_text("from .a import _helper\nfrom pkg.a import __doc__\n")
    assert private_imports(package, "pkg") == ["pkg.b: from .a import _helper"]


def test_public_names_come_from_this_package():
    """Every ``megatron_2d.<name>`` resolves to a module of this package (a stale entry of the lazy export table
    would fail, or, with an editable install of another checkout on the path, quietly load that checkout's code)."""
    import importlib

    for name in megatron_2d.__all__:
        module = importlib.import_module(f"megatron_2d.{megatron_2d._EXPORTS[name]}")
        assert Path(module.__file__).resolve().is_relative_to(PACKAGE.resolve()), (name, module.__file__)
        assert getattr(megatron_2d, name) is getattr(module, name)


@pytest.mark.slow
def test_the_op_never_loads_the_planner():
    """A documents-mode sharding built without a cost (what ``PackedLayout(mode="documents")`` and the Megatron data
    path build) takes its default figures from the pure layer: no module of megatron_2d.plan is loaded (the
    planner's __init__ loads 17), and the default is the planner's 8xH100 preset on the kernel 2D selects there,
    figure for figure."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from megatron_2d.packing.sharding import default_cost, shard_documents\n"
        "shard_documents(np.array([0, 5, 900, 1000]), 4, 2)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('megatron_2d.plan'))\n"
        "assert not loaded, loaded\n"
        "from megatron_2d.packing.sharding import PackingCost\n"
        "from megatron_2d.plan.hardware import get_cluster\n"
        "from megatron_2d.plan.kernel_rates import SELECTED_KERNEL\n"
        "h = get_cluster('8xH100')\n"
        "rate = h.peak_tflops * h.kernel_efficiency(SELECTED_KERNEL[h.arch])\n"
        "assert default_cost() == PackingCost.from_hardware(rate, h.nvlink_gbps)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
