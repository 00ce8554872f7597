"""Calibrate the planner (megatron_2d.plan) on this CPU from measured times of our 2D layouts, then check it.

    python tools/calibrate_planner.py                              # runs bench_compare --no-peers at N=4 and N=8
    python tools/calibrate_planner.py --from-json c4.json c8.json  # or reuse bench_compare.py --json outputs
    python tools/calibrate_planner.py --ranks 4 8 --seq 8192 --json calib.json

The CPU as the planner's cluster (one per N; N forked gloo ranks share the machine's cores):
    f          = N / min(N, cores)           how many ranks share one core
    node       = one node, gpus_per_node = N (every transfer is "NVLink": gloo over loopback / shared memory)
    peak       = P1 / f per rank, P1 = measured single-thread matmul FLOP/s in the benchmark's dtype
    hbm        = M1 / f per rank, M1 = measured single-thread copy bandwidth (read + write)
    latency    = measured time of one ring step of a 4-byte message on N ranks (step_latency_us)
Fitted (megatron_2d.plan.fit_rates, the planner's own least-squares: t = flops / R + bytes / B) over the samples
of every N together, each sample's work counted in core-seconds (its counts times f, because f ranks share a core)
and its time less the model's fixed costs (latency, merges, all-to-all permutes: the planner's own estimate on the
same cluster with unbounded compute and links). The ring sends' rate B and the all-to-alls' rate B_a2a are fitted
apart when the layouts separate them (hp = 1, 1 < hp < N and hp = N together do). Then attn_efficiency = R / P1,
nvlink_gbps = max(B, B_a2a) / f per rank and the link factors (megatron_2d.plan.links) nvlink_p2p = B / max,
nvlink_a2a = B_a2a / max, and every layout is predicted by megatron_2d.plan.evaluate on the calibrated cluster and
printed next to its
measurement ("predicted"), together with the same estimate with no overlap of communication and compute
("no-overlap": compute + every transfer serialised), which tells whether the rings' overlap assumption is what
misses. Timing noise on a 2-core machine is large; the verdict lines say how far to trust the fit. With --from-json
the machine figures (peak, copy, latency) are measured now, not when the JSON was written: run both on a quiet
machine (bench_compare warns when its single-process time drifted during a run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from megatron_2d.plan import (
    ClusterSpec,
    FitResult,
    ModelSpec,
    ParallelSpec,
    Scheme,
    WorkCounts,
    evaluate,
    fit_rates,
    work_counts,
)
from megatron_2d.plan.links import IDEAL_LINKS, LinkEfficiency
from megatron_2d.testing.distributed import run_on_ranks

from ..cli import add_arguments, add_output_arguments, render_table
from . import compare as bench_compare
from .harness import bench_model, measure_copy_bandwidth, time_call  # noqa: F401 (bench_model: re-exported)

UNBOUNDED = 1e9  # TFLOP/s and GB/s that make kernels and transfers free (fixed costs only)


@dataclass
class Sample:
    """One measured 2D layout: CP size n, the planner's layout, seconds and measured bytes sent per rank."""

    n: int
    scheme: Scheme
    seconds: float
    bytes_measured: float


@dataclass
class MachineFigures:
    """What was measured on this machine (per core / per step), before any fit."""

    cores: int
    peak_flops: float
    copy_bytes_per_s: float
    step_latency_s: dict[int, float]


# -- measurements -----------------------------------------------------------------------------------------------


def _best_seconds(fn, repeats: int = 5) -> float:
    return time_call(fn, repeats, reduce=min)


def measure_peak_flops(dtype: torch.dtype, n: int = 1024) -> float:
    """Single-thread FLOP/s of an n^3 matmul in ``dtype`` (the best of a few runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    seconds = _best_seconds(lambda: a @ b)
    torch.set_num_threads(threads)
    return 2.0 * n**3 / seconds


def _ring_step_latency(rank: int, world: int, steps: int) -> float:
    """Median seconds of one ring step (isend to rank+1, irecv from rank-1) of a 4-byte message."""
    send, recv = torch.zeros(1), torch.empty(1)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_step_latency(n: int, steps: int = 100) -> float:
    """Ring-step latency on n forked gloo ranks (the slowest rank's median)."""
    return max(run_on_ranks(n, _ring_step_latency, steps))


def measure_machine(ns: Sequence[int], dtype: torch.dtype) -> MachineFigures:
    return MachineFigures(
        cores=os.cpu_count() or 1,
        peak_flops=measure_peak_flops(dtype),
        copy_bytes_per_s=measure_copy_bandwidth(),
        step_latency_s={n: measure_step_latency(n) for n in ns},
    )


# -- the planner's view of this machine -------------------------------------------------------------------------


def share(n: int, cores: int) -> float:
    """f = N / min(N, cores): ranks per core."""
    return n / min(n, cores)


def cpu_cluster(
    n: int,
    m: MachineFigures,
    attn_efficiency: float = 0.5,
    link_bytes_per_core: float = 1e9,
    links: LinkEfficiency = IDEAL_LINKS,
) -> ClusterSpec:
    """This machine as a one-node cluster of n ranks (see the module docstring); ``links``: the factors of the ring
    sends and all-to-alls on its one "NVLink" (gloo's transfers) relative to ``link_bytes_per_core``."""
    f = share(n, m.cores)
    return ClusterSpec(
        f"cpu x{n}",
        gpus_per_node=n,
        peak_tflops=m.peak_flops / f / 1e12,
        attn_efficiency=attn_efficiency,
        nvlink_gbps=link_bytes_per_core / f / 1e9,
        net_gbps_per_node=1.0,
        nics_per_node=1,
        hbm_gbps=m.copy_bytes_per_s / f / 1e9,
        step_latency_us=m.step_latency_s[n] * 1e6,
        gpu_memory_gb=1e3,
        links=links,
    )


def fixed_seconds(layout: Scheme, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, seq: int) -> float:
    """The planner's time for ``layout`` with free kernels and links: latency, merges and permutes only."""
    free = cluster.with_(peak_tflops=UNBOUNDED, attn_efficiency=1.0, nvlink_gbps=UNBOUNDED, net_gbps_per_node=UNBOUNDED)
    return evaluate(layout, model, free, parallel, seq).estimate.time_s


def fit(samples: Sequence[Sample], model: ModelSpec, m: MachineFigures, seq: int, batch: int) -> FitResult:
    """Per-core attention FLOP/s and link bytes/s from every sample (core-seconds, fixed costs taken out)."""
    pairs = []
    for s in samples:
        cluster, parallel = cpu_cluster(s.n, m), ParallelSpec(gpus=s.n, cp=s.n, micro_batch=batch)
        c = work_counts(s.scheme, model, cluster, parallel, seq)
        f = share(s.n, m.cores)
        rest = s.seconds - fixed_seconds(s.scheme, model, cluster, parallel, seq)
        if rest <= 0:
            raise SystemExit(
                f"{s.scheme.label()} at N={s.n}: measured {s.seconds * 1e3:.1f} ms is below the model's "
                f"fixed costs; the latency/bandwidth measurements do not fit this machine"
            )
        pairs.append(
            (
                WorkCounts(
                    c.flops * f, c.nvlink_bytes * f, c.nic_bytes * f, c.nvlink_a2a_bytes * f, c.nic_a2a_bytes * f
                ),
                rest,
            )
        )
    return fit_rates(pairs)


def calibrated_cluster(n: int, m: MachineFigures, result: FitResult) -> tuple[ClusterSpec, float]:
    """The cluster for n ranks with the fitted figures; also the raw efficiency R / P1 (may exceed 1: capped).
    The link's nominal rate is the faster of the fitted ring and all-to-all rates; the factors (megatron_2d.plan.
    links) put each at its fitted rate."""
    raw_eff = result.flops_per_s / m.peak_flops
    p2p, a2a = result.nvlink_bytes_per_s, result.nvlink_a2a_bytes_per_s
    top = max((r for r in (p2p, a2a) if r), default=1e9)
    links = replace(IDEAL_LINKS, nvlink_p2p=(p2p or a2a or top) / top, nvlink_a2a=(a2a or p2p or top) / top)
    return cpu_cluster(n, m, attn_efficiency=min(1.0, raw_eff), link_bytes_per_core=top, links=links), raw_eff


# -- samples ----------------------------------------------------------------------------------------------------


def samples_from_json(data: dict[str, object]) -> list[Sample]:
    """Our timed 2D rows of one bench_compare --json output."""
    n = int(data["args"]["ranks"])
    out = []
    for row in data["rows"]:
        if row["family"] != bench_compare.OURS or row["seconds"] is None:
            continue
        lay = row["layout"]
        out.append(
            Sample(
                n,
                Scheme("2d", lay["hp"], lay["cp"], lay["w"], lay["placement"]),
                row["seconds"],
                row["bytes"]["a2a"] + row["bytes"]["ring"],
            )
        )
    return out


def run_bench(n: int, args) -> dict[str, object]:
    """bench_compare --no-peers at n ranks; returns what its --json would hold."""
    argv = [
        "--ranks",
        str(n),
        "--no-peers",
        "--seq",
        str(args.seq),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--dim",
        str(args.dim),
        "--batch",
        str(args.batch),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
    ] + (["--quiet"] if args.quiet else [])
    bargs = bench_compare.parse_args(argv)
    report = bench_compare.run_compare(bargs)
    bench_compare.print_report(report, bargs)
    return {"args": vars(bargs), "rows": [asdict(r) for r in report.rows]}


# -- report -----------------------------------------------------------------------------------------------------


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks); NaN when either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def verdict(rel_errors: Sequence[float]) -> str:
    med = statistics.median(abs(e) for e in rel_errors)
    worst = max(abs(e) for e in rel_errors)
    if med < 0.10 and worst < 0.25:
        return f"GOOD: median |error| {med:.0%}, worst {worst:.0%}"
    if med < 0.25:
        return f"FAIR: median |error| {med:.0%}, worst {worst:.0%} - use the ranking, not the absolute times"
    return (
        f"POOR: median |error| {med:.0%}, worst {worst:.0%} - the planner's model does not describe this "
        f"machine well (see the notes below)"
    )


def report(
    samples: list[Sample], model: ModelSpec, m: MachineFigures, result: FitResult, seq: int, batch: int
) -> dict[str, object]:
    """Print predicted vs measured for every sample and the summary; return it all as a dict."""
    rows = _sample_rows(samples, model, m, result, seq, batch)
    _print_rows(rows, model, seq, batch)
    _print_fit(m, result)
    per_n: dict[int, list[dict[str, object]]] = {}
    for r in rows:
        per_n.setdefault(r["n"], []).append(r)
    summary: dict[object, dict[str, object]] = {}
    for n, rs in per_n.items():
        summary[n] = _layouts_summary(rs)
        _print_layouts_summary(n, summary[n])
    summary["all"] = {
        "verdict": verdict([r["rel_error"] for r in rows]),
        "no_overlap_verdict": verdict([r["serial_rel_error"] for r in rows]),
    }
    _print_overall(summary["all"])
    return {"rows": rows, "summary": summary, "fit": _fitted(m, result), "machine": _machine(m)}


def _sample_rows(
    samples: list[Sample], model: ModelSpec, m: MachineFigures, result: FitResult, seq: int, batch: int
) -> list[dict[str, object]]:
    """One record per sample (by N, then measured time): measured against the calibrated planner's prediction."""
    rows = []
    for s in sorted(samples, key=lambda s: (s.n, s.seconds)):
        cluster, _ = calibrated_cluster(s.n, m, result)
        parallel = ParallelSpec(gpus=s.n, cp=s.n, micro_batch=batch)
        e = evaluate(s.scheme, model, cluster, parallel, seq).estimate
        label = f"hp{s.scheme.hp} x cp{s.scheme.cp}  w{s.scheme.w}  {s.scheme.placement}"  # as bench_compare
        rows.append(
            {
                "n": s.n,
                "layout": label,
                "measured_ms": s.seconds * 1e3,
                "predicted_ms": e.time_s * 1e3,
                "rel_error": e.time_s / s.seconds - 1,
                "compute_ms": e.compute_s * 1e3,
                "serial_ms": (e.compute_s + e.comm_total_s) * 1e3,
                "serial_rel_error": (e.compute_s + e.comm_total_s) / s.seconds - 1,
                "comm_exposed_ms": e.comm_s * 1e3,
                "model_mib": e.intra_bytes / 2**20,
                "measured_mib": s.bytes_measured / 2**20,
            }
        )
    return rows


ROW_HEADER = [
    "N",
    "layout",
    "measured ms",
    "predicted ms",
    "rel err",
    "compute ms",
    "exposed comm ms",
    "no-overlap ms",
    "rel err",
    "model MiB",
    "measured MiB",
]


def _print_rows(rows: list[dict[str, object]], model: ModelSpec, seq: int, batch: int) -> None:
    body = [
        [
            str(r["n"]),
            r["layout"],
            f"{r['measured_ms']:.0f}",
            f"{r['predicted_ms']:.0f}",
            f"{100 * r['rel_error']:+.0f}%",
            f"{r['compute_ms']:.0f}",
            f"{r['comm_exposed_ms']:.0f}",
            f"{r['serial_ms']:.0f}",
            f"{100 * r['serial_rel_error']:+.0f}%",
            f"{r['model_mib']:.2f}",
            f"{r['measured_mib']:.2f}",
        ]
        for r in rows
    ]
    render_table(
        f"planner calibrated on this CPU: {model.name}, S={seq}, b={batch}; predicted vs measured",
        ROW_HEADER,
        body,
        width=175,
    )


def _print_fit(m: MachineFigures, result: FitResult) -> None:
    """What was measured on the machine, and the rates fitted to the samples."""
    raw_eff = result.flops_per_s / m.peak_flops
    link, a2a = result.nvlink_bytes_per_s, result.nvlink_a2a_bytes_per_s
    print(
        f"measured: {m.cores} cores; matmul peak {m.peak_flops / 1e9:.0f} GFLOP/s per core; copy "
        f"{m.copy_bytes_per_s / 1e9:.1f} GB/s per core; ring-step latency "
        + ", ".join(f"N={n}: {t * 1e3:.2f} ms" for n, t in m.step_latency_s.items())
    )
    print(
        f"fitted (core-seconds, fixed costs removed): attention {result.flops_per_s / 1e9:.1f} GFLOP/s per core = "
        f"efficiency {raw_eff:.3f} of peak{' (CAPPED at 1)' if raw_eff > 1 else ''}; link "
        + (f"{link / 1e9:.2f} GB/s per core" if link else "not identifiable (no traffic)")
        + (
            f" for ring sends, {a2a / 1e9:.2f} GB/s per core for all-to-alls (link factors p2p "
            f"{link / max(link, a2a):.2f}, a2a {a2a / max(link, a2a):.2f})"
            if link and a2a
            else " (ring and all-to-all not separable: one rate)"
        )
        + f"; fit RMS residual {result.rms_residual_s * 1e3:.1f} ms"
    )


def _layouts_summary(rs: list[dict[str, object]]) -> dict[str, object]:
    """How well the predictions of one N's layouts rank and match the measurements, with and without overlap."""
    meas = [r["measured_ms"] for r in rs]
    best_meas = min(rs, key=lambda r: r["measured_ms"])
    best_pred = min(rs, key=lambda r: r["predicted_ms"])
    best_serial = min(rs, key=lambda r: r["serial_ms"])
    return {
        "verdict": verdict([r["rel_error"] for r in rs]),
        "bias": statistics.fmean(r["rel_error"] for r in rs),
        "spearman": spearman(meas, [r["predicted_ms"] for r in rs]),
        "measured_spread": max(meas) / min(meas) - 1,
        "measured_best": best_meas["layout"],
        "predicted_best": best_pred["layout"],
        "regret": best_pred["measured_ms"] / best_meas["measured_ms"] - 1,
        "no_overlap": {
            "verdict": verdict([r["serial_rel_error"] for r in rs]),
            "spearman": spearman(meas, [r["serial_ms"] for r in rs]),
            "predicted_best": best_serial["layout"],
            "regret": best_serial["measured_ms"] / best_meas["measured_ms"] - 1,
        },
    }


def _print_layouts_summary(n: int, s: dict[str, object]) -> None:
    serial = s["no_overlap"]
    print(
        f"N={n}: {s['verdict']}; mean signed error {s['bias']:+.0%}; measured layouts span "
        f"{s['measured_spread']:.0%}; rank correlation {s['spearman']:+.2f}; measured best {s['measured_best']}, "
        f"predicted best {s['predicted_best']} (it measured {s['regret']:+.0%} vs the best)"
    )
    print(
        f"      no-overlap: {serial['verdict']}; rank correlation {serial['spearman']:+.2f}; "
        f"predicted best {serial['predicted_best']} (it measured {serial['regret']:+.0%} vs the best)"
    )


def _print_overall(overall: dict[str, object]) -> None:
    print(f"all samples: {overall['verdict']}")
    print(
        f"the same with no compute/communication overlap (compute + all communication serialised, Estimate."
        f"comm_total_s): {overall['no_overlap_verdict']}"
    )
    print(
        "notes: gloo's transfers on CPU are memory copies done by the ranks' own cores, so they rarely overlap "
        "compute as the model's rings assume; ranks share cores (f > 1), and 2-core timing noise is ~10-30%."
    )


def _fitted(m: MachineFigures, result: FitResult) -> dict[str, object]:
    return {
        "flops_per_s_per_core": result.flops_per_s,
        "efficiency": result.flops_per_s / m.peak_flops,
        "link_bytes_per_s_per_core": result.nvlink_bytes_per_s,
        "a2a_bytes_per_s_per_core": result.nvlink_a2a_bytes_per_s,
        "rms_residual_s": result.rms_residual_s,
    }


def _machine(m: MachineFigures) -> dict[str, object]:
    return {
        "cores": m.cores,
        "peak_flops": m.peak_flops,
        "copy_bytes_per_s": m.copy_bytes_per_s,
        "step_latency_s": m.step_latency_s,
    }


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="CP sizes to measure (default 4 8)")
    p.add_argument("--from-json", nargs="+", metavar="PATH", help="bench_compare.py --json outputs instead of running")
    add_arguments(p, seq=4096, batch=1, heads=8, kv_heads=8, dim=64, repeats=5)
    p.add_argument("--dtype", choices=sorted(bench_compare.DTYPES), default="bf16")
    add_output_arguments(p, json_help="also write predicted vs measured and the fitted figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        runs = []
        for path in args.from_json:
            with open(path) as f:
                runs.append(json.load(f))
    else:
        runs = [run_bench(n, args) for n in args.ranks]
    shape_keys = ("seq", "batch", "heads", "kv_heads", "dim", "dtype")
    shapes = {tuple(r["args"][k] for k in shape_keys) for r in runs}
    if len(shapes) != 1:
        raise SystemExit(f"the runs differ in shape {shape_keys}: {sorted(shapes)}; calibrate on one shape")
    bench_args = runs[0]["args"]
    samples = [s for r in runs for s in samples_from_json(r)]
    ns = sorted({s.n for s in samples})
    model = bench_model(bench_args)
    machine = measure_machine(ns, bench_compare.DTYPES[bench_args["dtype"]])
    result = fit(samples, model, machine, int(bench_args["seq"]), int(bench_args["batch"]))
    out = report(samples, model, machine, result, int(bench_args["seq"]), int(bench_args["batch"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
