"""Benchmark attention_2d forward+backward on N forked CPU ranks, for every 2D layout of CP = N.

    python tools/bench_attention.py --ranks 8                 # table on stdout (the script runs this module)
    python tools/bench_attention.py --ranks 4 --json out.json # also save the rows

Columns: layout (hp x cp, window, placement), median time of fwd+bwd, efficiency against ideal (two ways), and the
bytes one rank sends per fwd+bwd, by kind. Ideal is the single-process kernel time on the full problem (one
thread), divided by min(N, cores). Each round times that baseline twice, then every layout (in an order that
rotates from round to round); a layout's efficiency is the median over rounds of ideal / its time in the same
round, so drifts in the machine's load hit both sides of the ratio.
    vs ideal        the baseline run by min(N, cores) ranks at once, timed to the slowest: every core busy and
                    the slowest rank counting, as in the layouts' runs (on a shared 2-core VM one busy core more
                    costs 10-15% by itself, which no code can win back);
    vs ideal alone  the baseline run by rank 0 alone on an otherwise idle machine.
The ranks keep freed memory (see harness.retain_freed_memory; --system-malloc turns that off), so that, as on a
GPU, allocating a fresh tensor costs no page faults. Timing is not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

import megatron_2d
from megatron_2d.groups import build_groups_for_layout
from megatron_2d.layout.topology import Layout2D
from megatron_2d.testing.distributed import run_on_ranks

from ..cli import add_arguments, add_malloc_argument, add_output_arguments, render_table
from .cluster import add_cluster_arguments, bench_cluster
from .harness import (
    DTYPES,
    bench_layouts,
    idle,
    label,
    layout_record,
    make_inputs,
    retain_freed_memory,
    round_order,
    single_process_step,
)


@dataclass
class Row:
    layout: Layout2D
    seconds: float
    efficiency: float  # against the ideal with every core busy (see the module docstring)
    efficiency_alone: float  # against the ideal of one process alone on an idle machine
    bytes_sent: dict[str, int]


def bench_rank(rank, world, args, layouts, dtype):
    """On each rank: build every layout's groups, then time rounds. A round times the single-process baseline
    twice, rank 0 alone and then the first min(N, cores) ranks at once, and then fwd+bwd of every layout (in an
    order that rotates from round to round). Every time is barrier to barrier, so it is the slowest rank's.

    Returns ({"alone": seconds per round, "busy": seconds per round}, [(seconds per round, bytes) per layout])."""
    if not args.system_malloc:
        retain_freed_memory()
    timeout = datetime.timedelta(seconds=args.timeout)
    all_groups = [build_groups_for_layout(lay, [list(range(world))], timeout=timeout) for lay in layouts]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in make_inputs(args, dtype))
    share = min(world, os.cpu_count() or 1)
    baseline = single_process_step(args, dtype) if rank < share else None
    single = {"alone": [], "busy": []}
    times = [[] for _ in layouts]
    rounds = range(args.repeats + 1)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc=f"{world} ranks", unit="round", file=sys.stderr)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def layout_step(groups) -> None:
        ql, kl, vl = (x.detach().requires_grad_(True) for x in (q, k, v))  # fresh leaves, no copy
        groups.comm_bytes.reset()
        megatron_2d.attention_2d(ql, kl, vl, groups, causal=args.causal).backward(dout)

    for i in rounds:  # round 0 warms up
        alone = timed(baseline if rank == 0 else idle)
        busy = timed(baseline or idle)
        if i:
            single["alone"].append(alone)
            single["busy"].append(busy)
        for j in round_order(range(len(layouts)), i):
            seconds = timed(lambda: layout_step(all_groups[j]))
            if i:
                times[j].append(seconds)
    return single, [(t, groups.comm_bytes.as_dict()) for t, groups in zip(times, all_groups)]


def run_benchmark(args, rank_setup=None):
    """(rows, single-process seconds {"alone", "busy"}, the share of cores the ideal divides by). A layout's
    efficiency is the median over rounds of ideal / its time in the same round."""
    dtype = DTYPES[args.dtype]
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    layouts = bench_layouts(args.ranks, args.heads)  # hp must divide the query heads
    share = min(args.ranks, os.cpu_count() or 1)  # the ideal: the single process's time / share
    per_rank = run_on_ranks(
        args.ranks, bench_rank, args, layouts, dtype, timeout_s=args.timeout * 20, rank_setup=rank_setup
    )
    single = per_rank[0][0]
    rows = []
    for i, layout in enumerate(layouts):
        seconds, sent = per_rank[0][1][i]  # barrier-timed: the same on every rank

        def efficiency(baseline):
            return statistics.median(s / share / t for s, t in zip(baseline, seconds))

        rows.append(
            Row(layout, statistics.median(seconds), efficiency(single["busy"]), efficiency(single["alone"]), sent)
        )
    rows.sort(key=lambda r: r.seconds)
    return rows, {kind: statistics.median(t) for kind, t in single.items()}, share


def print_table(rows: list[Row], args, single: dict[str, float], share: int) -> None:
    title = (
        f"attention_2d fwd+bwd, {args.ranks} CPU ranks, S={args.seq} b={args.batch} hq={args.heads} "
        f"hkv={args.kv_heads} d={args.dim} {args.dtype} {'causal' if args.causal else 'full'}; single-process "
        f"{single['busy'] * 1e3:.0f} ms with {share} cores busy ({single['alone'] * 1e3:.0f} ms alone), ideal = "
        f"single / {share}"
    )
    header = ["layout", "time ms", "vs ideal", "vs ideal alone", "a2a MiB", "inner MiB", "outer MiB"]
    body = [
        [label(r.layout), f"{r.seconds * 1e3:.0f}", f"{100 * r.efficiency:.0f}%", f"{100 * r.efficiency_alone:.0f}%"]
        + [f"{r.bytes_sent[k] / 2**20:.2f}" for k in ("all_to_all", "inner_ring", "outer_ring")]
        for r in rows
    ]
    render_table(title, header, body)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p, ranks=8, seq=4096, batch=1, heads=8, kv_heads=8, dim=64, repeats=5, timeout=120.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    add_malloc_argument(p)
    add_output_arguments(p)
    add_cluster_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_cluster(args, args.ranks, DTYPES[args.dtype]) as cluster:
        rows, single, share = run_benchmark(args, rank_setup=cluster.rank_setup if cluster else None)
    print_table(rows, args, single, share)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "cluster": cluster.to_dict() if cluster else None,
                    "single_s": single,
                    "cores_shared": share,
                    "rows": [
                        dict(
                            layout=layout_record(r.layout),
                            seconds=r.seconds,
                            efficiency=r.efficiency,
                            efficiency_alone=r.efficiency_alone,
                            bytes_sent=r.bytes_sent,
                            label=label(r.layout),
                        )
                        for r in rows
                    ],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
