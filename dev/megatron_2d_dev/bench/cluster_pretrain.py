"""pretrain_gpt.py end to end on an emulated cluster, one torchrun per node as on a real one: step time per
iteration and the losses of each context-parallel mode, the same model, data and length.

    python tools/emulated_cluster.py pretrain --nodes 2 --ranks 8 --cluster dgx-h100 --gpu-seq 65536
    python tools/emulated_cluster.py pretrain --nodes 2 --ranks 8 --net-mbit 50 --modes 2d:2:4,2d:1:4,p2p,a2a+p2p:2

Every mode runs ``examples/launch/torchrun_gpt.sh`` on each node (:func:`megatron_2d_dev.cluster_launch.
run_torchrun_gpt`) with MODE, CP = ranks, HP, WINDOW, PLACEMENT and the model flags below (later flags win over
gpt_flags.sh's), ``--iters`` iterations. A mode's time is the median of its iterations after the first (Megatron's
``elapsed time per iteration``); rounds run every mode once, in an order that rotates from round to round, and a
mode's time is its median over rounds, each mode against the best 2D paired by round. The losses of the first round
are compared with CP = 1 (the same flags on one forked rank, stock pretrain_gpt.py, no cluster) at the bf16 training
tolerance (megatron_2d.testing.reference).

Modes: ``2d:HP:WINDOW[:PLACEMENT]`` (default every hp and window of CP that the planner lists), and stock Megatron
CP: ``p2p``, ``a2a``, ``a2a+p2p:A`` (``--hierarchical-context-parallel-sizes A CP/A``: a2a over A adjacent ranks,
the ring across), ``all_gather``. A stock mode runs the same pretrain_gpt.py flags with its ``--cp-comm-type`` and
the stock-CP spec (:data:`STOCK_SPEC`: megatron-core's local linears and norms, its own TEDotProductAttention over
Transformer Engine ``--te-release``'s context_parallel.py), each torchrun worker inside TE's CPU context
(:data:`megatron_2d_dev.cluster_worker.TE_RELEASE_ENV`; TE's fused attention is the CPU stand-in's kernel, the
cpu_flash kernel the 2D modes run). Modes TE refuses for the model's heads (its a2a level must divide the query and
the K/V heads: TE does not replicate K/V) are reported n/a with that reason, before any launch. Every side trains
in bf16 (gpt_flags.sh's ``--bf16``, the CP = 1 reference included), the only dtype besides fp16 that TE's fused
attention takes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from megatron_2d.layout.topology import divisors
from megatron_2d.testing.reference import TOLERANCES

from ..cli import render_table
from ..cluster_launch import LaunchFailure, check_runs, launch_flags, run_torchrun_gpt
from ..cluster_worker import TE_RELEASE_ENV
from .cluster import add_cluster_arguments, bench_cluster
from .harness import round_order
from .runners import TE_RELEASE

ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
STOCK_SPEC = ["--spec", "megatron_2d_dev.stock_cp_spec", "gpt_layer_spec_stock_cp"]
"""The layer spec of the stock modes (megatron_2d_dev.stock_cp_spec): stock CP as Megatron runs it, with the
linears on CPU."""


@dataclass(frozen=True)
class Mode:
    """One context-parallel mode as torchrun_gpt.sh takes it (its environment)."""

    mode: str
    hp: int = 1
    window: int = 1
    placement: str = "head_first"

    @property
    def name(self) -> str:
        if self.mode == "2d":
            return f"2d hp{self.hp} w{self.window} {self.placement}"
        return self.mode if self.mode != "a2a+p2p" else f"a2a+p2p [{self.hp}]"

    def a2a_size(self, cp: int) -> int:
        """The ranks of a stock mode's head all-to-all (1: none)."""
        return {"a2a": cp, "a2a+p2p": self.hp}.get(self.mode, 1)

    def env(self, cp: int) -> dict[str, str]:
        return {
            "MODE": self.mode,
            "CP": str(cp),
            "HP": str(self.hp),
            "WINDOW": str(self.window),
            "PLACEMENT": self.placement,
        }

    @property
    def stock(self) -> bool:
        return self.mode != "2d"


def parse_modes(text: str, cp: int) -> list[Mode]:
    """--modes: comma-separated ``2d:HP:W[:PLACEMENT]``, ``p2p``, ``a2a``, ``a2a+p2p:A``, ``all_gather`` or
    ``all``."""
    if text == "all":
        modes = [
            Mode("2d", hp, w, p)
            for hp in divisors(cp)
            for w in divisors(cp // hp)
            for p in (("head_first", "context_first") if 1 < hp < cp else ("head_first",))
            if w > 1 or hp == cp
        ]
        stock = [Mode("p2p"), Mode("a2a")] + [Mode("a2a+p2p", a) for a in divisors(cp)[1:-1]]
        return modes + stock + [Mode("all_gather")]
    modes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if parts[0] == "2d" and len(parts) in (3, 4):
            modes.append(Mode("2d", int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else "head_first"))
        elif parts[0] in ("p2p", "a2a", "all_gather") and len(parts) == 1:
            modes.append(Mode(parts[0]))
        elif parts[0] == "a2a+p2p" and len(parts) == 2:
            modes.append(Mode("a2a+p2p", int(parts[1])))
        else:
            raise argparse.ArgumentTypeError(
                f"mode {item!r}: expected 2d:HP:W[:PLACEMENT], p2p, a2a, a2a+p2p:A or all_gather"
            )
    return modes


def model_flags(args) -> list[str]:
    """The model (later flags win over gpt_flags.sh's 7B): the CPU-size shape of the flags, no warm-up, no
    swiglu fusion (its torch.compile takes ~20 s of the first iteration per CPU rank)."""
    return [
        *("--num-layers", str(args.layers), "--hidden-size", str(args.hidden)),
        *("--ffn-hidden-size", str(4 * args.hidden), "--num-attention-heads", str(args.heads)),
        *("--num-query-groups", str(args.kv_heads), "--vocab-size", "1024", "--make-vocab-size-divisible-by", "128"),
        *("--lr-warmup-iters", "0", "--distributed-timeout-minutes", str(max(1, math.ceil(args.timeout / 60)))),
        "--no-bias-swiglu-fusion",
    ]


def stock_refusal(mode: Mode, args) -> str | None:
    """Why stock ``mode`` cannot run this job (None: it can): TE not installed, or a head all-to-all that does not
    divide CP, the query heads or the K/V heads (TE does not replicate K/V)."""
    from .. import te_package

    if not te_package.is_installed(args.te_release):
        return (
            f"Transformer Engine {args.te_release} is not installed under {te_package.releases_dir()} "
            f"(python -m megatron_2d_dev.te_package install)"
        )
    a2a, cp = mode.a2a_size(args.ranks), args.ranks
    if cp % a2a or args.heads % a2a or args.kv_heads % a2a:
        return (
            f"TE's {mode.mode} needs its all-to-all of {a2a} ranks to divide CP={cp}, the {args.heads} query heads "
            f"and the {args.kv_heads} K/V heads"
        )
    return None


def launch_of(mode: Mode, cp: int, env: dict[str, str], flags: list[str], te_release: str):
    """(torchrun_gpt.sh's environment, the ranks' extra flags) of ``mode``: a stock mode adds the TE release its
    workers run in and the stock-CP spec."""
    if not mode.stock:
        return env | mode.env(cp), flags
    return env | mode.env(cp) | {TE_RELEASE_ENV: te_release}, flags + STOCK_SPEC


@dataclass
class ModeResult:
    name: str
    status: str = "ok"
    round_seconds: list[float] = field(default_factory=list)
    """Per round: the median iteration time after the first."""
    losses: dict[int, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.round_seconds) if self.round_seconds else None


def iteration_seconds(log: str) -> dict[int, float]:
    return {int(it): float(ms) / 1e3 for it, ms in ELAPSED.findall(log)}


def run(args) -> tuple[list[ModeResult], dict[int, float], object]:
    """Every mode over ``args.rounds`` rounds on the cluster; (results, CP=1 losses, the cluster's figures)."""
    from ..megatron_lm import copy_scripts
    from ..pretrain_runs import lm_losses, run_pretrain

    cp = args.ranks
    modes = parse_modes(args.modes, cp)
    env = {"SEQ": str(args.seq), "TRAIN_ITERS": str(args.iters), "GBS": "1", "MBS": "1"}
    flags = model_flags(args)
    results = {m.name: ModeResult(m.name) for m in modes}
    runnable = []
    for m in modes:
        why = stock_refusal(m, args) if m.stock else None
        if why:
            results[m.name].status = f"n/a: {why}"
        else:
            runnable.append(m)
    with tempfile.TemporaryDirectory(prefix="m2d_cluster_pretrain_") as tmp:
        script = copy_scripts(tmp)
        megatron_lm = str(script.parent)
        reference = lm_losses(run_pretrain(1, str(script), launch_flags(env) + flags, timeout_s=args.timeout)[-1])
        with bench_cluster(args, args.ranks, torch.bfloat16) as cluster:
            for r in range(args.rounds):
                for i in round_order(list(range(len(runnable))), r):
                    mode = runnable[i]
                    result = results[mode.name]
                    if result.status != "ok":
                        continue
                    mode_env, rank_flags = launch_of(mode, cp, env, flags, args.te_release)
                    runs = run_torchrun_gpt(
                        cluster.cluster, mode_env, rank_flags, timeout_s=args.timeout, megatron_lm_dir=megatron_lm
                    )
                    try:
                        check_runs(runs, f"{mode.name}, round {r}")
                    except LaunchFailure as err:
                        result.status = f"ERROR: {str(err).splitlines()[0]}"
                        print(err)
                        continue
                    times = iteration_seconds(runs[-1].log)
                    steady = [t for it, t in times.items() if it > 1] or list(times.values())
                    result.round_seconds.append(statistics.median(steady))
                    if not result.losses:
                        result.losses = lm_losses(runs[-1].log)
                    print(f"round {r}: {mode.name}: {statistics.median(steady) * 1e3:.0f} ms per iteration", flush=True)
    return list(results.values()), reference, cluster


def loss_check(result: ModeResult, reference: dict[int, float]) -> str:
    """'ok' when every iteration's loss is within the bf16 training tolerance of CP = 1, else the worst."""
    if not result.losses:
        return "-"
    tol = TOLERANCES[torch.bfloat16].training.loss
    worst = max(abs(result.losses[i] - reference[i]) / abs(reference[i]) for i in result.losses if i in reference)
    return f"{'ok' if worst <= tol else 'DIFFERS'} {worst:.1e}"


def print_results(results: list[ModeResult], reference: dict[int, float], args) -> None:
    timed = [r for r in results if r.seconds is not None]
    best2d = min((r for r in timed if r.name.startswith("2d")), key=lambda r: r.seconds, default=None)
    body = []
    for r in sorted(results, key=lambda r: (r.seconds is None, r.seconds or 0.0)):
        if r.seconds is None:
            body.append([r.name, r.status.split(":")[0], "-", "-"])
            continue
        rounds = [a / b for a, b in zip(r.round_seconds, best2d.round_seconds)] if best2d else []
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        body.append(
            [r.name, f"{r.seconds * 1e3:.0f}", f"{r.seconds / best2d.seconds:.2f} ({spread})", loss_check(r, reference)]
        )
    render_table(
        f"pretrain_gpt.py, one torchrun per node, {args.ranks} ranks (CP = {args.ranks}): {args.layers} layers, "
        f"hidden {args.hidden}, {args.heads} heads / {args.kv_heads} groups, S = {args.seq}, bf16; median over "
        f"{args.rounds} rounds of each launch's median iteration after the first",
        ["mode", "ms / iteration", "x vs best 2D (per round)", "losses vs CP=1"],
        body,
    )
    best_stock = min((r for r in timed if not r.name.startswith("2d")), key=lambda r: r.seconds, default=None)
    if best2d and best_stock:
        rounds = [a / b for a, b in zip(best_stock.round_seconds, best2d.round_seconds)]
        print(
            f"best 2D ({best2d.name}) against best stock ({best_stock.name}): "
            f"{best_stock.seconds / best2d.seconds:.2f}x (per round {min(rounds):.2f}-{max(rounds):.2f}; above 1: "
            f"2D faster)"
        )
    for r in results:
        if r.status != "ok":
            print(f"{r.name}: {r.status}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="ranks = CP (default 8)")
    p.add_argument("--modes", default="all", help="comma-separated modes (see the module), or all")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=4, help="iterations per launch (the first is not timed)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument(
        "--te-release",
        default=TE_RELEASE,
        help=f"the Transformer Engine release of the stock modes on CPU ranks (default {TE_RELEASE})",
    )
    p.add_argument("--json")
    add_cluster_arguments(p)
    args = p.parse_args(argv)
    args.dim, args.batch = args.hidden // args.heads, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.cluster or args.net_mbit):
        raise SystemExit("pretrain runs on an emulated cluster: give --cluster PRESET or --net-mbit RATE")
    results, reference, cluster = run(args)
    print_results(results, reference, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "cluster": cluster.to_dict() if cluster else None,
                    "reference_losses": reference,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=1,
            )
