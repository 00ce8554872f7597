"""Hardware figures the op's own cost rules assume when given none, defined once (pure Python, no torch).

The documents mode chooses which documents to shard by a predicted step time
(:func:`megatron_2d.packing.sharding.default_cost`); the planner's cluster presets (:mod:`megatron_2d.plan.hardware`)
are built from the same figures, so that the two agree without the op importing the planner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFigures:
    """One GPU's figures for the cost models."""

    peak_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    attn_efficiency: float
    """Fraction of peak the attention kernel reaches over forward + backward (an assumption until calibrated)."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU per direction, GB/s."""


H100 = GpuFigures(peak_tflops=989.0, attn_efficiency=0.45, nvlink_gbps=450.0)
"""H100 SXM, and H200 SXM (the same compute and links): 989 TFLOP/s bf16, NVLink 4 at 450 GB/s per direction."""
