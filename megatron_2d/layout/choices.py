"""The named choices of the library's settings, each listed once here, and the one check of each.

Pure Python (no torch): the op, ``TransformerConfig2D``, the command-line flags, the benchmarks and the tests import
the names from here, and every route a setting comes in by (an op keyword, a config field, a flag) is checked by the
same function, which names the setting as that route spells it.

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

    >>> check_dkv_comm_dtype("fp8", "cp_2d_dkv_comm_dtype")
    Traceback (most recent call last):
    ...
    ValueError: cp_2d_dkv_comm_dtype 'fp8' is not one of ['accumulator', 'input']
"""

from __future__ import annotations

from collections.abc import Sequence

PLACEMENTS = ("head_first", "context_first")
PACKING_MODES = ("zigzag", "documents", "sequence")
DKV_COMM_DTYPES = ("accumulator", "input")
MLA_RINGS = ("expanded", "latent")
RECOMPUTE_CHECKS = ("tolerance", "bitwise")
KERNELS = ("te_fused", "torch_cudnn", "flash_attn2", "torch_flash", "cpu_flash", "torch_math")
CHECKPOINT_KEEPS = ("outputs", "attention-inputs")  # the first is the default


def choice_problem(setting: str, value, choices: Sequence[str]) -> str | None:
    """Why ``value`` is not a valid ``setting`` (one of ``choices``), or None when it is."""
    if value in choices:
        return None
    return f"{setting} {value!r} is not one of {list(choices)}"


def check_choice(setting: str, value, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else ValueError naming ``setting``, the value and the valid ones."""
    problem = choice_problem(setting, value, choices)
    if problem:
        raise ValueError(problem)
    return value


def check_dkv_comm_dtype(value, setting: str = "dkv_comm_dtype") -> str:
    """The dK/dV riders' dtype name (:data:`DKV_COMM_DTYPES`), checked."""
    return check_choice(setting, value, DKV_COMM_DTYPES)


def check_mla_ring(value, setting: str = "cp_2d_mla_ring") -> str:
    """What travels the ring under MLA (:data:`MLA_RINGS`), checked."""
    return check_choice(setting, value, MLA_RINGS)


def check_kernel(value, setting: str = "kernel") -> str | None:
    """A block kernel's name (:data:`KERNELS`) or None (chosen by device), checked."""
    return None if value is None else check_choice(setting, value, KERNELS)
