"""The package's import graph, read from the source with ``ast``, and the house's import rules over it. Each rule
has a test on a synthetic package that shows it can fail.

- **No cycle.** Lazy imports inside functions count, and so do imports under ``if TYPE_CHECKING:`` (a loop a type
  checker follows ties the modules together as much as one that runs). Importing ``pkg.sub.mod`` runs
  ``pkg/__init__`` and ``pkg/sub/__init__`` first, so it is an edge to those packages too, except the importer's own
  enclosing packages (already run when it runs). A package's lazy export table (``_EXPORTS``, resolved by its
  ``__getattr__``) is an edge to each module it names, and a module that scans its folder (``pkgutil.iter_modules``,
  as transport/kinds.py does) has an edge to each module there.
- **The pure layer** (``layout/``, ``packing/``) imports from the package only the pure layer, and, itself or
  through any package module it reaches, only the standard library (``packing/``: and numpy): no torch, and no
  library that loads it (megatron-core).
- **The planner** (``plan/``) imports from the package only the pure layer and itself, and no torch library.
- **The runtime** (every module of ``megatron_2d`` but its test support, ``megatron_2d.testing``) imports neither
  the test support nor the development distribution, ``megatron_2d_dev`` (dev/: stand-ins, harnesses, demo,
  gpu-check, benchmarks); **the test support** imports the runtime only, never ``megatron_2d_dev``.
- **No cycle between folders of the test machinery**: collapsing every module to its folder (package), no loop
  passes through ``megatron_2d.testing`` or a folder of ``megatron_2d_dev`` (the demo and gpu-check once imported
  ``bench/`` while ``bench/`` imported ``testing/``).

The graph spans both packages of the repository (the library and the development distribution), so a cycle or a
private import across them counts.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

import pytest

import megatron_2d
import megatron_2d_dev

PACKAGE = Path(megatron_2d.__file__).parent
NAME = PACKAGE.name
DEV_PACKAGE = Path(megatron_2d_dev.__file__).parent
DEV = DEV_PACKAGE.name
TEST_SUPPORT_PACKAGE = f"{NAME}.testing"  # what a user may import to test with the library: the wheel ships it
STDLIB = frozenset(sys.stdlib_module_names)
# folder of the pure layer -> the libraries it may import
PURE = {"layout": STDLIB, "packing": STDLIB | {"numpy"}}
PLANNER = "plan"
TEST_SUPPORT = ("testing", "bench")  # folders of a synthetic package's test support (the rules' own tests)
# libraries that are torch or import it: the planner's "no torch"
TORCH_LIBRARIES = frozenset({"torch", "megatron", "transformer_engine", "flash_attn", "triton", "apex"})


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, packages as their __init__.py."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth (functions, classes, try blocks, ``if TYPE_CHECKING:``)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _lazy_exports(tree: ast.Module) -> list[str]:
    """The module names (relative to the package) of a top-level ``_EXPORTS = {"name": "module", ...}`` table."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _scans_its_folder(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == "iter_modules" or getattr(node.func, "id", None) == "iter_modules")
        for node in ast.walk(tree)
    )


def imports_of(name: str, path: Path, known: dict[str, Path], package: str | tuple[str, ...] = NAME) -> set[str]:
    """The package's modules that importing ``name`` runs: ``from .x import y`` is module x.y when that is a module,
    else x; ``import a.b.c`` is the longest known prefix; each target's enclosing packages come with it, except
    those enclosing ``name`` itself."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))

    def known_prefix(dotted: str) -> str:
        while dotted not in known and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    targets = [f"{name}.{m}" for m in _lazy_exports(tree)] if is_package else []
    if _scans_its_folder(tree):
        folder = name if is_package else name.rsplit(".", 1)[0]
        targets += [m for m in known if m.rsplit(".", 1)[0] == folder]
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_package else 0))]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets += [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    out = set()
    packages = (package,) if isinstance(package, str) else package
    for target in (known_prefix(t) for t in targets if any(_within(t, p) for p in packages)):
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if not _within(name, ".".join(parts[:i])))
        out.add(target)
    out.discard(name)
    return out


def libraries_of(path: Path, package: str = NAME) -> set[str]:
    """The top-level names of what a module imports from outside the package (``numpy``, ``torch``, ``math``)."""
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif not node.level and node.module:
            out.add(node.module.split(".")[0])
    out.discard(package)
    return out


def import_graph(root: Path = PACKAGE, package: str = NAME) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known, package) for name, path in known.items()}


def library_imports(root: Path = PACKAGE, package: str = NAME) -> dict[str, set[str]]:
    return {name: libraries_of(path, package) for name, path in modules(root).items()}


def tree_graph(roots: tuple[Path, ...] = (PACKAGE, DEV_PACKAGE)) -> dict[str, set[str]]:
    """The import graph of several packages together (the library and the development distribution): an import
    from one into another is an edge."""
    known = {name: path for root in roots for name, path in modules(root).items()}
    packages = tuple(root.name for root in roots)
    return {name: imports_of(name, path, known, packages) for name, path in known.items()}


def folder_of(name: str, graph: dict[str, set[str]]) -> str:
    """A module's folder (package): itself for a package, its parent for a module."""
    return name if any(_within(other, name) and other != name for other in graph) else name.rsplit(".", 1)[0]


def folder_cycles(graph: dict[str, set[str]], among: tuple[str, ...]) -> list[list[str]]:
    """The cycles of the folder graph (each module collapsed to its folder) that pass through a folder within
    ``among``."""
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        here = folder_of(name, graph)
        folders.setdefault(here, set()).update(f for f in (folder_of(t, graph) for t in targets) if f != here)
    return [c for c in cycles(folders) if any(_within(f, p) for f in c for p in among)]


def forbidden_imports(
    graph: dict[str, set[str]], importers: tuple[str, ...], imported: tuple[str, ...], excepted: tuple[str, ...] = ()
) -> list[str]:
    """``a imports b`` for every module a within ``importers`` (and not within ``excepted``) that imports a module b
    within ``imported``."""
    return [
        f"{name} imports {t}"
        for name in sorted(graph)
        if any(_within(name, p) for p in importers) and not any(_within(name, p) for p in excepted)
        for t in sorted(graph[name])
        if any(_within(t, p) for p in imported)
    ]


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


def _reached(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` reaches (itself included) -> the chain of imports that reaches it first."""
    chains = {start: [start]}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in chains:
                chains[w] = chains[v] + [w]
                queue.append(w)
    return chains


def pure_layer_violations(graph: dict[str, set[str]], libraries: dict[str, set[str]], package: str = NAME) -> list[str]:
    """What the pure layer imports against its rule: a package module outside it, or a library its folder may not
    import, by the module itself or by any package module it reaches (with the chain that reaches it)."""
    pure = [f"{package}.{folder}" for folder in PURE]
    found = []
    for name in sorted(graph):
        folder = next((f for f in PURE if _within(name, f"{package}.{f}")), None)
        if folder is None:
            continue
        found += [
            f"{name} imports {t} (not in the pure layer)"
            for t in sorted(graph[name])
            if not any(_within(t, p) for p in pure)
        ]
        for reached, chain in sorted(_reached(graph, name).items()):
            found += [
                f"{' -> '.join(chain)} imports {lib}"
                for lib in sorted(libraries.get(reached, ()))
                if lib not in PURE[folder]
            ]
    return found


def planner_violations(graph: dict[str, set[str]], libraries: dict[str, set[str]], package: str = NAME) -> list[str]:
    """What the planner imports against its rule: a package module outside the pure layer and itself, or torch."""
    allowed = [f"{package}.{f}" for f in (*PURE, PLANNER)]
    found = []
    for name in sorted(m for m in graph if _within(m, f"{package}.{PLANNER}")):
        found += [f"{name} imports {t}" for t in sorted(graph[name]) if not any(_within(t, p) for p in allowed)]
        found += [f"{name} imports {lib}" for lib in sorted(libraries.get(name, set()) & TORCH_LIBRARIES)]
    return found


def runtime_violations(graph: dict[str, set[str]], package: str = NAME) -> list[str]:
    """Runtime modules of a synthetic package (all but its ``testing/`` and ``bench/``) that import those."""
    support = tuple(f"{package}.{f}" for f in TEST_SUPPORT)
    return forbidden_imports(graph, (package,), support, excepted=support)


def library_violations(graph: dict[str, set[str]], package: str = NAME, dev: str = DEV) -> list[str]:
    """The runtime (the package but its test support) importing the test support or the development distribution,
    and the test support importing the development distribution."""
    support = f"{package}.testing"
    return forbidden_imports(graph, (package,), (support, dev), excepted=(support,)) + forbidden_imports(
        graph, (support,), (dev,)
    )


def test_no_import_cycles():
    graph = tree_graph()
    assert "megatron_2d_dev.demo" in graph  # both packages
    assert len(graph) > 50 and "megatron_2d.plan.cli" in graph["megatron_2d.plan.__main__"]
    loops = cycles(graph)
    assert not loops, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in loops
    )


def test_the_issue_cycles_are_gone():
    """The two cycles issue 31 named, by their edges today: the document sharding reaches no planner module, and
    the planner's step no longer reaches its memory options, which import it (plan/model_states.py holds the types
    the step needs back)."""
    graph = import_graph()
    reached = _reached(graph, "megatron_2d.packing.sharding")
    assert not [m for m in reached if _within(m, "megatron_2d.plan")], reached
    assert "megatron_2d.plan.step" in graph["megatron_2d.plan.memory_options"]
    assert "megatron_2d.plan.memory_options" not in _reached(graph, "megatron_2d.plan.step")


def test_the_pure_layer_imports_no_torch():
    graph = import_graph()
    assert {"megatron_2d.layout.topology", "megatron_2d.packing.modes"} <= set(graph)
    assert pure_layer_violations(graph, library_imports()) == []


def test_the_planner_imports_only_the_pure_layer():
    assert planner_violations(import_graph(), library_imports()) == []


def test_the_runtime_imports_no_test_support():
    """The runtime imports neither megatron_2d.testing nor megatron_2d_dev; megatron_2d.testing imports no
    megatron_2d_dev (the wheel ships it: tests/test_wheel.py)."""
    graph = tree_graph()
    assert "megatron_2d.testing.reference" in graph and "megatron_2d_dev.bench.compare" in graph
    assert library_violations(graph) == []


def test_no_cycle_between_the_test_machinerys_folders():
    graph = tree_graph()
    assert folder_cycles(graph, (TEST_SUPPORT_PACKAGE, DEV)) == []


def _write_tree(root: Path, library: dict[str, str], dev: dict[str, str]) -> tuple[Path, Path]:
    """A synthetic library ``pkg`` and development distribution ``pkg_dev`` side by side."""
    return _write_package(root / "lib", library), _write_package(root / "dev", dev, "pkg_dev")


@pytest.mark.parametrize(
    "library, dev, expected",
    [
        # the dev package uses the library and its test support: allowed
        (
            {"testing.reference": "from ..groups import g\n", "groups": ""},
            {"demo": "from pkg.testing import reference\n"},
            [],
        ),
        # the runtime reaching the dev package, lazily
        (
            {"megatron.spec": "def f():\n    from pkg_dev.stand_in import x\n"},
            {"stand_in": ""},
            ["pkg.megatron.spec imports pkg_dev", "pkg.megatron.spec imports pkg_dev.stand_in"],
        ),
        # the runtime reaching the test support
        (
            {"attention": "from .testing import reference\n", "testing.reference": ""},
            {},
            ["pkg.attention imports pkg.testing", "pkg.attention imports pkg.testing.reference"],
        ),  # fmt: skip
        # the shipped test support reaching the dev package
        (
            {"testing.reference": "from pkg_dev import stand_in\n"},
            {"stand_in": ""},
            ["pkg.testing.reference imports pkg_dev", "pkg.testing.reference imports pkg_dev.stand_in"],
        ),
    ],
)
def test_the_library_rule_can_fail(tmp_path, library, dev, expected):
    roots = _write_tree(tmp_path, library, dev)
    assert library_violations(tree_graph(roots), "pkg", "pkg_dev") == expected


def test_the_folder_cycle_rule_can_fail(tmp_path):
    """The cycle issue 44 named: the demo imports the benchmarks' table, the benchmarks import a stand-in beside
    the demo. No module loop, a folder loop; moving the table up to the demo's folder breaks it."""
    dev = {
        "demo": "from .bench.cli import table\n",
        "stand_in": "",
        "bench.cli": "",
        "bench.runners": "from .. import stand_in\n",
    }
    graph = tree_graph(_write_tree(tmp_path / "a", {}, dev))
    assert cycles(graph) == [] and folder_cycles(graph, ("pkg_dev",)) == [["pkg_dev", "pkg_dev.bench"]]
    dev = {**dev, "demo": "from .cli import table\n", "cli": ""}
    assert folder_cycles(tree_graph(_write_tree(tmp_path / "b", {}, dev)), ("pkg_dev",)) == []


def test_the_pure_layer_loads_no_torch_when_imported():
    """The same rule as the process sees it: importing every module of the pure layer loads no torch, no
    megatron-core and no package module outside the pure layer (the package root's lazy exports stay unloaded)."""
    import subprocess

    pure = sorted(m for m in modules() if any(_within(m, f"{NAME}.{f}") for f in PURE))
    code = (
        "import importlib, sys\n"
        f"for m in {pure!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron') or (m.startswith("
        "'megatron_2d.') and not m.startswith(('megatron_2d.layout', 'megatron_2d.packing'))))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _write_package(root: Path, source: dict[str, str], package: str = "pkg") -> Path:
    """A package under ``root`` from {dotted module: text}; every folder gets an (empty unless given) __init__."""
    top = root / package
    for name, text in {"": "", **source}.items():
        parts = name.split(".") if name else []
        folder = top.joinpath(*parts)
        is_package = not parts or any(other.startswith(name + ".") for other in source)
        path = folder / "__init__.py" if is_package else folder.with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for i in range(len(parts)):  # enclosing folders are packages
            init = top.joinpath(*parts[:i]) / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(text)
    return top


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
        # imports for type checking count: a loop
        (
            {
                "a": "from .b import B\n",
                "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
            },
            [["pkg.a", "pkg.b"]],
        ),
        # importing a submodule runs its package's __init__ first: the issue's sharding -> plan -> plan.packed ->
        # sharding, where the sharding imported plan.hardware and plan/__init__ imported plan.packed
        (
            {
                "sharding": "def cost():\n    from .plan.hardware import get\n",
                "plan": "from .packed import P\n",
                "plan.hardware": "",
                "plan.packed": "from ..sharding import shard\n",
            },
            [["pkg.plan", "pkg.plan.packed", "pkg.sharding"]],
        ),
        # a package's lazy export table names modules it imports on first use
        ({"": '_EXPORTS = {"f": "a"}\n', "a": "import pkg\n"}, [["pkg", "pkg.a"]]),
        # a module that scans its folder imports every module there
        (
            {
                "sub": "",
                "sub.kinds": "import pkgutil\npkgutil.iter_modules([])\n",
                "sub.a": "from pkg import b\n",
                "b": "from .sub.kinds import table\n",
            },
            [["pkg.b", "pkg.sub.a", "pkg.sub.kinds"]],
        ),  # fmt: skip
        # ... but a module's own enclosing packages have run before it: siblings importing siblings is no loop
        ({"sub": "from .a import x\n", "sub.a": "from pkg.sub.b import y\n", "sub.b": ""}, []),
    ],
)
def test_the_walker_finds_loops(tmp_path, source, expected):
    root = _write_package(tmp_path, source)
    assert cycles(import_graph(root, "pkg")) == expected


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"layout.a": "import torch\n"}, ["pkg.layout.a imports torch"]),
        ({"layout.a": "def f():\n    from megatron.core import x\n"}, ["pkg.layout.a imports megatron"]),
        ({"layout.a": "import numpy\n"}, ["pkg.layout.a imports numpy"]),
        ({"packing.a": "import numpy as np\nimport math\n", "layout.a": "from dataclasses import field\n"}, []),
        # through another module of the pure layer, with the chain that reaches it
        (
            {"packing.a": "from ..layout import b\n", "layout.b": "import torch.nn\n"},
            ["pkg.layout.b imports torch", "pkg.packing.a -> pkg.layout.b imports torch"],
        ),
        # through a runtime module: it leaves the pure layer, and it brings torch
        (
            {"packing.a": "from pkg.groups import G\n", "groups": "import torch\n"},
            ["pkg.packing.a imports pkg.groups (not in the pure layer)", "pkg.packing.a -> pkg.groups imports torch"],
        ),
        # the package root (its lazy exports) is outside the pure layer too
        ({"layout.a": "from pkg import attention_2d\n"}, ["pkg.layout.a imports pkg (not in the pure layer)"]),
    ],
)
def test_the_pure_layer_rule_can_fail(tmp_path, source, expected):
    root = _write_package(tmp_path, source)
    assert pure_layer_violations(import_graph(root, "pkg"), library_imports(root, "pkg"), "pkg") == expected


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"plan.a": "from ..layout.b import x\nfrom ..packing import c\nfrom . import d\n"}, []),
        (
            {"plan.a": "from ..bench import runner\n"},
            ["pkg.plan.a imports pkg.bench", "pkg.plan.a imports pkg.bench.runner"],
        ),
        (
            {"plan.a": "def f():\n    import pkg.megatron.config\n"},
            ["pkg.plan.a imports pkg.megatron", "pkg.plan.a imports pkg.megatron.config"],
        ),
        ({"plan.a": "from pkg import PackedSharding\n"}, ["pkg.plan.a imports pkg"]),
        ({"plan.a": "import torch.distributed as dist\n"}, ["pkg.plan.a imports torch"]),
    ],
)
def test_the_planner_rule_can_fail(tmp_path, source, expected):
    source = {"layout.b": "", "packing.c": "", "plan.d": "", "bench.runner": "", "megatron.config": "", **source}
    root = _write_package(tmp_path, source)
    assert planner_violations(import_graph(root, "pkg"), library_imports(root, "pkg"), "pkg") == expected


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            {"demo": "from .testing import reference\n"},
            ["pkg.demo imports pkg.testing", "pkg.demo imports pkg.testing.reference"],
        ),
        (
            {"megatron.spec": "def f():\n    from ..bench.runners import R\n"},
            ["pkg.megatron.spec imports pkg.bench", "pkg.megatron.spec imports pkg.bench.runners"],
        ),
        (
            {"": '_EXPORTS = {"demo": "testing.reference"}\n'},
            ["pkg imports pkg.testing", "pkg imports pkg.testing.reference"],
        ),
        # the test support and the benchmarks may use each other and the runtime
        ({"bench.runners": "from ..testing import reference\nfrom .. import demo\n", "demo": ""}, []),
    ],
)
def test_the_runtime_rule_can_fail(tmp_path, source, expected):
    root = _write_package(tmp_path, {"testing.reference": "", "bench.runners": "", **source})
    assert runtime_violations(import_graph(root, "pkg"), "pkg") == expected


def private_imports(root: Path = PACKAGE, package: str | tuple[str, ...] = NAME) -> list[str]:
    """``module: from source import _name`` for every private name (one leading underscore) a module of the package
    takes from another of its modules (of ``package``, or of any package of a tuple)."""
    packages = (package,) if isinstance(package, str) else package
    found = []
    for name, path in modules(root).items():
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not (node.level or (node.module or "").split(".")[0] in packages):
                continue
            found += [
                f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_private_names_cross_modules():
    assert private_imports() == []
    assert private_imports(DEV_PACKAGE, (DEV, NAME)) == []


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
    """A documents-mode sharding built without a cost (what ``PackedSharding(mode="documents")`` and the Megatron data
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
