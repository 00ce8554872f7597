"""Sliding-window attention under 2D: time and bytes against full causal, and the CPU kernel's banded speed.

    python tools/bench_window.py --ranks 4            # windows of S/64, S/16, S/4 and full causal

Two tables. (1) attention_2d fwd+bwd on N forked CPU ranks for a few layouts: median time, time relative to the
same layout's full causal run, and the bytes one rank sends (ring + neighbour exchange + all-to-all). (2) The CPU
block kernel alone: a window of L keys over S queries (tiled, see kernels/cpu_flash.py) against the unwindowed
causal kernel on a square block with the same number of visible pairs; the ratio is visible pairs per second.
Timing is not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import datetime

import torch

import megatron_2d
from megatron_2d.kernels import select_kernel
from megatron_2d.layout.band import Band
from megatron_2d.testing.distributed import run_on_ranks

from ..cli import add_arguments, render_table
from .harness import mib, time_call

LAYOUTS = [(1, 1, "head_first"), (1, 2, "head_first"), (2, 1, "head_first")]  # (hp, Double-Ring w, placement)


def _time(fn, repeats: int) -> float:
    return time_call(fn, repeats)


def bench_rank(rank, world, args, windows: list[tuple[str, int]]) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    S = args.seq
    full = [torch.randn(S, 1, args.heads, args.dim, generator=g) for _ in range(4)]
    q, k, v, dout = (megatron_2d.shard_sequence(x, rank, world) for x in full)
    for hp, w, placement in LAYOUTS:
        if world % hp or (world // hp) % w:
            continue
        groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=datetime.timedelta(seconds=120))
        for name, left in windows:
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

            def step():
                megatron_2d.attention_2d(*leaves, groups, causal=True, sliding_window=(left, 0)).backward(dout)

            groups.comm_bytes.reset()
            step()
            sent = groups.comm_bytes.as_dict()
            seconds = _time(step, args.repeats)
            out[(hp, w, placement, name)] = (seconds, sent)
    return out


def kernel_rows(args) -> list[tuple[str, float, float, float]]:
    """(window, banded seconds, causal seconds on the same visible pairs, pairs/s ratio) on one thread."""
    torch.set_num_threads(1)
    kernel = select_kernel(torch.device("cpu"), torch.float32)
    S, h, d = args.seq, args.heads, args.dim
    rows = []
    for name, left in windows_of(S)[:-1]:
        pairs = sum(min(i, left) + 1 for i in range(S))
        n = int((2 * pairs) ** 0.5)  # causal n x n block: n(n+1)/2 pairs
        q, k, v, do = (torch.randn(1, S, h, d) for _ in range(4))
        qs, ks, vs, dos = (x[:, :n].contiguous() for x in (q, k, v, do))

        def banded():
            out, lse = kernel.forward(q, k, v, Band(-left, 0), d**-0.5)
            kernel.backward(do, q, k, v, out, lse, Band(-left, 0), d**-0.5)

        def causal():
            out, lse = kernel.forward(qs, ks, vs, Band(None, 0), d**-0.5)
            kernel.backward(dos, qs, ks, vs, out, lse, Band(None, 0), d**-0.5)

        tb, tc = _time(banded, args.repeats), _time(causal, args.repeats)
        rows.append((name, tb, tc, (pairs / tb) / ((n * (n + 1) / 2) / tc)))
    return rows


def windows_of(S: int) -> list[tuple[str, int]]:
    return [("S/64", S // 64), ("S/16", S // 16), ("S/4", S // 4), ("full causal", -1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_arguments(parser, ranks=4, seq=4096, heads=8, dim=64, repeats=3).parse_args(argv)
    windows = windows_of(args.seq)
    results = run_on_ranks(args.ranks, bench_rank, args, windows, timeout_s=1800)
    body = []
    keys = sorted({key[:3] for key in results[0]})
    for hp, w, placement in keys:
        full_time = max(r[(hp, w, placement, "full causal")][0] for r in results)
        for name, _ in windows:
            seconds = max(r[(hp, w, placement, name)][0] for r in results)  # the slowest rank sets the pace
            sent = max((r[(hp, w, placement, name)][1] for r in results), key=lambda s: sum(s.values()))
            body.append(
                [
                    f"hp{hp} x cp{args.ranks // hp} w{w}",
                    name,
                    f"{seconds * 1e3:.0f}",
                    f"{seconds / full_time:.2f}",
                    mib(sum(sent.values())),
                    mib(sent["neighbour"]),
                    mib(sent["inner_ring"] + sent["outer_ring"]),
                    mib(sent["all_to_all"]),
                ]
            )
    render_table(
        f"attention_2d fwd+bwd, causal, fp32, S={args.seq}, {args.heads} heads, d={args.dim}, "
        f"{args.ranks} CPU ranks (bytes: the busiest rank)",
        ["layout", "window", "time ms", "vs full causal", "MiB sent", "of which neighbour", "ring", "a2a"],
        body,
    )
    render_table(
        f"CPU block kernel, one thread, fwd+bwd over S={args.seq} queries: banded (tiled) vs the "
        f"unwindowed causal kernel on the same number of visible pairs",
        ["window", "banded ms", "causal same-pairs ms", "pairs/s banded / causal"],
        [[name, f"{tb * 1e3:.1f}", f"{tc * 1e3:.1f}", f"{ratio:.2f}"] for name, tb, tc, ratio in kernel_rows(args)],
    )


if __name__ == "__main__":
    main()
