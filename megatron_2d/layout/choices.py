"""The named choices of the library's settings, each an enum listed once here, and the one check of each.

Pure Python (no torch): the op, ``TransformerConfig2D``, the command-line flags, the planner, the benchmarks and the
tests import the names from here, and every route a setting comes in by (an op keyword, a config field, a flag) is
checked by the same function, which names the setting as that route spells it.

Each choice is a :class:`StrEnum` member: it *is* its string (``Placement.HEAD_FIRST == "head_first"``, hashes as
it, formats and prints as it, and its ``repr`` is the string's), so flags, configs, JSON and messages read the same
as before the enums; code compares and dispatches on the members, never on string literals. The tuples below
(``PLACEMENTS``, ...) are the members in their documented order, for parsers' ``choices=``.

    PLACEMENTS        how the head and context groups lie on the ranks of a CP group: build_2d_groups(placement=),
                      cp_2d_placement, --cp-2d-placement (the rank math they choose: topology.py, which checks them)
    PACKING_MODES     how packed documents (THD) are laid out over the CP group:
                      PackedSharding(mode=), cp_2d_packing, --cp-2d-packing (each mode is a class of
                      :mod:`megatron_2d.packing.modes`, whose registry checks the names and holds these)
    DKV_COMM_DTYPES   the dtype dK/dV riders travel in, backward: attention_2d(dkv_comm_dtype=), cp_2d_dkv_comm_dtype,
                      --cp-2d-dkv-comm-dtype ("accumulator": fp32, exact; "input": the activation dtype)
    MLA_RINGS         what travels the ring under multi-latent attention: cp_2d_mla_ring, --cp-2d-mla-ring
    RECOMPUTE_CHECKS  how Selective Checkpoint++ compares a recompute: selective_checkpoint_plus_plus_check,
                      --selective-checkpoint-plus-plus-check
    KERNELS           the block kernel attention runs (None: chosen by device, megatron_2d.kernels):
                      attention_2d(kernel=), cp_2d_kernel, --cp-2d-kernel; the planner's --kernel takes the CUDA ones
    CHECKPOINT_KEEPS  what Selective Checkpoint++ keeps of attention between the first pass and the recompute:
                      selective_checkpoint_plus_plus_keep, --selective-checkpoint-plus-plus-keep ("outputs": out
                      and lse, the default; "attention-inputs": also the head-layout q and K/V, see kept_forward.py)

    TRANSPORT_KINDS   how K/V move in one attention call (:mod:`megatron_2d.layout.transports` chooses)
    PLAN_KINDS        the context-parallel schemes the planner compares: 2D and stock Megatron's (TE) cp-comm-types
    RECOMPUTE_MODES   the planner's activation recomputation modes (Megatron's, and Selective Checkpoint++'s)

    >>> Placement.HEAD_FIRST == "head_first", Placement("context_first"), f"{Kernel.CPU_FLASH}"
    (True, 'context_first', 'cpu_flash')
    >>> check_dkv_comm_dtype("fp8", "cp_2d_dkv_comm_dtype")
    Traceback (most recent call last):
    ...
    ValueError: cp_2d_dkv_comm_dtype 'fp8' is not one of ['accumulator', 'input']
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class StrEnum(str, enum.Enum):  # noqa: UP042 (pyproject admits Python 3.10, which has no enum.StrEnum)
    """A choice that is its string: equal to it, hashed, formatted and repr'd as it (``enum.StrEnum`` but for the
    repr, and Python 3.10 too)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    __format__ = str.__format__


class Placement(StrEnum):
    """How the head and context groups lie on the ranks of a CP group (:mod:`megatron_2d.layout.topology`)."""

    HEAD_FIRST = "head_first"
    CONTEXT_FIRST = "context_first"


class PackingMode(StrEnum):
    """How packed documents (THD) are laid out over the CP group (:mod:`megatron_2d.packing.modes`)."""

    ZIGZAG = "zigzag"
    DOCUMENTS = "documents"
    SEQUENCE = "sequence"


class MegatronSplit(StrEnum):
    """Megatron's own splits of a THD batch over the CP ranks (:data:`megatron_2d.packing.modes.MEGATRON_SPLITS`)."""

    PER_DOCUMENT = "per-document"
    PER_SEQUENCE = "per-sequence"


class HeadUnit(StrEnum):
    """What a packing mode's head all-to-all order sorts (:meth:`megatron_2d.packing.modes.PackingMode.head_order`):
    single tokens, or zigzag chunks of equal length."""

    TOKEN = "token"
    CHUNK = "chunk"


class DkvCommDtype(StrEnum):
    """The dtype dK/dV riders travel in, backward: fp32 (exact) or the activation dtype."""

    ACCUMULATOR = "accumulator"
    INPUT = "input"


class MlaRing(StrEnum):
    """What travels the ring under multi-latent attention: expanded K/V or the latent."""

    EXPANDED = "expanded"
    LATENT = "latent"


class RecomputeCheck(StrEnum):
    """How Selective Checkpoint++ compares a recompute with the first pass."""

    TOLERANCE = "tolerance"
    BITWISE = "bitwise"


class Kernel(StrEnum):
    """The block kernels (:mod:`megatron_2d.kernels`)."""

    TE_FUSED = "te_fused"
    TORCH_CUDNN = "torch_cudnn"
    FLASH_ATTN2 = "flash_attn2"
    TORCH_FLASH = "torch_flash"
    CPU_FLASH = "cpu_flash"
    TORCH_MATH = "torch_math"


class CheckpointKeep(StrEnum):
    """What Selective Checkpoint++ keeps of attention between the first pass and the recompute."""

    OUTPUTS = "outputs"
    ATTENTION_INPUTS = "attention-inputs"


class TransportKind(StrEnum):
    """How K/V move in one attention call (:func:`megatron_2d.layout.transports.transport_kind`)."""

    LOCAL = "local"
    NEIGHBOUR = "neighbour"
    DOUBLE_RING = "double_ring"


class PlanKind(StrEnum):
    """The context-parallel schemes the planner compares: 2D, stock Megatron's cp-comm-types, DeepSpeed-Ulysses."""

    TWO_D = "2d"
    P2P = "p2p"
    A2A = "a2a"
    A2A_P2P = "a2a+p2p"
    DS_ULYSSES = "ds-ulysses"


class RecomputeMode(StrEnum):
    """Activation recomputation as the planner models it: none; Megatron's selective (core attention) and full
    (every layer); Selective Checkpoint++ keeping the attention outputs ("ckpt++") or also its inputs."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    CKPT_PLUS = "ckpt++"
    CKPT_PLUS_INPUTS = "ckpt++inputs"


PLACEMENTS = tuple(Placement)
PACKING_MODES = tuple(PackingMode)
DKV_COMM_DTYPES = tuple(DkvCommDtype)
MLA_RINGS = tuple(MlaRing)
RECOMPUTE_CHECKS = tuple(RecomputeCheck)
KERNELS = tuple(Kernel)
CHECKPOINT_KEEPS = tuple(CheckpointKeep)  # the first is the default
TRANSPORT_KINDS = tuple(TransportKind)
PLAN_KINDS = tuple(PlanKind)
RECOMPUTE_MODES = tuple(RecomputeMode)


def choice_problem(setting: str, value, choices: Sequence[str]) -> str | None:
    """Why ``value`` is not a valid ``setting`` (one of ``choices``), or None when it is."""
    if value in choices:
        return None
    return f"{setting} {value!r} is not one of {list(choices)}"


def check_choice(setting: str, value, choices: Sequence[str]) -> str:
    """The member of ``choices`` equal to ``value`` (so a string comes back as its enum member), else ValueError
    naming ``setting``, the value and the valid ones."""
    problem = choice_problem(setting, value, choices)
    if problem:
        raise ValueError(problem)
    return choices[list(choices).index(value)]


def check_dkv_comm_dtype(value, setting: str = "dkv_comm_dtype") -> str:
    """The dK/dV riders' dtype name (:data:`DKV_COMM_DTYPES`), checked."""
    return check_choice(setting, value, DKV_COMM_DTYPES)


def check_mla_ring(value, setting: str = "cp_2d_mla_ring") -> str:
    """What travels the ring under MLA (:data:`MLA_RINGS`), checked."""
    return check_choice(setting, value, MLA_RINGS)


def check_kernel(value, setting: str = "kernel") -> str | None:
    """A block kernel's name (:data:`KERNELS`) or None (chosen by device), checked."""
    return None if value is None else check_choice(setting, value, KERNELS)
