"""Generated exactness cases for attention_2d against the per-document fp64 oracle, as many as asked.

    python tools/fuzz_attention.py --draws 2000            # batches of --per-batch draws, seeds from --seed
    python tools/fuzz_attention.py --replay 1234:5         # one draw again (batch seed : draw index)

Each batch forks its world's ranks once (world 1-8, a random 2D layout) and runs its draws there; see
dev/megatron_2d_dev/generated_cases.py for what a draw varies. Every failure prints its replay command; the exit
status is 1 when any draw failed. The summary gives the largest max logit error per dtype (the draws that ask for
it), against its bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.testing.distributed import RankFailure, run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, rel_err
from megatron_2d_dev.generated_cases import draw_batch, draw_case, expected_results, failures, run_batch


def run(batch_seed: int, indices, modes, max_world: int):
    """(failure lines, seconds, [(dtype, max logit error)] of the draws that ask for it) of some draws of one
    batch."""
    batch = draw_batch(batch_seed, max_world)
    draws = [draw_case(batch, i, modes) for i in indices]
    start = time.perf_counter()
    expected = [expected_results(d) for d in draws]
    try:
        per_rank = run_on_ranks(batch.world, run_batch, batch, draws, expected, timeout_s=300)
    except RankFailure as err:
        return (
            [
                f"batch {batch_seed} (world {batch.world}, hp {batch.hp}, w {batch.w}, {batch.placement}) raised: "
                f"{err}\n  draws: " + "\n  ".join(d.describe() for d in draws)
            ],
            time.perf_counter() - start,
            [],
        )
    bounds, logits = [e[-1] for e in expected], [e[-2] for e in expected]
    logit_errors = [
        (d.dtype, max(rel_err(r[j]["max_logit"], logits[j]) for r in per_rank))
        for j, d in enumerate(draws)
        if d.max_logit
    ]
    return failures(batch, draws, per_rank, bounds, logits), time.perf_counter() - start, logit_errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200, help="how many draws in all (default 200)")
    parser.add_argument("--per-batch", type=int, default=8, help="draws per forked batch (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="first batch seed; batches take seed, seed+1, ...")
    parser.add_argument("--max-world", type=int, default=8, help="largest world size drawn (default 8)")
    parser.add_argument("--replay", metavar="BATCH:DRAW", help="run one draw again and print its result")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.replay:
        batch_seed, index = (int(x) for x in args.replay.split(":"))
        problems, _, _ = run(batch_seed, [index], PACKING_MODES, args.max_world)
        print("\n".join(problems) if problems else f"draw {args.replay}: exact")
        return 1 if problems else 0
    start, done, problems, slowest, logit_errors = time.perf_counter(), 0, [], (0.0, None), []
    with tqdm(total=args.draws, unit="draw") as bar:
        seed = args.seed
        while done < args.draws:
            n = min(args.per_batch, args.draws - done)
            found, seconds, errors = run(seed, range(n), PACKING_MODES, args.max_world)
            logit_errors += errors
            slowest = max(slowest, (seconds, seed), key=lambda x: x[0])
            for line in found:
                tqdm.write(f"FAIL {line}")
            problems += found
            done, seed = done + n, seed + 1
            bar.update(n)
    print(
        f"{done} draws in {seed - args.seed} batches (seeds {args.seed}..{seed - 1}), "
        f"{time.perf_counter() - start:.0f} s; slowest batch {slowest[1]} ({slowest[0]:.1f} s); "
        f"{len(problems)} failed"
    )
    for dtype in sorted({d for d, _ in logit_errors}):
        errors = [e for d, e in logit_errors if d == dtype]
        bound = TOLERANCES[getattr(torch, dtype)].max_logit
        print(f"max logit, {dtype}: {len(errors)} draws, largest error {max(errors):.2e} (bound {bound:.0e})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
