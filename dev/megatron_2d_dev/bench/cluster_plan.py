"""The planner against the measurement on the emulated cluster: its prediction beside every measured row of
bench_compare, the rows it predicts within 25%, and the measured time of the 2D layout it recommends.

The planner's cluster is the emulated one as measured (:func:`megatron_2d_dev.bench.cluster.emulated_cluster_spec`);
its model is the benchmark's attention shape as one layer (:func:`megatron_2d_dev.bench.harness.bench_model`).
Rows and the planner's kinds:

    2D hp x cp  w  placement     2d (hp, cp, w, placement)
    USP ulysses U x ring R       2d (U, R, w = R, head_first): the same groups (Ulysses groups of U adjacent
                                 ranks), bytes and dK/dV in fp32; where U does not divide hkv USP has no row
    ring-flash-attn zigzag       2d (1, N, N): a plain zigzag ring, K/V in the input dtype, dK/dV in fp32
    TE p2p / a2a / a2a+p2p [A, P]  the stock kinds p2p, a2a, a2a+p2p (dK/dV in the input dtype)
    torch CP, USP with K/V repeated by the caller   no planner kind: '-'

The planner's byte counts assume bf16 (its model of training); other dtypes are flagged.
"""

from __future__ import annotations

import math
import re
import statistics

from megatron_2d.plan import ParallelSpec, Scheme, evaluate

from ..cli import render_table
from .harness import bench_model
from .runners import OURS, RING_FLASH, USP

WITHIN = 0.25
"""The issue's bar: every row's predicted time within 25% of the measured one."""


def scheme_of(row, args) -> Scheme | None:
    """The planner's layout of one bench_compare row (see the module), None where it has none."""
    n, lay = args.ranks, row.layout
    if row.family == OURS and lay:
        return Scheme("2d", lay["hp"], lay["cp"], lay["w"], lay["placement"])
    if row.family == USP and lay and "repeated" not in row.name:
        return Scheme("2d", lay["hp"], lay["cp"], lay["cp"], "head_first")
    if row.family == RING_FLASH:
        return Scheme("2d", 1, n, n, "head_first")
    if row.family.startswith("TE "):
        kind = row.family[3:]
        if kind == "p2p":
            return Scheme("p2p", 1, n, n)
        if kind == "a2a":
            return Scheme("a2a", n, 1, 1)
        sizes = re.search(r"\[(\d+), (\d+)\]", row.name)
        if kind == "a2a+p2p" and sizes:
            a, p = int(sizes.group(1)), int(sizes.group(2))
            return Scheme("a2a+p2p", a, p, p)
    return None


def planner_rows(report, args, spec) -> list[dict[str, object]]:
    """One record per timed row: measured and predicted seconds, the prediction's parts."""
    model = bench_model(vars(args))
    parallel = ParallelSpec(gpus=args.ranks, cp=args.ranks, micro_batch=args.batch)
    out = []
    for row in report.rows:
        if row.seconds is None:
            continue
        scheme = scheme_of(row, args)
        record = {"name": row.name, "family": row.family, "measured_s": row.seconds, "predicted_s": None}
        if scheme is not None:
            cand = evaluate(scheme, model, spec, parallel, args.seq, causal=True, recompute="none")
            if cand.runs:
                e = cand.estimate
                record |= {
                    "predicted_s": e.time_s,
                    "compute_s": e.compute_s,
                    "a2a_s": e.a2a_s,
                    "ring_exposed_s": e.ring_exposed_s,
                    "serial_s": e.compute_s + e.comm_total_s,
                }
            else:
                record["reason"] = cand.reason
        out.append(record)
    return out


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    """How close the planner is: rows within 25%, the median and worst error, and its recommended 2D layout (the
    fastest predicted) against the measured best 2D and the measured best of all."""
    predicted = [r for r in rows if r["predicted_s"] is not None]
    errors = [r["predicted_s"] / r["measured_s"] - 1 for r in predicted]
    ours = [r for r in predicted if r["family"] == OURS]
    out: dict[str, object] = {
        "rows": len(predicted),
        "within": sum(abs(e) <= WITHIN for e in errors),
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else math.nan,
        "worst_error": max(errors, key=abs) if errors else math.nan,
    }
    if ours:
        pick = min(ours, key=lambda r: r["predicted_s"])
        best = min(ours, key=lambda r: r["measured_s"])
        out |= {
            "recommended": pick["name"],
            "measured_best": best["name"],
            "regret": pick["measured_s"] / best["measured_s"] - 1,
            "best_of_all": min(rows, key=lambda r: r["measured_s"])["name"],
        }
    return out


def print_planner_check(report, args, bc) -> dict[str, object]:
    """The table of predicted beside measured and the summary lines; returns both for the JSON."""
    rows = planner_rows(report, args, bc.spec)

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"

    body = [
        [
            r["name"],
            ms(r["measured_s"]),
            ms(r["predicted_s"]),
            "-" if r["predicted_s"] is None else f"{100 * (r['predicted_s'] / r['measured_s'] - 1):+.0f}%",
            ms(r.get("compute_s")),
            ms(r.get("a2a_s")),
            ms(r.get("ring_exposed_s")),
            ms(r.get("serial_s")),
        ]
        for r in rows
    ]
    render_table(
        f"the planner on the emulated cluster ({bc.spec.name}: {bc.spec.links.describe()}); predicted vs measured",
        ["implementation", "measured ms", "predicted ms", "error", "compute", "a2a", "ring exposed", "no overlap"],
        body,
        width=170,
    )
    s = summary(rows)
    if s["rows"]:
        print(
            f"planner: {s['within']} of {s['rows']} rows within {WITHIN:.0%} (median |error| "
            f"{s['median_abs_error']:.0%}, worst {s['worst_error']:+.0%})"
        )
    if "recommended" in s:
        print(
            f"planner's 2D pick {s['recommended']} measured {s['regret']:+.1%} against the measured best 2D "
            f"({s['measured_best']}); fastest row of all: {s['best_of_all']}"
        )
    if args.dtype != "bf16":
        print(f"note: the planner counts bf16 bytes; this run is {args.dtype}")
    return {"rows": rows, "summary": s}
