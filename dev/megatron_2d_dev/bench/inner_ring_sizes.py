"""Double-Ring inner ring size w on CPU ranks: forward and backward time of each w for one context group.

    python tools/bench_double_ring.py --ranks 4      # hp = 1, w in every divisor of cp; fwd and bwd separately

Times are medians over ``--repeats`` of the slowest rank, one run, the sizes taking turns within each repeat in an
order that rotates from repeat to repeat (the ranks keep freed memory: --system-malloc turns that off);
the ratios are medians of per-repeat ratios; compare rows of one run (the machine is noisy). On CPU ranks every "link"
is a gloo memcpy on the same cores, so this checks the schedule's overheads
(posting, waiting, the closing and last hops), not the network overlap a GPU cluster would show.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

import megatron_2d
from megatron_2d.layout.topology import divisors
from megatron_2d.testing.distributed import run_on_ranks

from ..cli import add_arguments, add_malloc_argument, render_table
from .cluster import add_cluster_arguments, bench_cluster
from .harness import retain_freed_memory, round_order


def bench_rank(rank: int, world: int, args, sizes: list[int]) -> dict[int, tuple[list[float], list[float]]]:
    """(forward, backward) seconds of every repeat, by inner ring size; the sizes take turns within each repeat, so a
    change of machine load (other jobs) hits every size alike; the order rotates, so that none always goes first."""
    if not args.system_malloc:
        retain_freed_memory()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(args.seq, 1, args.heads, args.dim, generator=g) for _ in range(4)]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in full)
    groups = {w: megatron_2d.build_2d_groups(args.hp, w, timeout=datetime.timedelta(seconds=300)) for w in sizes}
    out: dict[int, tuple[list[float], list[float]]] = {w: ([], []) for w in sizes}
    for i in range(args.repeats + 1):
        for w in round_order(sizes, i):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            o = megatron_2d.attention_2d(*leaves, groups[w])
            t1 = time.perf_counter()
            o.backward(dout)
            t2 = time.perf_counter()
            if i:  # the first call builds the setup
                out[w][0].append(t1 - t0)
                out[w][1].append(t2 - t1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, ranks=4, hp=1, seq=4096, heads=8, dim=64, repeats=3)
    args = add_cluster_arguments(add_malloc_argument(parser)).parse_args(argv)
    cp = args.ranks // args.hp
    sizes = divisors(cp)
    with bench_cluster(args, args.ranks, torch.float32) as cluster:
        setup = cluster.rank_setup if cluster else None
        results = run_on_ranks(args.ranks, bench_rank, args, sizes, timeout_s=1800, rank_setup=setup)
    # slowest rank of each repeat, then medians over repeats; ratios are medians of the per-repeat ratios
    slowest = {w: [[max(r[w][p][i] for r in results) for i in range(args.repeats)] for p in (0, 1)] for w in sizes}

    def ratio(w: int, base: int) -> float:
        return statistics.median(b / c for b, c in zip(slowest[w][1], slowest[base][1]))

    body = [
        [
            str(w),
            str(cp // w),
            f"{statistics.median(f) * 1e3:.0f}",
            f"{statistics.median(b) * 1e3:.0f}",
            f"{ratio(w, 1):.2f}",
            f"{ratio(w, cp):.2f}",
        ]
        for w, (f, b) in slowest.items()
    ]
    render_table(
        f"attention_2d on {args.ranks} CPU ranks, hp {args.hp} x cp {cp}, causal fp32, S={args.seq}, "
        f"{args.heads} heads, d={args.dim} (slowest rank, median of {args.repeats}, sizes interleaved; "
        f"ratios: median of per-repeat ratios)",
        ["w", "inner rings", "forward ms", "backward ms", "backward vs w=1", "backward vs w=cp"],
        body,
        width=120,
    )


if __name__ == "__main__":
    main()
