"""Choices of the op that other parts import instead of restating them (torch-free: the planner imports it too).

    DKV_COMM_DTYPES                 how dK/dV partials travel the ring in backward
    head_exchange_point_to_point    which path the head all-to-all takes, and so how many copies it makes
"""

from __future__ import annotations

DKV_COMM_DTYPES = ("accumulator", "input")
"""``dkv_comm_dtype`` (``cp_2d_dkv_comm_dtype``, ``--cp-2d-dkv-comm-dtype``): dK/dV riders travel and accumulate in
the accumulator dtype ("accumulator": fp32, fp64 for fp64 inputs; the default, exact) or in the input dtype
("input": Transformer Engine's bytes, half of fp32's in bf16 training)."""


def head_exchange_point_to_point(backend: str, batch: int, chunk_units: bool) -> bool:
    """Whether the head exchange goes by point-to-point messages rather than one collective all-to-all: batch 1
    with zigzag chunk units (not the per-token order of packed documents) on gloo, where it was measured faster.
    NCCL keeps the collective until a GPU measurement says otherwise."""
    return backend == "gloo" and batch == 1 and chunk_units


def head_exchange_copies(backend: str, batch: int, chunk_units: bool) -> int:
    """Copies of the data one direction of the head exchange makes on each rank: 2 for the collective (into the
    send buffer, out of the receive buffer), 1 point to point (units land in place; one pack or unpack copy)."""
    return 1 if head_exchange_point_to_point(backend, batch, chunk_units) else 2
