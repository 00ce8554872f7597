#!/usr/bin/env python
"""Benchmark attention_2d forward+backward on N forked CPU ranks, for every 2D layout of CP = N.

    python tools/bench_attention.py --ranks 8                 # table on stdout
    python tools/bench_attention.py --ranks 4 --json out.json # also save the rows

Columns: layout (hp x cp, window, placement), median time of fwd+bwd, efficiency against ideal
(single-process kernel time on the full problem, one thread, divided by min(N, cores)), and the bytes one rank
sends per fwd+bwd, by kind. Timing is not a test: the machines are noisy, compare rows of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.band import Band
from megatron_2d.kernels import select_kernel
from megatron_2d.testing.distributed import run_on_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Layout:
    hp: int
    cp: int
    w: int
    placement: str

    @property
    def label(self) -> str:
        return f"hp{self.hp} x cp{self.cp}  w{self.w}  {self.placement}"


@dataclass
class Row:
    layout: Layout
    seconds: float
    efficiency: float
    bytes_sent: Dict[str, int]


def all_layouts(cp_size: int) -> List[Layout]:
    """Every (hp, cp, w, placement) of one CP group; placements coincide when hp or cp is 1 (listed once)."""
    out = []
    for hp in (d for d in range(1, cp_size + 1) if cp_size % d == 0):
        cp = cp_size // hp
        for w in (d for d in range(1, cp + 1) if cp % d == 0):
            for placement in (("head_first",) if hp == 1 or cp == 1 else megatron_2d.PLACEMENTS):
                out.append(Layout(hp, cp, w, placement))
    return out


def make_inputs(args, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_q = (args.seq, args.batch, args.heads, args.dim)
    shape_kv = (args.seq, args.batch, args.kv_heads, args.dim)
    return [torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def time_single_process(args, dtype, device: str = "cpu") -> float:
    """Median seconds of the local kernel's fwd+bwd on the full, unsharded problem, on one thread (or one GPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kernel = select_kernel(dev, dtype)
    q, k, v, dout = (x.transpose(0, 1).contiguous().to(dev) for x in make_inputs(args, dtype))  # [b, s, h, d]
    scale = args.dim ** -0.5
    band = Band(None, 0) if args.causal else None      # the kernels take a band since sliding windows landed
    times = []
    for i in range(args.repeats + 1):
        sync()
        t0 = time.perf_counter()
        out, lse = kernel.forward(q, k, v, band, scale)
        kernel.backward(dout, q, k, v, out, lse, band, scale)
        sync()
        if i:  # the first run warms up
            times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(times)


def bench_rank(rank, world, args, layouts, dtype):
    """On each rank: build every layout's groups, then time fwd+bwd of each; returns (seconds, bytes) per layout."""
    timeout = datetime.timedelta(seconds=args.timeout)
    all_groups = [megatron_2d.build_2d_groups(lay.hp, lay.w, lay.placement, timeout=timeout) for lay in layouts]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in make_inputs(args, dtype))
    results = []
    progress = layouts
    if rank == 0 and not args.quiet:
        from tqdm import tqdm
        progress = tqdm(layouts, desc=f"{world} ranks", unit="layout", file=sys.stderr)
    for layout, groups in zip(progress, all_groups):
        times = []
        for i in range(args.repeats + 1):
            ql, kl, vl = (x.clone().requires_grad_(True) for x in (q, k, v))
            groups.comm_bytes.reset()
            dist.barrier()
            t0 = time.perf_counter()
            megatron_2d.attention_2d(ql, kl, vl, groups, causal=args.causal).backward(dout)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
        results.append((statistics.median(times), groups.comm_bytes.as_dict()))
    return results


def run_benchmark(args) -> List[Row]:
    dtype = DTYPES[args.dtype]
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    layouts = [lay for lay in all_layouts(args.ranks)
               if args.heads % lay.hp == 0]  # hp must divide the query heads
    single = time_single_process(args, dtype)
    ideal = single / min(args.ranks, os.cpu_count() or 1)
    per_rank = run_on_ranks(args.ranks, bench_rank, args, layouts, dtype, timeout_s=args.timeout * 20)
    rows = []
    for i, layout in enumerate(layouts):
        seconds = max(r[i][0] for r in per_rank)
        sent = {kind: max(r[i][1][kind] for r in per_rank) for kind in per_rank[0][i][1]}
        rows.append(Row(layout, seconds, ideal / seconds, sent))
    rows.sort(key=lambda r: r.seconds)
    return rows, single, ideal


def print_table(rows: List[Row], args, single: float, ideal: float) -> None:
    title = (f"attention_2d fwd+bwd, {args.ranks} CPU ranks, S={args.seq} b={args.batch} hq={args.heads} "
             f"hkv={args.kv_heads} d={args.dim} {args.dtype} {'causal' if args.causal else 'full'}; "
             f"single-process {single * 1e3:.0f} ms, ideal {ideal * 1e3:.0f} ms")
    header = ["layout", "time ms", "vs ideal", "a2a MiB", "inner MiB", "outer MiB"]
    body = [[r.layout.label, f"{r.seconds * 1e3:.0f}", f"{100 * r.efficiency:.0f}%"] +
            [f"{r.bytes_sent[k] / 2**20:.2f}" for k in ("all_to_all", "inner_ring", "outer_ring")] for r in rows]
    render_table(title, header, body)


def render_table(title: str, header: List[str], body: List[List[str]], width: int = 140) -> None:
    """Print a table (rich when installed, else aligned plain text); the first column left-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(x) for x in col) for col in zip(header, *body)]
        for line in [header] + body:
            print("  ".join(x.rjust(n) if j else x.ljust(n) for j, (x, n) in enumerate(zip(line, widths))))
        return
    table = Table(title=title)
    for j, name in enumerate(header):
        table.add_column(name, justify="left" if j == 0 else "right")
    for line in body:
        table.add_row(*line)
    Console(width=width).print(table)


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="CPU ranks = CP size (default 8)")
    p.add_argument("--seq", type=int, default=4096, help="global sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per layout after one warm-up (median)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    rows, single, ideal = run_benchmark(args)
    print_table(rows, args, single, ideal)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "single_s": single, "ideal_s": ideal,
                       "rows": [dict(asdict(r), label=r.layout.label) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
