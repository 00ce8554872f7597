"""Benchmark attention_2d forward+backward on N forked CPU ranks, for every 2D layout of CP = N.

    python tools/bench_attention.py --ranks 8                 # table on stdout (the script runs this module)
    python tools/bench_attention.py --ranks 4 --json out.json # also save the rows

Columns: layout (hp x cp, window, placement), median time of fwd+bwd, efficiency against ideal, and the bytes one
rank sends per fwd+bwd, by kind. Ideal is the single-process kernel time on the full problem (one thread), divided
by min(N, cores). Each round times that baseline (rank 0 alone, the other ranks waiting) and then every layout, in
an order that rotates from round to round; a layout's efficiency is the median over rounds of ideal / its time in
the same round, so drifts in the machine's load hit both sides of the ratio. Timing is not a test: the machines
are noisy, compare rows of one run.
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
from typing import Dict, List, Optional

import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.distributed import run_on_ranks

from ..groups import build_groups_for_layout
from ..topology import Layout2D
from .cli import add_arguments, add_output_arguments, render_table
from .harness import DTYPES, bench_layouts, label, layout_record, make_inputs, single_process_step


@dataclass
class Row:
    layout: Layout2D
    seconds: float
    efficiency: float
    bytes_sent: Dict[str, int]


def bench_rank(rank, world, args, layouts, dtype):
    """On each rank: build every layout's groups, then time rounds, each of the single-process baseline (rank 0
    alone, the others waiting) and of fwd+bwd of every layout (in an order that rotates from round to round).

    Returns (baseline seconds per round, [(seconds per round, bytes) per layout]); a layout's seconds is the
    slowest rank's, so only rank 0's baseline and every rank's layout times are meaningful."""
    timeout = datetime.timedelta(seconds=args.timeout)
    all_groups = [build_groups_for_layout(lay, [list(range(world))], timeout=timeout) for lay in layouts]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in make_inputs(args, dtype))
    baseline = single_process_step(args, dtype) if rank == 0 else None
    single, times = [], [[] for _ in layouts]
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
        ql, kl, vl = (x.detach().requires_grad_(True) for x in (q, k, v))   # fresh leaves, no copy
        groups.comm_bytes.reset()
        megatron_2d.attention_2d(ql, kl, vl, groups, causal=args.causal).backward(dout)

    for i in rounds:                              # round 0 warms up
        seconds = timed(baseline if baseline is not None else (lambda: None))
        if i:
            single.append(seconds)
        for j in (i + n for n in range(len(layouts))):
            seconds = timed(lambda: layout_step(all_groups[j % len(layouts)]))
            if i:
                times[j % len(layouts)].append(seconds)
    return single, [(t, groups.comm_bytes.as_dict()) for t, groups in zip(times, all_groups)]


def run_benchmark(args) -> List[Row]:
    """Every layout's row; a layout's efficiency is the median over rounds of ideal / its time in that round."""
    dtype = DTYPES[args.dtype]
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    layouts = bench_layouts(args.ranks, args.heads)  # hp must divide the query heads
    share = min(args.ranks, os.cpu_count() or 1)     # the ideal: the single process's time / share
    per_rank = run_on_ranks(args.ranks, bench_rank, args, layouts, dtype, timeout_s=args.timeout * 20)
    single = per_rank[0][0]
    rows = []
    for i, layout in enumerate(layouts):
        seconds = [max(r[1][i][0][n] for r in per_rank) for n in range(len(single))]   # the slowest rank's
        sent = {kind: max(r[1][i][1][kind] for r in per_rank) for kind in per_rank[0][1][i][1]}
        ratio = statistics.median(s / share / t for s, t in zip(single, seconds))
        rows.append(Row(layout, statistics.median(seconds), ratio, sent))
    rows.sort(key=lambda r: r.seconds)
    return rows, statistics.median(single), statistics.median(single) / share


def print_table(rows: List[Row], args, single: float, ideal: float) -> None:
    title = (f"attention_2d fwd+bwd, {args.ranks} CPU ranks, S={args.seq} b={args.batch} hq={args.heads} "
             f"hkv={args.kv_heads} d={args.dim} {args.dtype} {'causal' if args.causal else 'full'}; "
             f"single-process {single * 1e3:.0f} ms, ideal {ideal * 1e3:.0f} ms")
    header = ["layout", "time ms", "vs ideal", "a2a MiB", "inner MiB", "outer MiB"]
    body = [[label(r.layout), f"{r.seconds * 1e3:.0f}", f"{100 * r.efficiency:.0f}%"] +
            [f"{r.bytes_sent[k] / 2**20:.2f}" for k in ("all_to_all", "inner_ring", "outer_ring")] for r in rows]
    render_table(title, header, body)


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, ranks=8, seq=4096, batch=1, heads=8, kv_heads=8, dim=64, repeats=5, timeout=120.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    add_output_arguments(p)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    rows, single, ideal = run_benchmark(args)
    print_table(rows, args, single, ideal)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "single_s": single, "ideal_s": ideal,
                       "rows": [dict(layout=layout_record(r.layout), seconds=r.seconds, efficiency=r.efficiency,
                                     bytes_sent=r.bytes_sent, label=label(r.layout)) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
