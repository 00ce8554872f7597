"""The one table of 2D settings (megatron_2d/megatron/fields.py): the config fields, the flags, the checks of their
values, the refusal of settings that would be ignored and docs/megatron.md's flag table all follow from it.

Single-process and fast: configs are built (no model), flags are parsed by a plain argparse parser."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_2d.megatron import fields
from megatron_2d.megatron.arguments import add_2d_arguments
from megatron_2d.megatron.config import MLATransformerConfig2D, TransformerConfig2D
from megatron_2d.megatron.fields import NEEDS_2D, NEEDS_CHECKPOINT_PLUS, Fields2D, fields_2d, flag, table

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "megatron.md"
TABLE_START, TABLE_END = "<!-- 2D flags: megatron_2d.megatron.fields.flag_table() -->", "<!-- end of 2D flags -->"

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    attention_dropout=0.0,
    context_parallel_size=4,
)
TWO_D = dict(BASE, cp_comm_type="2d", cp_2d_head_parallel_size=2)
CHECKPOINT_PLUS = dict(
    selective_checkpoint_plus_plus=True,
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
)


def other_value(f: dataclasses.Field, setting: fields.Setting):
    """A value of setting ``f`` other than its default (sizes valid for ``TWO_D``)."""
    if isinstance(f.default, bool):
        return not f.default
    if setting.choices:
        return next(c for c in setting.choices if c != f.default)
    return 2


def test_the_table_is_the_fields_of_both_configs():
    for config_class in (TransformerConfig2D, MLATransformerConfig2D):
        config_fields = {f.name: f for f in dataclasses.fields(config_class)}
        for f, _ in table():
            assert config_fields[f.name].default == f.default, (config_class.__name__, f.name)
    assert [f.name for f, _ in table()][:3] == [
        "cp_2d_head_parallel_size",
        "cp_2d_context_size",
        "cp_2d_inner_ring_size",
    ]


def test_the_flags_are_the_table():
    parser = add_2d_arguments(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == {f.name for f, _ in table()}
    for f, setting in table():
        action = actions[f.name]
        assert action.option_strings == [flag(f.name)]
        assert action.default == f.default and action.help == setting.doc
        assert action.choices == setting.choices
        if isinstance(f.default, bool):
            assert isinstance(action, argparse._StoreTrueAction)
        elif not setting.choices:
            assert action.type is (setting.type or type(f.default)) and action.type in (int, str)
    assert vars(parser.parse_args([])) == {f.name: f.default for f, _ in table()}
    values = parser.parse_args(["--cp-2d-inner-ring-size", "2", "--cp-2d-mla-ring", "latent"])
    assert (values.cp_2d_inner_ring_size, values.cp_2d_mla_ring) == (2, "latent")


def test_a_flag_refuses_a_value_outside_its_choices(capsys):
    with pytest.raises(SystemExit):
        add_2d_arguments(argparse.ArgumentParser()).parse_args(["--cp-2d-packing", "interleaved"])
    assert "--cp-2d-packing: invalid choice: 'interleaved'" in capsys.readouterr().err


def test_docs_flag_table_is_the_table():
    text = DOC.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, f"docs/megatron.md has no {TABLE_START!r} ... {TABLE_END!r}"
    documented = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert documented == fields.flag_table(), (
        "docs/megatron.md's table of the 2D flags differs from the table in megatron_2d/megatron/fields.py; "
        f"put this between its markers:\n{fields.flag_table()}"
    )


@pytest.mark.parametrize("name", [f.name for f, s in table() if s.needs == NEEDS_2D])
def test_a_2d_setting_without_the_2d_backend_is_refused(name):
    f, setting = next((f, s) for f, s in table() if f.name == name)
    value = other_value(f, setting)
    with pytest.raises(ValueError, match=rf"2D settings \{{'{name}': {value!r}\}} are set but cp_comm_type is"):
        TransformerConfig2D(**{**BASE, "cp_comm_type": "p2p", name: value})


@pytest.mark.parametrize("name", [f.name for f, s in table() if s.needs == NEEDS_CHECKPOINT_PLUS])
def test_a_checkpoint_plus_setting_without_checkpoint_plus_is_refused(name):
    f, setting = next((f, s) for f, s in table() if f.name == name)
    value = other_value(f, setting)
    TransformerConfig2D(**{**TWO_D, **CHECKPOINT_PLUS, name: value})  # valid with Selective Checkpoint++
    with pytest.raises(ValueError, match=rf"\{{'{name}': {value!r}\}} set without selective_checkpoint_plus_plus"):
        TransformerConfig2D(**{**TWO_D, name: value})


@pytest.mark.parametrize("name", [f.name for f, s in table() if s.choices])
def test_a_value_outside_the_choices_is_refused_at_config_build(name):
    _, setting = next((f, s) for f, s in table() if f.name == name)
    needs = CHECKPOINT_PLUS if setting.needs == NEEDS_CHECKPOINT_PLUS else {}
    with pytest.raises(ValueError, match=rf"{name} 'interleaved' is not (one of|valid; choose one of) "):
        TransformerConfig2D(**{**TWO_D, **needs, name: "interleaved"})


def test_fields_2d_fills_the_defaults_of_a_config_that_is_not_ours():
    config = TransformerConfig2D(**TWO_D)
    assert fields_2d(config) is config
    plain = fields_2d(SimpleNamespace(cp_2d_mla_ring="latent", num_layers=2))
    assert isinstance(plain, Fields2D)
    assert dataclasses.asdict(plain) == {**{f.name: f.default for f, _ in table()}, "cp_2d_mla_ring": "latent"}


def test_a_setting_added_to_the_table_gets_its_flag_check_and_refusal(monkeypatch):
    """Adding a setting is one entry in the table: its flag, the check of its value and its refusal without the
    backend follow."""

    @dataclasses.dataclass
    class Extended(Fields2D):
        cp_2d_new_thing: str | None = fields._setting(
            None, "a new setting (None: chosen by the library).", choices=("a", "b")
        )

    monkeypatch.setattr(fields, "Fields2D", Extended)
    parser = add_2d_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--cp-2d-new-thing", "b"]).cp_2d_new_thing == "b"
    assert parser.parse_args([]).cp_2d_new_thing is None
    assert fields.ignored_settings(SimpleNamespace(cp_2d_new_thing="b"), NEEDS_2D) == {"cp_2d_new_thing": "b"}
    fields.check_values(SimpleNamespace(), NEEDS_2D)  # its default is valid
    with pytest.raises(ValueError, match=r"cp_2d_new_thing 'c' is not one of \['a', 'b'\]"):
        fields.check_values(SimpleNamespace(cp_2d_new_thing="c"), NEEDS_2D)
    assert "| `--cp-2d-new-thing` (`cp_2d_new_thing`) | not set | a, b | `--cp-comm-type 2d` |" in fields.flag_table()


def defaulted_reads(source: str) -> list[str]:
    """``getattr(x, "<a setting of the table>", default)`` calls in ``source``: a default spelled outside the
    table (read ``config.<name>``, or ``fields_2d(config).<name>`` for configs that are not ours)."""
    names = {f.name for f, _ in table()}
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in names
    ]


def test_no_library_code_spells_a_default_of_the_table():
    found = {
        path.relative_to(REPO).as_posix(): reads
        for path in sorted([*(REPO / "megatron_2d").rglob("*.py"), *(REPO / "examples").rglob("*.py")])
        if (reads := defaulted_reads(path.read_text(encoding="utf-8")))
    }
    assert not found, f"2D settings read with their own defaults (use fields_2d(config).<name>): {found}"


def test_the_default_check_finds_a_spelled_default():
    assert defaulted_reads('w = getattr(config, "cp_2d_inner_ring_size", 1)\nx = getattr(c, "other", 1)') == [
        "getattr(config, 'cp_2d_inner_ring_size', 1)"
    ]
