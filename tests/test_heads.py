"""The head split rule (megatron_2d.layout.heads): one implementation, asked by the op, MLA's op, the Megatron
settings and the planner alike."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest

import megatron_2d
from megatron_2d.layout import heads
from megatron_2d.layout.heads import (
    check_head_split,
    head_split_problem,
    kv_replication,
    replicated_kv_heads,
    valid_head_parallel_sizes,
)
from megatron_2d.layout.topology import divisors
from megatron_2d.plan import ParallelSpec, get_model
from megatron_2d.plan.candidates import Scheme, check_scheme

PACKAGE = Path(megatron_2d.__file__).parent


def test_kv_replication_over_head_counts():
    for hq in range(1, 25):
        for hkv in divisors(hq):
            for hp in divisors(hq):
                r = kv_replication(hq, hkv, hp)
                assert r == math.lcm(hkv, hp) // hkv == replicated_kv_heads(hkv, hp) // hkv
                assert (r * hkv) % hp == 0  # every head rank gets whole K/V heads
                assert r == 1 or hp % hkv != 0 or r == hp // hkv  # max(hkv, hp) when one divides the other


def test_bad_head_counts_name_the_values():
    with pytest.raises(ValueError, match=r"head-parallel size 4 does not divide the 6 query heads on this rank; "):
        kv_replication(6, 6, 4)
    with pytest.raises(ValueError, match=r"8 query heads are not a multiple of 3 K/V heads"):
        kv_replication(8, 3, 2)
    with pytest.raises(ValueError, match=r"not a multiple of 0 K/V heads"):
        kv_replication(8, 0, 2)
    assert head_split_problem(8, 4) is None
    assert head_split_problem(12, 8, heads="heads", sizes=[1, 2, 4, 8], sizes_for=" for CP=8") == (
        "head-parallel size 8 does not divide the 12 heads; valid head-parallel sizes for CP=8: [1, 2, 4]"
    )
    assert valid_head_parallel_sizes(12) == [1, 2, 3, 4, 6, 12]
    check_head_split(12, 6)
    with pytest.raises(ValueError, match=r"valid head-parallel sizes: \[1, 3, 5, 15\]"):
        check_head_split(15, 2)


def test_public_name_is_the_pure_rule():
    assert megatron_2d.kv_replication is heads.kv_replication
    assert "kv_replication" in megatron_2d.__all__


def _imports(path: Path) -> set[str]:
    """The modules a file imports, relative ones spelled with their dots (``..attention``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_megatron_settings_do_not_import_the_torch_op():
    found = _imports(PACKAGE / "megatron" / "settings.py")
    assert "..layout.heads" in found
    assert not {"..attention", "megatron_2d.attention", "torch"} & found


@pytest.mark.parametrize("heads_, hp", [(24, 16), (32, 64), (12, 8), (32, 8)])
def test_planner_and_settings_refuse_the_same_head_splits(heads_, hp):
    """The planner's feasibility and the Megatron settings' refusal come from the same rule."""
    from megatron_2d.megatron.settings import validate_2d_settings

    model = dataclasses.replace(get_model("7B-GQA"), heads=heads_, kv_heads=4, hidden=heads_ * 128)
    reason = check_scheme(Scheme("2d", hp, 1, 1), model, ParallelSpec(gpus=hp), seq=4 * hp)
    kwargs = dict(context_parallel_size=hp, head_parallel_size=hp, num_attention_heads=heads_, num_query_groups=4)
    if heads_ % hp:
        assert reason == (
            f"hp={hp} does not divide the {heads_} query heads per TP rank; valid hp: "
            f"{valid_head_parallel_sizes(heads_, divisors(hp))}"
        )
        with pytest.raises(ValueError, match=f"head-parallel size {hp} does not divide the {heads_} attention heads"):
            validate_2d_settings(**kwargs)
    else:
        assert reason is None
        validate_2d_settings(**kwargs)


@pytest.mark.parametrize("dropout", [0.1, 1e-6])
def test_settings_refuse_attention_dropout(dropout):
    """validate_2d_settings (the public check launch scripts call) refuses any attention dropout, however small;
    0 passes."""
    from megatron_2d.megatron.settings import validate_2d_settings

    kwargs = dict(context_parallel_size=4, head_parallel_size=2, num_attention_heads=8, num_query_groups=2)
    validate_2d_settings(**kwargs, attention_dropout=0.0)
    with pytest.raises(ValueError, match=f"attention_dropout={dropout}: attention dropout is not supported"):
        validate_2d_settings(**kwargs, attention_dropout=dropout)
