"""Predicted step time against sequence length: the best 2D layout vs each stock baseline (recompute included,
only layouts that fit in memory)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..layout.choices import DkvCommDtype, PlanKind
from .candidates import KINDS
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError
from .job import Job
from .memory_options import MemoryPolicy
from .planner import AUTO, best_by_kind, plan
from .report import seq_label

DEFAULT_SEQS = tuple(1 << k for k in range(15, 21))  # 32K .. 1M


class PlotUnavailable(PlanError):
    """--plot was asked for but matplotlib cannot be imported."""


def sweep(
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seqs: Sequence[int] = DEFAULT_SEQS,
    causal: bool = True,
    window=None,
    recompute=AUTO,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    memory: MemoryPolicy = MemoryPolicy(),
) -> dict[str, list[object | None]]:
    """{kind: [best feasible Candidate of that kind at each seq, or None]} for every kind. A length the job
    cannot be planned at (e.g. not divisible by 2*CP) leaves None for every kind."""
    series: dict[str, list[object | None]] = {k: [] for k in KINDS}
    for s in seqs:
        try:
            best = best_by_kind(
                plan(Job(model, cluster, parallel, s, causal, window, recompute, dkv_comm_dtype, memory=memory))
            )
        except PlanError:
            best = {}
        for k in KINDS:
            c = best.get(k)
            series[k].append(c if c is not None and c.feasible else None)
    return series


def plot_sweep(
    path: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seqs: Sequence[int] = DEFAULT_SEQS,
    causal: bool = True,
    window=None,
    recompute=AUTO,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    memory: MemoryPolicy = MemoryPolicy(),
) -> str:
    """Write a PNG with two panels (step ms per micro-batch with the chosen recompute, log scale; each kind's
    time relative to the best 2D layout) and return ``path``.

    Kinds with no feasible layout at a length leave a gap; their legend entry says 'infeasible' when they have
    none at any length; when nothing is feasible anywhere the panels say so. Raises :class:`PlotUnavailable`
    when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotUnavailable(
            f"--plot needs matplotlib ({err}); install it (pip install matplotlib) or drop --plot"
        ) from err

    seqs = list(seqs)
    series = sweep(model, cluster, parallel, seqs, causal, window, recompute, dkv_comm_dtype, memory)
    anything = any(c is not None for k in KINDS for c in series[k])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {
        PlanKind.TWO_D: dict(color="C3", lw=2.5, marker="o"),
        PlanKind.P2P: dict(color="C0", marker="s"),
        PlanKind.A2A: dict(color="C1", marker="^"),
        PlanKind.A2A_P2P: dict(color="C2", marker="v"),
        PlanKind.DS_ULYSSES: dict(color="C4", marker="x", ls="--"),
    }
    for kind in KINDS:
        cands = series[kind]
        label = "2d (best layout)" if kind == PlanKind.TWO_D else kind
        if all(c is None for c in cands):
            label += " (infeasible)"
        ts = [c.estimate.step_s * 1e3 if c else float("nan") for c in cands]
        rel = [
            c.estimate.step_s / b.estimate.step_s if c and b else float("nan")
            for c, b in zip(cands, series[PlanKind.TWO_D])
        ]
        ax_t.plot(seqs, ts, label=label, **styles[kind])
        ax_m.plot(seqs, rel, label=label, **styles[kind])
    for c, s in zip(series[PlanKind.TWO_D], seqs):
        if c is not None:
            ax_t.annotate(
                f"{c.hp}x{c.cp} w{c.w}\n{c.placement.split('_')[0]}\n{c.recompute}",
                (s, c.estimate.step_s * 1e3),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=7,
                color="C3",
            )
    for ax, ylabel in ((ax_t, "step per micro-batch, recompute included (ms)"), (ax_m, "step time / best 2D layout's")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs)
        ax.set_xticklabels([seq_label(s) for s in seqs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)

    def finite(ax) -> bool:
        return any(math.isfinite(y) for line in ax.get_lines() for y in line.get_ydata())

    if finite(ax_t):
        ax_t.set_yscale("log")
    if finite(ax_m):
        ax_m.set_yscale("log", base=2)
    if not anything:
        for ax in (ax_t, ax_m):
            ax.text(
                0.5,
                0.5,
                "no feasible layout\n(memory or layout constraints)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                color="C3",
            )
    ax_m.legend(fontsize=8)
    fig.suptitle(
        f"{model.name} on {cluster.name}: {parallel.gpus} GPUs, TP={parallel.tp} PP={parallel.pp} "
        f"CP={parallel.cp_size} (predicted)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
