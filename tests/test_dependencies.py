"""pyproject.toml is the one list of dependencies: the requirements files and tools/install.sh install from it and
name no package of their own, except the pins install.sh puts first (torch, megatron-core), which must satisfy it."""

from __future__ import annotations

import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def lines(path: str) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines dropped)."""
    text = (REPO / path).read_text()
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def test_the_lists_parse_and_name_each_package_once():
    for name, reqs in [
        ("dependencies", PROJECT["dependencies"]),
        *((f"extra {k}", v) for k, v in PROJECT["optional-dependencies"].items()),
    ]:
        names = [canonicalize_name(Requirement(r).name) for r in reqs]
        assert len(names) == len(set(names)), (name, names)
    assert "dev" in PROJECT["optional-dependencies"]


def test_requirements_files_install_the_package_with_pyprojects_lists():
    assert lines("requirements.txt") == ["-e ."]
    assert lines("requirements-dev.txt") == ["-e .[dev]"]


def test_install_script_installs_the_dev_extra_and_its_pins_satisfy_pyproject():
    script = (REPO / "tools" / "install.sh").read_text()
    assert re.search(r'^"\$\{PIP\[@\]\}" -e "\.\[dev\]"$', script, re.M), "install.sh must install .[dev]"
    assert "requirements" not in script
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^"]*)"', script))
    assert set(pins) == {"torch", "megatron-core"}, pins
    declared = {canonicalize_name(Requirement(r).name): Requirement(r) for r in PROJECT["dependencies"]}
    for name, version in pins.items():
        req = declared[canonicalize_name(name)]
        assert req.specifier.contains(version, prereleases=True), (name, version, str(req))


def test_make_reinstalls_when_the_list_changes():
    makefile = (REPO / "Makefile").read_text()
    stamp_rule = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert stamp_rule and {"tools/install.sh", "pyproject.toml"} <= set(stamp_rule.group(1).split())
