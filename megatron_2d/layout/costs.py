"""Hardware figures the op's own cost rules assume when given none, defined once (pure Python, no torch).

The documents mode chooses which documents to shard by a predicted step time
(:func:`megatron_2d.packing.sharding.default_cost`); the planner's cluster presets (:mod:`megatron_2d.plan.hardware`)
are built from the same figures, so that the two agree without the op importing the planner.
"""

from __future__ import annotations

from dataclasses import dataclass


def fwd_bwd_efficiency(fwd_tflops: float, bwd_tflops: float, peak_tflops: float) -> float:
    """The forward + backward share of peak from each pass's rate (backward FLOPs = 2.5 x forward)."""
    return 3.5 / (1.0 / fwd_tflops + 2.5 / bwd_tflops) / peak_tflops


H100_CUDNN_EFFICIENCY = fwd_bwd_efficiency(539, 516, 989)
"""cuDNN's attention on H100 (what the op selects there, te_fused): the FlashAttention-3 paper's causal bars, head
dim 128, 16K tokens (:mod:`megatron_2d.plan.kernel_rates` cites them with the other kernels' rates)."""


@dataclass(frozen=True)
class GpuFigures:
    """One GPU's figures for the cost models."""

    peak_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    attn_efficiency: float
    """Fraction of peak the kernel the op selects on this GPU reaches over forward + backward (published figures
    until calibrated)."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU per direction, GB/s."""


H100 = GpuFigures(peak_tflops=989.0, attn_efficiency=H100_CUDNN_EFFICIENCY, nvlink_gbps=450.0)
"""H100 SXM, and H200 SXM (the same compute and links): 989 TFLOP/s bf16, NVLink 4 at 450 GB/s per direction."""
