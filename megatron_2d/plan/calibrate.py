"""Fit the cost model's rates to measured times.

Model (deliberately simple, linear): a measured layer time is the serial sum of its parts,

    t  =  flops / R_attn  +  nvlink_bytes / R_nvl  +  nic_bytes / R_nic

and a least-squares fit over the samples gives the three effective rates (columns that are zero in every sample
are left out and their rate stays unknown). Overlap makes real times shorter than this sum, so fitted rates are
optimistic when the samples overlap communication; for clean figures time compute-only runs (cp = 1, hp = 1)
and communication-heavy runs separately, or pass samples whose communication is exposed.

``nic_bytes`` is the network traffic scaled by max(flows, NICs)/NICs (``Estimate.inter_bytes_nic``), so R_nic is
the bandwidth of one NIC: the node's network bandwidth is R_nic * nics_per_node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .cost_model import BWD_FACTOR, GB
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError


@dataclass(frozen=True)
class WorkCounts:
    """What one rank does in one measured run: attention FLOPs executed and bytes sent per path."""

    flops: float
    nvlink_bytes: float = 0.0
    nic_bytes: float = 0.0


@dataclass(frozen=True)
class FitResult:
    """Fitted effective rates (None where no sample exercised that term) and the fit's RMS residual (s)."""

    flops_per_s: Optional[float]
    nvlink_bytes_per_s: Optional[float]
    nic_bytes_per_s: Optional[float]
    rms_residual_s: float


def work_counts(layout, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, seq: int,
                causal: bool = True) -> WorkCounts:
    """The counts of one layout's attention layer (forward + backward) on its slowest rank."""
    from .planner import evaluate                     # local import: planner imports nothing from here

    cand = evaluate(layout, model, cluster, parallel, seq, causal)
    if not cand.runs:                                 # a measured layout ran: the memory estimate is not a verdict
        raise PlanError(f"cannot count work of an infeasible layout {layout.label()}: {cand.reason}")
    e = cand.estimate
    return WorkCounts(flops=(1.0 + BWD_FACTOR) * e.work.fwd_flops, nvlink_bytes=e.intra_bytes,
                      nic_bytes=e.inter_bytes_nic)


def fit_rates(samples: Iterable[Tuple[WorkCounts, float]]) -> FitResult:
    """Least-squares fit of t = flops/R_attn + nvlink_bytes/R_nvl + nic_bytes/R_nic over (counts, seconds) pairs.

    Solves for the inverse rates x = (1/R_attn, 1/R_nvl, 1/R_nic) with numpy's lstsq; a non-positive inverse rate
    (the data cannot tell that term apart) raises PlanError naming it.
    """
    samples = list(samples)
    if not samples:
        raise PlanError("fit_rates needs at least one (WorkCounts, seconds) sample")
    for counts, t in samples:
        if not isinstance(counts, WorkCounts) or not t > 0:
            raise PlanError(f"each sample must be (WorkCounts, positive seconds), got ({counts!r}, {t!r})")
    A = np.array([[c.flops, c.nvlink_bytes, c.nic_bytes] for c, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    used = [j for j in range(3) if np.any(A[:, j] > 0)]
    if len(samples) < len(used):
        raise PlanError(f"{len(samples)} samples cannot fit {len(used)} rates; add samples that vary "
                        f"compute and traffic independently")
    scale = A[:, used].max(axis=0)                 # columns differ by orders of magnitude: fit in scaled units
    x, *_ = np.linalg.lstsq(A[:, used] / scale, y, rcond=None)
    names = ("attention FLOP/s", "NVLink bytes/s", "NIC bytes/s")
    rates: List[Optional[float]] = [None, None, None]
    for j, xj, s in zip(used, x, scale):
        if xj <= 0:
            raise PlanError(f"the fit gave a non-positive time per unit for {names[j]} ({xj / s:.3g}); the samples "
                            f"do not separate it from the other terms")
        rates[j] = float(s / xj)
    rms = float(np.sqrt(np.mean((A[:, used] / scale @ x - y) ** 2)))
    return FitResult(rates[0], rates[1], rates[2], rms)


def calibrate(cluster: ClusterSpec, samples: Sequence[Tuple[object, float]], model: Union[ModelSpec, str],
              parallel: ParallelSpec, seq: int, causal: bool = True) -> Tuple[ClusterSpec, FitResult]:
    """A copy of ``cluster`` with attention efficiency and link bandwidths fitted to measurements.

    ``samples`` are (layout, measured seconds for one layer's attention forward + backward) pairs, layouts being
    ``candidates.Layout`` objects run with ``model``, ``parallel`` and ``seq``. Terms no sample exercised keep the
    cluster's figures; the attention efficiency is capped at 1.
    """
    from .hardware import get_model

    m = get_model(model) if isinstance(model, str) else model
    fit = fit_rates([(work_counts(layout, m, cluster, parallel, seq, causal), t) for layout, t in samples])
    changes = {}
    if fit.flops_per_s:
        changes["attn_efficiency"] = min(1.0, fit.flops_per_s / (cluster.peak_tflops * 1e12))
    if fit.nvlink_bytes_per_s:
        changes["nvlink_gbps"] = fit.nvlink_bytes_per_s / GB
    if fit.nic_bytes_per_s:
        changes["net_gbps_per_node"] = fit.nic_bytes_per_s / GB * cluster.nics_per_node
    return cluster.with_(name=f"{cluster.name}(calibrated)", **changes), fit
