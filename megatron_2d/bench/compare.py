"""Side-by-side fwd+bwd attention benchmark: every 2D layout of CP = N and the peers, same inputs, one run.

    python tools/bench_compare.py --ranks 4                  # CPU: N forked gloo ranks, bf16
    python tools/bench_compare.py --ranks 8 --json out.json  # also save the rows
    torchrun --nproc-per-node 8 tools/bench_compare.py --device cuda --seq 65536 --heads 32 --kv-heads 8 --dim 128

The rows (ours and the peers, and how the peers' bytes are counted): :mod:`megatron_2d.bench.runners`.

Correctness gate: before any timing every implementation runs once on the same zigzag-sharded inputs, and its
out, dq, dk, dv are compared with an fp64 reference (exact causal softmax attention, computed blockwise on the
ranks: megatron_2d.testing.reference.reference_on_rank). An implementation above the dtype's tolerance (the one
table, megatron_2d.testing.reference.TOLERANCES[dtype].gate) is reported as MISMATCH, one that raises as ERROR,
one that cannot run here as n/a; none of them is timed.

Columns
    time ms          median over --repeats rounds (after the check run and a warm-up round) of the slowest
                     rank; the rounds go round-robin over the implementations
    x vs <family>    time / the best time of that family in this run (2D (ours), each peer)
    vs ideal         ideal / time; ideal = single-process kernel fwd+bwd on the full problem / min(N, cores) on
                     CPU (one thread, as bench_attention.py; timed before and after the ranks, the smaller is
                     used and a drift is reported), / N on GPUs
    a2a, ring MiB    bytes one rank sends per fwd+bwd: ours measured (groups.comm_bytes), peers by closed form (f)
    err              max relative error, max |x - ref| / max |ref| over the whole tensor, of out/dq/dk/dv
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, reference_on_rank

from .cli import add_arguments, add_output_arguments, render_table
from .harness import DTYPES, make_inputs, time_single_process
from .runners import OURS, RING_FLASH, Impl, Runner, TEContextParallel, all_impls, ring_flash_impl, te_impls  # noqa: F401

TENSORS = ("out", "dq", "dk", "dv")


def _tolerance(dtype_name: str) -> float:
    return TOLERANCES[DTYPES[dtype_name]].gate


# -- the correctness gate ---------------------------------------------------------------------------------------


def error_parts(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[float]:
    """[max |x - ref|, max |ref|] for out, dq, dk, dv in turn (8 numbers), on this rank's shards."""
    parts = []
    for x, r in zip(got, ref):
        parts += [(x.to(torch.float64) - r).abs().max().item(), r.abs().max().item()]
    return parts


def relative_errors(parts: Sequence[float]) -> dict[str, float]:
    """{'out': ..., 'dq': ..., 'dk': ..., 'dv': ...} from the (all-reduced) output of :func:`error_parts`;
    a NaN anywhere gives NaN (so it fails the tolerance)."""
    errs = {}
    for i, name in enumerate(TENSORS):
        diff, scale = parts[2 * i], parts[2 * i + 1]
        errs[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return errs


def passes(errors: dict[str, float], dtype: torch.dtype) -> bool:
    """True when every relative error is finite and below the dtype's tolerance."""
    return all(math.isfinite(e) and e < TOLERANCES[dtype].gate for e in errors.values())


# -- one rank ---------------------------------------------------------------------------------------------------


def _all_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks (NaN propagates)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    nan = torch.isnan(t).to(torch.float64)
    dist.all_reduce(nan, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [math.nan if n else x for x, n in zip(t.tolist(), nan.tolist())]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_once(runner: Runner, native: tuple, device: torch.device) -> float:
    """Seconds of one fwd+bwd on this rank, all ranks starting together and waiting for the slowest."""
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    runner.step(*native)
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def _check(impl: Impl, rank, world, args, shards, ref, device) -> tuple[dict[str, object], tuple | None]:
    """Build one implementation and check it against the reference: (result, (runner, native inputs) or None).

    Every rank reaches the same verdict (the failure flag and the errors are all-reduced)."""
    result: dict[str, object] = {"status": "ok", "seconds": None, "errors": None, "bytes": None}
    failure, built = "", None
    try:
        runner = impl.build(rank, world, args)
        native = runner.to_native(*shards)
        got = runner.from_native(*runner.step(*native))
        parts = error_parts(got, ref)
        built = (runner, native)
    except Exception as err:  # reported as a row, the run goes on
        failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
        parts = [math.nan] * 8
    failed = _all_max([1.0 if failure else 0.0], device)[0]
    result["errors"] = relative_errors(_all_max(parts, device))
    if failed:
        result["status"] = f"ERROR: {failure}" if failure else "ERROR on another rank"
        return result, None
    if not passes(result["errors"], DTYPES[args.dtype]):
        result["status"] = "MISMATCH"
        return result, None
    return result, built


def compare_on_rank(rank: int, world: int, args, impls: Sequence[Impl], device: str = "cpu") -> list[dict[str, object]]:
    """Every rank: the same inputs and fp64 reference; each implementation checked, then the correct ones timed.

    Timing goes round-robin (one fwd+bwd of each implementation per round, the first round a warm-up), so a slow
    phase of a shared machine hits every implementation alike; the time is the median over rounds of the slowest
    rank."""
    dev = torch.device(device)
    full = [x.to(dev) for x in make_inputs(args, DTYPES[args.dtype])]  # q, k, v, dout [S, b, h, d]
    shards = [megatron_2d.shard_sequence(x, rank, world).contiguous() for x in full]
    ref = reference_on_rank(*full, rank, world, max_elements=2 ** (27 if dev.type == "cuda" else 24))
    del full
    results, built = [], []
    for impl in impls:
        if impl.unavailable:
            results.append({"status": f"n/a: {impl.unavailable}", "seconds": None, "errors": None, "bytes": None})
            built.append(None)
        else:
            result, runner = _check(impl, rank, world, args, shards, ref, dev)
            results.append(result)
            built.append(runner)
    rounds = range(args.repeats + 1)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc=f"{world} ranks, timing rounds", file=sys.stderr)
    times: dict[int, list[float]] = {i: [] for i, b in enumerate(built) if b}
    for r in rounds:
        for i in times:
            t = _time_once(*built[i], dev)
            if r:
                times[i].append(t)
    for i, samples in times.items():
        runner = built[i][0]
        results[i]["seconds"] = _all_max([statistics.median(samples)], dev)[0]
        sent = runner.bytes_sent()
        keys = sorted(sent)
        results[i]["bytes"] = dict(zip(keys, _all_max([float(sent[k]) for k in keys], dev)))
        results[i]["bytes_source"] = runner.bytes_source
    return results


# -- the run ----------------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    family: str
    status: str
    seconds: float | None
    efficiency: float | None
    errors: dict[str, float] | None
    bytes: dict[str, float] | None
    bytes_source: str = ""
    layout: dict[str, object] | None = None
    ratios: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    rows: list[Row]
    single_s: float
    ideal_s: float
    device: str
    single_runs_s: list[float] = field(default_factory=list)
    """CPU: the single-process time measured before and after the ranks ran; ``single_s`` is the smaller."""


def _run_cuda(args, impls: list[Impl]):
    """torchrun: one process per GPU, NCCL; returns (results, single-process seconds) on rank 0, (None, ..)
    elsewhere."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        try:
            single = time_single_process(args, DTYPES[args.dtype], "cuda")
        except (RuntimeError, ValueError) as err:  # e.g. out of memory without flash-attn: no ideal, go on
            print(f"rank {rank}: single-process timing failed ({type(err).__name__}); no 'vs ideal'", file=sys.stderr)
            single = math.nan
            torch.cuda.empty_cache()
        results = compare_on_rank(rank, world, args, impls, "cuda")
    finally:
        dist.destroy_process_group()
    return (results if rank == 0 else None), single


def _finish(args, impls: list[Impl], results, single: float) -> Report:
    """Rows from rank 0's results: efficiency vs ideal and the ratio to each family's best."""
    cores = os.cpu_count() or 1
    ideal = single / (min(args.ranks, cores) if args.device == "cpu" else args.ranks)
    rows = []
    for impl, r in zip(impls, results):
        seconds = r["seconds"]
        efficiency = ideal / seconds if seconds and math.isfinite(ideal) else None
        rows.append(
            Row(
                impl.name,
                impl.family,
                r["status"],
                seconds,
                efficiency,
                r["errors"],
                r["bytes"],
                r.get("bytes_source", ""),
                impl.layout,
            )
        )
    best: dict[str, float] = {}
    for row in rows:
        if row.seconds is not None:
            best[row.family] = min(best.get(row.family, math.inf), row.seconds)
    for row in rows:
        if row.seconds is not None:
            row.ratios = {family: row.seconds / t for family, t in best.items()}
    rows.sort(key=lambda r: (r.seconds is None, r.seconds or 0.0))
    return Report(rows, single, ideal, args.device)


def run_compare(args, extra_impls: Sequence[Impl] = ()) -> Report | None:
    """Run every implementation (plus ``extra_impls``) once; the Report (None on CUDA ranks other than 0)."""
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    impls = all_impls(args) + list(extra_impls)
    if args.device == "cuda":
        results, single = _run_cuda(args, impls)
        return _finish(args, impls, results, single) if results is not None else None
    before = time_single_process(args, DTYPES[args.dtype])
    per_rank = run_on_ranks(
        args.ranks, compare_on_rank, args, impls, "cpu", timeout_s=args.timeout * (4 + 2 * len(impls))
    )
    after = time_single_process(args, DTYPES[args.dtype])  # again: a shared machine's load drifts
    report = _finish(args, impls, per_rank[0], min(before, after))
    report.single_runs_s = [before, after]
    return report


# -- output -----------------------------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _short(family: str) -> str:
    return "best 2D" if family == OURS else family


def print_report(report: Report, args) -> None:
    """The table (fastest first; rows that were not timed last, their reasons below it)."""
    timed = [r.family for r in report.rows if r.seconds is not None]
    families = [f for f in dict.fromkeys([OURS] + timed) if f in timed]  # ours first
    where = f"{args.ranks} CPU ranks" if report.device == "cpu" else f"{args.ranks} GPUs"
    title = (
        f"attention fwd+bwd, {where}, S={args.seq} b={args.batch} hq={args.heads} hkv={args.kv_heads} "
        f"d={args.dim} {args.dtype} causal; single-process {report.single_s * 1e3:.0f} ms, "
        f"ideal {report.ideal_s * 1e3:.0f} ms; error tolerance {_tolerance(args.dtype):g}"
    )
    header = (
        ["implementation", "time ms"]
        + [f"x vs {_short(f)}" for f in families]
        + ["vs ideal", "a2a MiB", "ring MiB", "max rel err"]
    )
    body, notes = [], []
    for r in report.rows:
        worst = max(TENSORS, key=lambda t: r.errors[t] if math.isfinite(r.errors[t]) else math.inf) if r.errors else ""
        err = f"{r.errors[worst]:.1e} {worst}" if r.errors else "-"
        if r.seconds is None:
            kind = r.status.split(":")[0]
            body.append([r.name, kind] + ["-"] * (len(families) + 3) + [err])
            if r.status != kind:
                notes.append(f"{r.name}: {r.status}")
            continue
        mark = " f" if r.bytes_source == "closed form" else ""
        body.append(
            [r.name, f"{r.seconds * 1e3:.0f}"]
            + [f"{r.ratios[f]:.2f}" for f in families]
            + [
                f"{100 * r.efficiency:.0f}%" if r.efficiency is not None else "-",
                _mib(r.bytes["a2a"]) + mark,
                _mib(r.bytes["ring"]) + mark,
                err,
            ]
        )
        if r.bytes.get("ring_counted", r.bytes["ring"]) != r.bytes["ring"]:
            notes.append(
                f"warning: {r.name}: closed-form ring bytes {r.bytes['ring']:.0f} != counted "
                f"{r.bytes['ring_counted']:.0f}"
            )
    render_table(title, header, body, width=150)
    if any(r.status == "MISMATCH" for r in report.rows):
        notes.append(
            f"MISMATCH: a relative error above {_tolerance(args.dtype):g} against the fp64 reference "
            f"(see the JSON for out/dq/dk/dv); such rows are not timed"
        )
    if len(report.single_runs_s) == 2 and max(report.single_runs_s) > 1.25 * min(report.single_runs_s):
        before, after = (t * 1e3 for t in report.single_runs_s)
        notes.append(
            f"warning: the single-process time moved from {before:.0f} ms (before) to {after:.0f} ms (after): "
            f"the machine's load changed during the run; 'vs ideal' uses the smaller, compare rows with care"
        )
    if any(r.bytes_source == "closed form" for r in report.rows):
        notes.append("f: bytes from the closed forms in megatron_2d/bench/runners.py's docstring (ours are measured)")
    for note in notes:
        print(note)


def write_json(report: Report, args, path: str) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "device": report.device,
                "single_s": report.single_s,
                "single_runs_s": report.single_runs_s,
                "ideal_s": report.ideal_s,
                "tolerance": _tolerance(args.dtype),
                "rows": [asdict(r) for r in report.rows],
            },
            f,
            indent=1,
        )


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p, ranks=4, seq=4096, batch=1, heads=8, kv_heads=8, dim=64)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="default bf16 (ring-flash-attn's fp32 backward is wrong: a reused buffer is aliased)",
    )
    add_arguments(p, repeats=5)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: fork --ranks gloo ranks; cuda: run under torchrun (NCCL, one GPU per rank)",
    )
    p.add_argument("--no-peers", dest="peers", action="store_false", help="only our 2D layouts")
    add_arguments(p, timeout=120.0)
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.causal = True  # zigzag rings (ours and the peers) are causal
    if args.device == "cuda":
        args.ranks = int(os.environ.get("WORLD_SIZE", args.ranks))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run_compare(args)
    if report is None:
        return
    print_report(report, args)
    if args.json:
        write_json(report, args, args.json)


if __name__ == "__main__":
    main()
