"""Double-Ring window w on CPU ranks: forward and backward time of each w for one context group.

    python tools/bench_double_ring.py --ranks 4      # hp = 1, w in every divisor of cp; fwd and bwd separately

Times are medians over ``--repeats`` of the slowest rank, one run; compare rows of one run (the machine is
noisy). On CPU ranks every "link" is a gloo memcpy on the same cores, so this checks the schedule's overheads
(posting, waiting, the aligning and closing hops), not the network overlap a GPU cluster would show.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch
from rich.console import Console
from rich.table import Table

import megatron_2d
from megatron_2d.testing.distributed import run_on_ranks


def bench_rank(rank: int, world: int, args, windows: List[int]) -> Dict[int, Tuple[float, float]]:
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(args.seq, 1, args.heads, args.dim, generator=g) for _ in range(4)]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in full)
    out = {}
    for w in windows:
        groups = megatron_2d.build_2d_groups(args.hp, w, timeout=datetime.timedelta(seconds=300))
        fwd, bwd = [], []
        for i in range(args.repeats + 1):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            o = megatron_2d.attention_2d(*leaves, groups)
            t1 = time.perf_counter()
            o.backward(dout)
            t2 = time.perf_counter()
            if i:                                  # the first call builds the setup
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        out[w] = (statistics.median(fwd), statistics.median(bwd))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cp = args.ranks // args.hp
    windows = [w for w in range(1, cp + 1) if cp % w == 0]
    results = run_on_ranks(args.ranks, bench_rank, args, windows, timeout_s=1800)
    table = Table(title=f"attention_2d on {args.ranks} CPU ranks, hp {args.hp} x cp {cp}, causal fp32, S={args.seq}, "
                        f"{args.heads} heads, d={args.dim} (slowest rank, median of {args.repeats})")
    for col in ("w", "windows", "forward ms", "backward ms", "backward vs w=1", "backward vs w=cp"):
        table.add_column(col, justify="right")
    slowest = {w: tuple(max(r[w][i] for r in results) for i in (0, 1)) for w in windows}
    for w in windows:
        f, b = slowest[w]
        table.add_row(str(w), str(cp // w), f"{f * 1e3:.0f}", f"{b * 1e3:.0f}", f"{b / slowest[1][1]:.2f}",
                      f"{b / slowest[cp][1]:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
