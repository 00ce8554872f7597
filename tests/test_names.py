"""One meaning per word (issue 31, step 5): the retired names occur nowhere in the package, its tests, tools, docs
or examples, so a merge cannot bring them back.

"plan" is the planner only (kernel calls are calls), "layout" the rank layout only (the planner's candidate is a
Scheme, token placement is sharding), "window" the sliding window only (the Double-Ring's w is the inner ring size),
"exchange" the neighbour exchange only. No alias of a retired name is kept: 0.1.0 was never released.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()

W, E = r"(?<![A-Za-z0-9_])", r"(?![A-Za-z0-9_])"
# retired name -> what it is now
RETIRED = {
    W + r"ContextPlan" + E: "ContextCalls",
    W + r"plan_context_group" + E: "context_calls",
    W + r"plan_block" + E: "block_pair_calls",
    W + r"plan_view" + E: "view_calls",
    W + r"(block|packed)_plan" + E: "layout/block_calls.py, packing/calls.py",
    r"(?<=[A-Za-z0-9_)\]]\.)plans" + E: ".calls (RingContext, NeighbourKeys, PackedSharding)",
    W + r"plans=": "calls=",
    W + r"Layout" + r"(?![A-Za-z0-9_]| independence)": "plan.Scheme",
    W + r"(enumerate_layouts|check_layout)" + E: "enumerate_schemes, check_scheme",
    W + r"PackedLayout" + E: "PackedSharding",
    W + r"_?(packed|sequence)_layout" + E: "packed_sharding, sequence_sharding",
    r"(?<![A-Za-z0-9])ring_window" + E: "inner_ring_size (cp_2d_inner_ring_size)",
    r"(?<![A-Za-z0-9_-])--cp-2d-ring-window" + E: "--cp-2d-inner-ring-size",
    W + r"num_windows" + E: "num_inner_rings",
    W + r"_?(intra|inter)_window_(groups?|indices)" + E: "inner_ring_group(s), outer_ring_group(s)",
    W + r"double_ring_windows" + E: "megatron_2d_dev/bench/inner_ring_sizes.py",
    W + r"(Pending|Ring|Direct|Head)Exchange" + E: "PendingTransfer, RingChannel, DirectChannel, HeadRoute",
    r"(?i)" + W + r"ring windows?" + E: "inner ring size",
    W + r"[Hh]ead exchange" + E: "head all-to-all",
}
SUFFIXES = (".py", ".md", ".toml", ".sh", ".sbatch", ".yaml", ".patch")


def scanned_files(root: Path = REPO) -> list[Path]:
    """The package, the development distribution (dev/), its tests, tools, docs, examples, patches, README and
    Makefile (this file excepted: it lists the names)."""
    found = [root / "README.md", root / "Makefile"]
    for folder in ("megatron_2d", "dev", "tests", "tools", "docs", "examples", "patches"):
        found += [p for p in sorted((root / folder).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    return [p for p in found if p.resolve() != THIS and "__pycache__" not in p.parts]


def retired_names_in(paths) -> list[str]:
    """``path:line: old (now new)`` for every retired name found."""
    hits = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            for pattern, now in RETIRED.items():
                for match in re.finditer(pattern, line):
                    hits.append(f"{path}:{number}: {match.group(0)!r} (now {now})")
    return hits


def test_no_retired_name_occurs_in_the_package_tests_tools_docs_or_examples():
    files = scanned_files()
    assert len(files) > 100 and any(p.name == "attention.py" for p in files)  # it reads the real tree
    hits = retired_names_in(files)
    assert not hits, "retired names are back (rename them, e.g. with the house rename script):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line",
    [
        "from megatron_2d.transport.comm import RingExchange",
        "groups = build_2d_groups(2, ring_window=2)",
        "--cp-2d-ring-window 2",
        "self.cp_2d_ring_window = 1",
        "layout = megatron_2d.PackedLayout(cu, groups)",
        "rc.plans[source]",
        "from megatron_2d.plan import Layout",
        "place.intra_window_group",
        "the head exchange at batch 1",
    ],
)
def test_a_reintroduced_name_is_found(tmp_path, line):
    (tmp_path / "new_module.py").write_text(f"ok = 1\n{line}\n")
    assert len(retired_names_in([tmp_path / "new_module.py"])) == 1


@pytest.mark.parametrize(
    "line",
    [
        "from megatron_2d.layout.topology import Layout2D, LayoutError",
        "sliding = SlidingWindow.of((128, 0), True, 4096)  # the sliding window keeps its name",
        "groups = build_2d_groups(2, inner_ring_size=2)",
        "rc.calls[source]; megatron_2d.PackedSharding; HeadRoute; NeighbourExchange; the neighbour exchange",
        "from megatron_2d.plan import Scheme, plan  # the planner keeps the word",
        "Layout independence (what makes CP>1 comparable to CP=1 exactly)",
    ],
)
def test_current_names_are_not_retired(tmp_path, line):
    (tmp_path / "new_module.py").write_text(line + "\n")
    assert retired_names_in([tmp_path / "new_module.py"]) == []
