"""The wheel ships only the library (issue 44): built from a copy of the tree, it holds every module of
megatron_2d/ and nothing of the development distribution (dev/megatron_2d_dev: stand-ins, harnesses, demo,
gpu-check, benchmarks), and no module in it patches: none writes into ``sys.modules``, none assigns attributes of
a module or object it imported (``torch.cuda.x = ...``, ``setattr(megatron_module, ...)``)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIPPED = ("pyproject.toml", "README.md", "megatron_2d", "dev")  # what the build reads, and dev/ to show it is left out
# The library's deliberate hooks into megatron.training, each set by a call that Megatron-LM's patched entry scripts
# make after parsing (docs/megatron.md), never at import (tests/test_no_patching_at_import.py): the 2d backend's
# argument validation, swapped in for the one parse and restored, and its QK-clip step. And one in the shipped test
# support: a rank forked by run_on_ranks (its own process, never the caller's) makes its gloo groups share one device
# (testing/distributed.py, _rank_main). Nothing else may patch.
MEGATRON_HOOKS = {
    "megatron_2d/megatron/arguments.py": {"arguments.validate_args assigned", "training.clip_qk assigned"},
    "megatron_2d/testing/distributed.py": {"distributed_c10d.ProcessGroupGloo assigned"},
}


def _root(node: ast.AST) -> str | None:
    """The name an attribute / subscript chain starts from (``torch`` for ``torch.cuda.x[0]``), else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_sys_modules(node: ast.AST, sys_names: set[str]) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and _root(node) in sys_names


def patching_lines(source: str) -> list[str]:
    """``line: what`` for every statement of ``source`` that patches: a write into ``sys.modules`` (item assignment,
    ``update``, ``setdefault``, ``__setitem__``), or an assignment, deletion or ``setattr`` / ``delattr`` of an
    attribute of a name the module imported."""
    tree = ast.parse(source)
    imported, sys_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            sys_names |= {a.asname or a.name for a in node.names if a.name == "sys"}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and _is_sys_modules(t.value, sys_names):
                found.append(f"{node.lineno}: sys.modules[...] written")
            elif isinstance(t, ast.Attribute) and _root(t) in imported:
                found.append(f"{node.lineno}: {ast.unparse(t)} assigned")
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("update", "setdefault", "__setitem__")
                and _is_sys_modules(func.value, sys_names)
            ):
                found.append(f"{node.lineno}: sys.modules.{func.attr}")
            elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                if _root(node.args[0]) in imported:
                    found.append(f"{node.lineno}: {func.id}({ast.unparse(node.args[0])}, ...)")
    return found


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import sys\nsys.modules['flash_attn'] = object()\n", ["2: sys.modules[...] written"]),
        ("import sys\ndef f(m):\n    sys.modules.update(flash_attn=m)\n", ["3: sys.modules.update"]),
        ("import sys as s\ns.modules.setdefault('x', 1)\n", ["2: sys.modules.setdefault"]),
        ("import torch\ntorch.cuda.is_available = lambda: True\n", ["2: torch.cuda.is_available assigned"]),
        (
            "from megatron.core import parallel_state as ps\ndef f():\n    setattr(ps, 'x', 1)\n",
            ["3: setattr(ps, ...)"],
        ),  # fmt: skip
        # reading sys.modules, or setting attributes of one's own objects, patches nothing
        (
            "import sys\nm = sys.modules.get('megatron')\n"
            "def f(config):\n    setattr(config, 'x', 1)\n    config.y = 2\n",
            [],
        ),  # fmt: skip
    ],
)
def test_the_patching_scan_finds_what_it_looks_for(source, expected):
    assert patching_lines(source) == expected


@pytest.mark.slow
def test_the_wheel_holds_the_library_only_and_nothing_that_patches(tmp_path):
    tree = tmp_path / "tree"
    for name in SHIPPED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            tree.mkdir(exist_ok=True)
            shutil.copy2(src, tree / name)
    out = tmp_path / "wheel"
    build = [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("megatron_2d-*.whl")
    with zipfile.ZipFile(wheel) as z:
        sources = {n: z.read(n).decode() for n in z.namelist() if n.endswith(".py")}
    library = {p.relative_to(REPO).as_posix() for p in (REPO / "megatron_2d").rglob("*.py")}
    assert set(sources) == library, sorted(set(sources) ^ library)
    assert not [n for n in sources if n.startswith(("megatron_2d_dev/", "megatron_2d/bench/", "dev/"))]
    found = {n: {f.split(": ", 1)[1] for f in patching_lines(text)} for n, text in sorted(sources.items())}
    patching = {
        n: sorted(f - MEGATRON_HOOKS.get(n, set())) for n, f in found.items() if f - MEGATRON_HOOKS.get(n, set())
    }
    assert not patching, f"modules in the wheel that patch: {patching}"
    assert all(found[n] >= hooks for n, hooks in MEGATRON_HOOKS.items()), "a hook listed here is gone: drop it"
