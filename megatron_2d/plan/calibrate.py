"""Fit the cost model's rates to measured times.

Model (deliberately simple, linear): a measured layer time is the serial sum of its parts,

    t  =  flops / R_attn  +  nvlink_p2p / R_nvl  +  nvlink_a2a / R_nvl_a2a  +  nic_p2p / R_nic  +  nic_a2a / R_nic_a2a

(p2p: the ring's sends; a2a: the head all-to-all) and a least-squares fit over the samples gives the effective
rates (columns that are zero in every sample are left out and their rate stays unknown). The all-to-all and ring
rates of a link are fitted apart when the samples separate them (the a2a columns non-zero and the matrix of full
column rank), else one rate per link serves both. :func:`calibrate` turns the rates into the cluster's attention
efficiency and link-efficiency factors (:mod:`.links`): fitted rate / nominal rate.

Overlap makes real times shorter than this sum, so fitted rates are optimistic when the samples overlap
communication; for clean figures time compute-only runs (cp = 1, hp = 1) and communication-heavy runs separately,
or pass samples whose communication is exposed.

``nic_bytes`` is the network traffic scaled by max(flows, NICs)/NICs (``Estimate.inter_bytes_nic``), so R_nic is
the bandwidth of one NIC: the node's network bandwidth is R_nic * nics_per_node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .attention_time import BWD_FACTOR, GB, traffic
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError, get_model
from .job import Job
from .planner import evaluate


@dataclass(frozen=True)
class WorkCounts:
    """What one rank does in one measured run: attention FLOPs executed and bytes sent per path."""

    flops: float
    nvlink_bytes: float = 0.0
    """All bytes sent over NVLink (ring and all-to-all)."""
    nic_bytes: float = 0.0
    """All network bytes, NIC-normalised (``Estimate.inter_bytes_nic``)."""
    nvlink_a2a_bytes: float = 0.0
    """The all-to-all part of ``nvlink_bytes`` (0: not told apart)."""
    nic_a2a_bytes: float = 0.0
    """The all-to-all part of ``nic_bytes``."""


@dataclass(frozen=True)
class FitResult:
    """Fitted effective rates (None where no sample exercised that term) and the fit's RMS residual (s).
    ``nvlink_bytes_per_s`` / ``nic_bytes_per_s`` are the ring (p2p) rates, or every transfer's when the all-to-all
    was not fitted apart (then the ``*_a2a_*`` rates are None)."""

    flops_per_s: float | None
    nvlink_bytes_per_s: float | None
    nic_bytes_per_s: float | None
    rms_residual_s: float
    nvlink_a2a_bytes_per_s: float | None = None
    nic_a2a_bytes_per_s: float | None = None


def work_counts(
    layout, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, seq: int, causal: bool = True
) -> WorkCounts:
    """The counts of one layout's attention layer (forward + backward) on its slowest rank."""
    cand = evaluate(layout, Job(model, cluster, parallel, seq, causal))
    if not cand.runs:  # a measured layout ran: the memory estimate is not a verdict
        raise PlanError(f"cannot count work of an infeasible layout {layout.label()}: {cand.reason}")
    e = cand.estimate
    a2a = replace(e.work, kv_bytes=0.0, dkv_bytes=0.0)  # the all-to-all's share of the traffic alone
    a2a_sent = traffic(a2a, e.links, cluster, layout.hp, layout.cp, layout.w)
    return WorkCounts(
        flops=(1.0 + BWD_FACTOR) * e.work.fwd_flops,
        nvlink_bytes=e.intra_bytes,
        nic_bytes=e.inter_bytes_nic,
        nvlink_a2a_bytes=a2a_sent.intra,
        nic_a2a_bytes=a2a_sent.nic,
    )


def fit_rates(samples: Iterable[tuple[WorkCounts, float]], separate_a2a: bool | None = None) -> FitResult:
    """Least-squares fit of t = flops/R_attn + p2p and a2a bytes per link / their rates over (counts, seconds).

    Solves for the inverse rates with numpy's lstsq. ``separate_a2a``: fit the all-to-all rates apart from the
    ring's (True), fold them into one rate per link (False), or decide (None: apart when the samples have
    all-to-all bytes, separate the columns and give every rate positive; else folded). A non-positive inverse
    rate (the data cannot tell that term apart) raises PlanError naming it.
    """
    samples = list(samples)
    if not samples:
        raise PlanError("fit_rates needs at least one (WorkCounts, seconds) sample")
    for counts, t in samples:
        if not isinstance(counts, WorkCounts) or not t > 0:
            raise PlanError(f"each sample must be (WorkCounts, positive seconds), got ({counts!r}, {t!r})")
    split = np.array(
        [
            [
                c.flops,
                c.nvlink_bytes - c.nvlink_a2a_bytes,
                c.nvlink_a2a_bytes,
                c.nic_bytes - c.nic_a2a_bytes,
                c.nic_a2a_bytes,
            ]
            for c, _ in samples
        ],
        dtype=float,
    )
    folded = split.copy()  # one rate per link: every byte in its ring (p2p) column
    folded[:, 1] += split[:, 2]
    folded[:, 3] += split[:, 4]
    folded[:, [2, 4]] = 0.0
    y = np.array([t for _, t in samples], dtype=float)
    if separate_a2a is None:
        used = [j for j in range(5) if np.any(split[:, j] > 0)]
        apart = (
            np.any(split[:, [2, 4]] > 0)
            and len(samples) >= len(used)
            and np.linalg.matrix_rank(split[:, used] / split[:, used].max(axis=0)) == len(used)
        )
        if apart:
            try:
                return _least_squares(split, y)
            except PlanError:  # noisy samples: the five rates are not all positive; fold the a2a
                pass
        return _least_squares(folded, y)
    return _least_squares(split if separate_a2a else folded, y)


def _least_squares(A: np.ndarray, y: np.ndarray) -> FitResult:
    """The fit of ``y`` = A @ inverse rates over the columns of A that are not all zero (see :func:`fit_rates`)."""
    used = [j for j in range(5) if np.any(A[:, j] > 0)]
    if len(y) < len(used):
        raise PlanError(
            f"{len(y)} samples cannot fit {len(used)} rates; add samples that vary compute and traffic independently"
        )
    scale = A[:, used].max(axis=0)  # columns differ by orders of magnitude: fit in scaled units
    x, *_ = np.linalg.lstsq(A[:, used] / scale, y, rcond=None)
    names = (
        "attention FLOP/s",
        "NVLink ring bytes/s",
        "NVLink all-to-all bytes/s",
        "NIC ring bytes/s",
        "NIC all-to-all bytes/s",
    )
    rates: list[float | None] = [None] * 5
    for j, xj, sc in zip(used, x, scale):
        if xj <= 0:
            raise PlanError(
                f"the fit gave a non-positive time per unit for {names[j]} ({xj / sc:.3g}); the samples "
                f"do not separate it from the other terms"
            )
        rates[j] = float(sc / xj)
    rms = float(np.sqrt(np.mean((A[:, used] / scale @ x - y) ** 2)))
    return FitResult(rates[0], rates[1], rates[3], rms, nvlink_a2a_bytes_per_s=rates[2], nic_a2a_bytes_per_s=rates[4])


def efficiency_factors(cluster: ClusterSpec, fit: FitResult) -> dict[str, float]:
    """ClusterSpec changes that make the cluster's effective rates the fitted ones: ``links`` factors = fitted
    rate / nominal rate (NVLink: ``nvlink_gbps``; network: one NIC's share of ``net_gbps_per_node``); a rate above
    its nominal raises the nominal to it (factor 1). An all-to-all rate not fitted apart takes the ring's factor."""
    changes: dict[str, object] = {}
    links = cluster.links
    for link, nominal_key, nominal, p2p, a2a in (
        ("nvlink", "nvlink_gbps", cluster.nvlink_gbps * GB, fit.nvlink_bytes_per_s, fit.nvlink_a2a_bytes_per_s),
        ("network", "net_gbps_per_node", cluster.nic_gbps * GB, fit.nic_bytes_per_s, fit.nic_a2a_bytes_per_s),
    ):
        if p2p is None and a2a is None:
            continue
        top = max(r for r in (p2p, a2a, nominal) if r is not None)
        if top > nominal:
            changes[nominal_key] = top / GB * (cluster.nics_per_node if link == "network" else 1)
        factors = {f"{link}_p2p": (p2p or a2a) / top, f"{link}_a2a": (a2a or p2p) / top}
        links = replace(links, **factors)
    changes["links"] = links
    return changes


def calibrate(
    cluster: ClusterSpec,
    samples: Sequence[tuple[object, float]],
    model: ModelSpec | str,
    parallel: ParallelSpec,
    seq: int,
    causal: bool = True,
) -> tuple[ClusterSpec, FitResult]:
    """A copy of ``cluster`` with attention efficiency and link-efficiency factors fitted to measurements.

    ``samples`` are (layout, measured seconds for one layer's attention forward + backward) pairs, layouts being
    ``candidates.Scheme`` objects run with ``model``, ``parallel`` and ``seq``. Terms no sample exercised keep the
    cluster's figures; the attention efficiency is capped at 1; the link factors are the fitted rates over the
    nominal ones (:func:`efficiency_factors`), for ring sends and all-to-alls apart when the samples separate them.
    """
    m = get_model(model) if isinstance(model, str) else model
    fit = fit_rates([(work_counts(layout, m, cluster, parallel, seq, causal), t) for layout, t in samples])
    changes = efficiency_factors(cluster, fit)
    if fit.flops_per_s:
        changes["attn_efficiency"] = min(1.0, fit.flops_per_s / (cluster.peak_tflops * 1e12))
    return cluster.with_(name=f"{cluster.name}(calibrated)", **changes), fit
