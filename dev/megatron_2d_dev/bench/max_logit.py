"""What QK-clip's max attention logit costs attention_2d, per kernel, on N forked CPU ranks.

    python tools/bench_max_logit.py --ranks 4            # hp 2 x cp 2; cpu_flash and torch_math; causal and a window

For each kernel and mask: the median time of forward + backward without ``return_max_logit`` and with it, and the
ratio (the median over rounds of with / without, the two timed back to back in each round, in an order that
alternates from round to round, so that a drift of the machine's load hits both); the same for the forward alone.
The CPU kernels (cpu_flash, torch_math) compute the max in a separate q k^T pass over each block
(:mod:`megatron_2d.kernels.max_logit`); te_fused takes it from Transformer Engine's launch (2.9 and later) and
cannot be timed here, nor can the other CUDA kernels (their CPU stand-ins time an emulation). Each call also
all-reduces the max over the head and the context group. Timing is not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.distributed import run_on_ranks

from ..cli import add_arguments, add_malloc_argument, add_output_arguments, render_table
from .harness import DTYPES, make_inputs, retain_freed_memory, round_order

KERNELS = ("cpu_flash", "torch_math")
"""The kernels that run on CPU."""


def masks(args) -> dict[str, tuple[bool, tuple[int, int]]]:
    """name -> (causal, sliding window): causal, full, and a causal window of ``--window`` tokens."""
    return {
        "causal": (True, (-1, -1)),
        "full": (False, (-1, -1)),
        f"causal window {args.window}": (True, (args.window, 0)),
    }


def bench_rank(rank, world, args, cases):
    """On each rank: the groups, then rounds; each times every case's step without and with the max logit, and
    its forward alone both ways, barrier to barrier (the slowest rank's). Returns {case: {(what, with max):
    [seconds per round]}}."""
    if not args.system_malloc:
        retain_freed_memory()
    groups = megatron_2d.build_2d_groups(args.hp, None, "head_first", timeout=datetime.timedelta(seconds=args.timeout))
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in make_inputs(args, DTYPES[args.dtype]))
    times = {case: {(what, m): [] for what in ("step", "forward") for m in (False, True)} for case in cases}
    rounds = range(args.repeats + 1)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds", unit="round", file=sys.stderr)

    def run(case, what: str, with_max: bool) -> float:
        kernel, (causal, window) = case[0], masks(args)[case[1]]
        ql, kl, vl = (x.detach().requires_grad_(what == "step") for x in (q, k, v))
        dist.barrier()
        t0 = time.perf_counter()
        out = megatron_2d.attention_2d(
            ql, kl, vl, groups, causal=causal, sliding_window=window, kernel=kernel, return_max_logit=with_max
        )
        out = out[0] if with_max else out
        if what == "step":
            out.backward(dout)
        dist.barrier()
        return time.perf_counter() - t0

    for i in rounds:  # round 0 warms up
        for j in round_order(range(len(cases)), i):
            for what in ("step", "forward"):
                for with_max in (bool(i % 2), not i % 2):  # which runs first alternates
                    seconds = run(cases[j], what, with_max)
                    if i:
                        times[cases[j]][(what, with_max)].append(seconds)
    return times


def run_benchmark(args) -> list[dict[str, object]]:
    """One row per (kernel, mask): median seconds without and with the max logit, and the median per-round
    ratios, for the step (forward + backward) and the forward."""
    if args.seq % (2 * args.ranks) or args.ranks % args.hp or args.heads % args.hp:
        raise SystemExit(f"--seq {args.seq} must divide by 2 * ranks and --hp {args.hp} divide ranks and heads")
    cases = [(kernel, mask) for kernel in args.kernels for mask in masks(args)]
    times = run_on_ranks(args.ranks, bench_rank, args, cases, timeout_s=args.timeout * 20)[0]
    rows = []
    for case in cases:
        t = times[case]
        row = {"kernel": case[0], "mask": case[1]}
        for what in ("step", "forward"):
            without, with_max = t[(what, False)], t[(what, True)]
            row[f"{what}_s"] = statistics.median(without)
            row[f"{what}_max_logit_s"] = statistics.median(with_max)
            row[f"{what}_ratio"] = statistics.median(w / o for w, o in zip(with_max, without))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(
        parser, ranks=4, hp=2, seq=4096, batch=1, heads=8, kv_heads=8, dim=64, repeats=5, window=256, timeout=120
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), help="kernels to time")
    add_malloc_argument(add_output_arguments(parser))
    args = parser.parse_args(argv)
    rows = run_benchmark(args)
    render_table(
        f"QK-clip's max logit on {args.ranks} CPU ranks (hp {args.hp} x cp {args.ranks // args.hp}), seq "
        f"{args.seq}, {args.heads} heads ({args.kv_heads} K/V) of {args.dim}, {args.dtype}: median of "
        f"{args.repeats} rounds",
        ["kernel", "mask", "step ms", "with max ms", "step ratio", "fwd ms", "with max ms", "fwd ratio"],
        [
            [
                r["kernel"],
                r["mask"],
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['step_max_logit_s'] * 1e3:.1f}",
                f"{r['step_ratio']:.3f}",
                f"{r['forward_s'] * 1e3:.1f}",
                f"{r['forward_max_logit_s'] * 1e3:.1f}",
                f"{r['forward_ratio']:.3f}",
            ]
            for r in rows
        ],
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
