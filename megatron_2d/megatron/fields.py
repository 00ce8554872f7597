"""The 2D settings of a Megatron model as one table, :class:`Fields2D`: each field's default, choices, doc and need.

Everything else follows from the table (``dataclasses.fields``): the fields of ``TransformerConfig2D`` (which mixes
it in), the check of their choices and the refusal of those set while what they need is off (:func:`check_values`,
:func:`ignored_settings`), the command-line flags (:func:`flag` and :func:`flag_options`, which
``add_2d_arguments`` adds) and docs/megatron.md's table of them (:func:`flag_table`, checked by
tests/test_settings_table.py). A new setting is one field here, plus the code that reads it.

Code reads ``config.cp_2d_*`` from the table: on a TransformerConfig2D directly, on any other object (megatron-core's
plain TransformerConfig on the ``--spec`` route, megatron.training's arguments, a test's namespace) through
:func:`fields_2d`, which fills in the table's defaults for the settings it lacks.

    >>> fields_2d(object()).cp_2d_placement
    'head_first'
    >>> flag("cp_2d_inner_ring_size")
    '--cp-2d-inner-ring-size'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..layout.choices import (
    CHECKPOINT_KEEPS,
    DKV_COMM_DTYPES,
    KERNELS,
    MLA_RINGS,
    PACKING_MODES,
    PLACEMENTS,
    RECOMPUTE_CHECKS,
    CheckpointKeep,
    DkvCommDtype,
    MlaRing,
    PackingMode,
    Placement,
    RecomputeCheck,
    check_choice,
    check_kernel,
)
from ..layout.dynamic import parse_dynamic_layouts
from ..layout.topology import LayoutError, check_placement
from ..packing.modes import mode_class

NEEDS_2D = "--cp-comm-type 2d"
"""A setting of the 2d backend: refused, as it would be ignored, unless some layer's cp_comm_type is "2d"."""
NEEDS_CHECKPOINT_PLUS = "--selective-checkpoint-plus-plus"
"""A setting of Selective Checkpoint++: refused, as it would be ignored, unless selective_checkpoint_plus_plus."""
NEEDS_HYBRID = "--hybrid-context-parallel"
"""A setting of hybrid (dynamic) context parallelism under the 2d backend: refused, as it would be ignored, unless
hybrid_context_parallel (and some layer's cp_comm_type is "2d")."""

_KEY = "megatron_2d"  # the key of a field's Setting in its dataclasses metadata


@dataclass(frozen=True)
class Setting:
    """What the table says of one setting besides its name and default.

    ``doc``: the flag's help and the doc table's description. ``choices``: its valid values (from
    :mod:`megatron_2d.layout.choices`), or None. ``type``: a command-line value's type when neither choices nor a
    default tell it. ``needs``: :data:`NEEDS_2D`, :data:`NEEDS_CHECKPOINT_PLUS` or None (needs nothing).
    ``check``: ``check(value, name)`` raising ValueError naming the setting; default: one of ``choices``."""

    doc: str
    choices: tuple[str, ...] | None = None
    type: Callable | None = None
    needs: str | None = NEEDS_2D
    check: Callable[[Any, str], Any] | None = None

    def validate(self, name: str, value) -> None:
        """ValueError naming ``name``, ``value`` and the valid values when ``value`` is not one of them."""
        if self.check is not None:
            self.check(value, name)
        elif self.choices is not None:
            check_choice(name, value, self.choices)


def _setting(default, doc: str, **kwargs) -> Any:
    """One field of the table: its default, and its :class:`Setting` in the field's metadata."""
    return dataclasses.field(default=default, metadata={_KEY: Setting(doc, **kwargs)})


def check_dynamic_layouts_text(value, name: str) -> None:
    """ValueError naming ``name`` unless ``value`` is a list of per-size layouts (:mod:`megatron_2d.layout.dynamic`)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string of SIZE=HP[xCP][/W][@PLACEMENT] entries, got {value!r}")
    try:
        parse_dynamic_layouts(value)
    except LayoutError as err:
        raise ValueError(f"{name}: {err}") from None


@dataclass
class Fields2D:
    """The 2D settings, mixed into megatron-core's config classes (:class:`.config.TransformerConfig2D`)."""

    cp_2d_head_parallel_size: int | None = _setting(
        None,
        "hp: ranks per head group (all-to-all over heads). Divides the context-parallel size and the attention heads "
        "per TP rank; K/V heads are replicated when hp exceeds them. Needed with cp_comm_type 2d unless "
        "--hierarchical-context-parallel-sizes HP CP gives it.",
        type=int,
    )
    cp_2d_context_size: int | None = _setting(
        None,
        "cp: ranks per context ring. Optional: context-parallel size / hp; checked against it when given.",
        type=int,
    )
    cp_2d_inner_ring_size: int | None = _setting(
        None,
        "w: context ranks per inner ring (Double-Ring); cp / w inner rings form the outer ring. Default: cp, one "
        "plain ring (w = 1 is the same ring); python -m megatron_2d.plan recommends one for a cluster.",
        type=int,
    )
    cp_2d_placement: str = _setting(
        Placement.HEAD_FIRST,
        "head_first: head groups on adjacent ranks (the all-to-all on NVLink); context_first: context rings on "
        "adjacent ranks (the ring's point-to-point on NVLink).",
        choices=PLACEMENTS,
        check=check_placement,
    )
    cp_2d_dkv_comm_dtype: str = _setting(
        DkvCommDtype.ACCUMULATOR,
        "how dK/dV partials travel the ring in backward: accumulator (fp32, exact) or input (the activation dtype, "
        "Transformer Engine's bytes; its error grows with the ring, docs/op.md).",
        choices=DKV_COMM_DTYPES,
    )
    cp_2d_packing: str = _setting(
        PackingMode.ZIGZAG,
        "how packed documents (THD batches) lie over the CP group: zigzag (Megatron's per-document split, --sft "
        "batches), sequence (Megatron's per-sequence split, chosen by itself with "
        "--dataloader-inter-document-masking without --sft) or documents (short documents whole on one context "
        "rank, long ones split; needs the data path of megatron_2d.megatron.packed_data, as "
        "examples/pretrain_gpt_2d.py has). Unpacked batches ignore it.",
        choices=PACKING_MODES,
        check=mode_class,  # any registered mode (megatron_2d.packing.modes)
    )
    cp_2d_mla_ring: str = _setting(
        MlaRing.EXPANDED,
        "what travels the context ring under multi-latent attention (--multi-latent-attention): expanded (per-head "
        "K and V, as every CP backend sends them) or latent (the compressed KV and the rope key, up-projected by "
        "each rank for its own heads at every ring step: fewer ring bytes for more FLOPs, docs/megatron.md; "
        "python -m megatron_2d.plan compares both).",
        choices=MLA_RINGS,
    )
    cp_2d_kernel: str | None = _setting(
        None,
        "the block kernel every 2d attention layer runs; default: chosen by device (Hopper and later: te_fused, "
        "torch_cudnn, flash_attn2, torch_flash; Ampere: flash_attn2 first), the choice logged once on rank 0 "
        "(docs/op.md). A layer spec's kernel overrides it.",
        choices=KERNELS,
        check=check_kernel,
    )
    cp_2d_dynamic_layouts: str | None = _setting(
        None,
        "hybrid (dynamic) CP: the 2D layout of each CP group size, comma-separated SIZE=HP[xCP][/W][@PLACEMENT] "
        "entries, e.g. '4=2x2,8=2x4/2' (hp ranks per head group, cp = SIZE/hp per ring, inner ring size W, default "
        "cp; placement default --cp-2d-placement). Sizes not given: the planner's rule, printed at launch "
        "(docs/megatron.md); python -m megatron_2d.plan --dynamic prints the flag for a cluster.",
        type=str,
        needs=NEEDS_HYBRID,
        check=check_dynamic_layouts_text,
    )
    selective_checkpoint_plus_plus: bool = _setting(
        False,
        "Selective Checkpoint++: with --recompute-granularity full, keep each layer's attention output and "
        "log-sum-exp from the forward pass, so that the recompute pass skips the attention's kernels and ring "
        "traffic (docs/memory.md).",
        needs=None,
    )
    selective_checkpoint_plus_plus_check: str = _setting(
        RecomputeCheck.TOLERANCE,
        "how Selective Checkpoint++ compares a recompute with its first pass: tolerance (the dtype's rounding noise "
        "allowed, as GPU recomputes through atomics give) or bitwise (a debug mode). Neither syncs the host.",
        choices=RECOMPUTE_CHECKS,
        needs=NEEDS_CHECKPOINT_PLUS,
    )
    selective_checkpoint_plus_plus_keep: str = _setting(
        CheckpointKeep.OUTPUTS,
        "what Selective Checkpoint++ keeps of attention until the recompute: outputs (the attention output and its "
        "log-sum-exp; the recompute runs the head all-to-alls again, not the ring) or attention-inputs (also the "
        "head-layout q and K/V: more memory, and the recompute sends nothing).",
        choices=CHECKPOINT_KEEPS,
        needs=NEEDS_CHECKPOINT_PLUS,
    )


def table() -> list[tuple[dataclasses.Field, Setting]]:
    """The table's fields, in order, each with its :class:`Setting`."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(Fields2D)]


def fields_2d(config) -> Fields2D:
    """``config``'s 2D settings: ``config`` itself when it has the table's fields (TransformerConfig2D), else a
    :class:`Fields2D` of the ones it has and the table's defaults for the rest."""
    if isinstance(config, Fields2D):
        return config
    return Fields2D(**{f.name: getattr(config, f.name) for f, _ in table() if hasattr(config, f.name)})


def check_values(config, needs: str) -> None:
    """ValueError naming the first setting that needs ``needs`` whose value in ``config`` is not valid (its name,
    its value, the valid ones). A default is valid (None, say, for "chosen by the library")."""
    values = fields_2d(config)
    for f, setting in table():
        if setting.needs == needs and getattr(values, f.name) != f.default:
            setting.validate(f.name, getattr(values, f.name))


def ignored_settings(config, needs: str) -> dict[str, Any]:
    """The settings that need ``needs`` and are set away from their defaults in ``config``, by name."""
    values = fields_2d(config)
    return {
        f.name: getattr(values, f.name)
        for f, setting in table()
        if setting.needs == needs and getattr(values, f.name) != f.default
    }


def flag(name: str) -> str:
    """The command-line flag of setting ``name`` (its argparse destination is ``name``)."""
    return "--" + name.replace("_", "-")


def flag_options(f: dataclasses.Field) -> dict[str, Any]:
    """argparse's ``add_argument`` keywords of the flag of table field ``f``."""
    setting: Setting = f.metadata[_KEY]
    if isinstance(f.default, bool):
        if f.default:
            raise TypeError(f"{f.name}: a switch of the 2D settings table must default to False")
        return dict(dest=f.name, action="store_true", help=setting.doc)
    if setting.choices is not None:
        return dict(dest=f.name, choices=setting.choices, default=f.default, help=setting.doc)
    return dict(dest=f.name, type=setting.type or type(f.default), default=f.default, help=setting.doc)


def flag_table() -> str:
    """docs/megatron.md's table of the 2D flags (markdown), from the table."""
    rows = [
        "| flag (config field) | default | values | refused without | what it sets |",
        "|---|---|---|---|---|",
    ]
    for f, setting in table():
        if isinstance(f.default, bool):
            values, default = "switch", "off"
        else:
            values = ", ".join(setting.choices) if setting.choices else (setting.type or type(f.default)).__name__
            default = "not set" if f.default is None else f"`{f.default}`"
        needs = f"`{setting.needs}`" if setting.needs else ""
        rows.append(f"| `{flag(f.name)}` (`{f.name}`) | {default} | {values} | {needs} | {setting.doc} |")
    return "\n".join(rows)
