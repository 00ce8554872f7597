"""Generated Megatron configurations against their CP = 1 reference, as many as asked.

    python tools/fuzz_megatron.py --draws 300 --seed 1000     # scenarios 1000, 1001, ..., 3 draws each
    python tools/fuzz_megatron.py --replay 1234:2             # one draw again (scenario seed : draw index)

Each draw forks its world (up to 8 CPU ranks) and trains a few iterations through Megatron's schedule; each
scenario's reference is computed once (see dev/megatron_2d_dev/generated_configs.py for what a draw varies and
dev/megatron_2d_dev/config_runs.py for what is compared). Every failure prints its replay command; the counts of
passed, refused (by rule) and skipped (by rule) draws are printed at the end; the exit status is 1 when any draw
failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch
from tqdm import tqdm

from megatron_2d_dev.config_runs import Outcome, run_configuration
from megatron_2d_dev.generated_configs import DRAWS_PER_SCENARIO, draw_config
from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims
from megatron_2d_dev.megatron_cpu import install_megatron_cpu_shims


def summary(outcomes: list[Outcome], seconds: float) -> str:
    """The counts by status and by rule, and the slowest draw."""
    by_status = collections.Counter(o.status for o in outcomes)
    rules = collections.Counter(
        f"{o.status} {o.detail.split(':', 1)[0]}" for o in outcomes if o.status in ("refused", "skipped")
    )
    slowest = max(outcomes, key=lambda o: o.seconds, default=None)
    lines = [
        f"{len(outcomes)} draws in {seconds:.0f} s: "
        + ", ".join(f"{by_status[s]} {s}" for s in ("pass", "refused", "skipped", "fail")),
        *(f"  {n:4d} {rule}" for rule, n in sorted(rules.items())),
    ]
    for dtype in sorted({o.draw.scenario.dtype for o in outcomes if o.errors}):
        compared = [o.errors for o in outcomes if o.errors and o.draw.scenario.dtype == dtype]
        worst = {k: max(e[k] for e in compared) for k in compared[0]}
        lines.append(f"largest errors of the {len(compared)} compared {dtype} draws: " + _errors(worst))
    floored = [f"{o.draw.scenario.seed}:{o.draw.index}" for o in outcomes if o.errors.get("floored")]
    lines.append(f"passed within the perturbed twin's floor but not the table's bounds: {len(floored)} {floored}")
    if slowest is not None:
        lines.append(f"slowest draw {slowest.draw.scenario.seed}:{slowest.draw.index} ({slowest.seconds:.1f} s)")
    return "\n".join(lines)


def _errors(errors: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.1e}" for k, v in errors.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=30, help="how many draws in all (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="first scenario seed; scenarios take seed, seed+1, ...")
    parser.add_argument("--replay", metavar="SEED:INDEX", help="run one draw again and print its result")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--log", metavar="PATH", help="append each draw's outcome line to PATH as it finishes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    install_megatron_cpu_shims(import_training=True)
    install_hybrid_cpu_shims()
    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        outcome = run_configuration(draw_config(seed, index), timeout_s=args.timeout)
        print(outcome.line())
        return 1 if outcome.status == "fail" else 0
    start, outcomes = time.perf_counter(), []
    with tqdm(total=args.draws, unit="draw") as bar:
        seed = args.seed
        while len(outcomes) < args.draws:
            references: dict = {}  # one scenario's references
            for index in range(min(DRAWS_PER_SCENARIO, args.draws - len(outcomes))):
                outcome = run_configuration(draw_config(seed, index), references, timeout_s=args.timeout)
                if outcome.status == "fail":
                    tqdm.write(f"{outcome.line()} [{_errors(outcome.errors)}]")
                if args.log:
                    with open(args.log, "a") as log:
                        log.write(f"{outcome.seconds:.1f}s {outcome.line()}\n")
                outcomes.append(outcome)
                bar.update(1)
            seed += 1
    print(summary(outcomes, time.perf_counter() - start))
    return 1 if any(o.status == "fail" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
