"""tools/mutation_check.py: the list format and its refusals (the mutation run itself is `make mutation`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "mutation_check", Path(__file__).resolve().parent.parent / "tools" / "mutation_check.py"
)
mc = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("mutation_check", mc)  # dataclasses look their module up
_SPEC.loader.exec_module(mc)


def write(tmp_path, text):
    path = tmp_path / "list.toml"
    path.write_text(text)
    return path


ENTRY = """
[[mutation]]
id = "m1"
file = "pkg/a.py"
original = '''x = 1'''
replacement = '''x = 2'''
tests = ["tests/test_a.py", "-k", "one or two"]
"""


def test_list_loads_and_snippets_must_occur_once(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\ny = 1\n")
    mutations = mc.load_mutations(write(tmp_path, ENTRY))
    assert [m.id for m in mutations] == ["m1"] and mutations[0].tests == ["tests/test_a.py", "-k", "one or two"]
    mc.check_snippets(mutations, tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(mc.MutationListError, match=r"m1: snippet occurs 2 times in pkg/a.py"):
        mc.check_snippets(mutations, tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("x = 3\n")
    with pytest.raises(mc.MutationListError, match=r"m1: snippet occurs 0 times"):
        mc.check_snippets(mutations, tmp_path)
    # one argv item per list item: a -k expression is not split
    assert mc.pytest_command("py", mutations[0].tests)[-3:] == ["tests/test_a.py", "-k", "one or two"]


@pytest.mark.parametrize(
    "text, message",
    [
        (ENTRY + ENTRY, "duplicate mutation id 'm1'"),
        (
            ENTRY.replace('tests = ["tests/test_a.py", "-k", "one or two"]', 'tests = "tests/test_a.py"'),
            "tests must be a non-empty list",
        ),
        (ENTRY.replace("x = 2", "x = 1"), "replaces its snippet by itself"),
        (ENTRY.replace('id = "m1"', 'id = "m1"\nseverity = 3'), "unknown keys"),
        (ENTRY.replace('file = "pkg/a.py"\n', ""), "lacks ['file']"),
        ("", "no [[mutation]] tables"),
    ],
)
def test_malformed_lists_are_refused(tmp_path, text, message):
    with pytest.raises(mc.MutationListError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mc.load_mutations(write(tmp_path, text))


def test_the_shipped_list_parses():
    mutations = mc.load_mutations(mc.DEFAULT_LIST)
    assert len(mutations) >= 30 and len({m.file for m in mutations}) >= 15
