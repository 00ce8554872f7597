"""Side-by-side fwd+bwd attention benchmark: every 2D layout of CP = N and the peers, same inputs, one run.

    python tools/bench_compare.py --ranks 4                  # CPU: N forked gloo ranks, bf16
    python tools/bench_compare.py --ranks 8 --json out.json  # also save the rows
    torchrun --nproc-per-node 8 tools/bench_compare.py --device cuda --seq 65536 --heads 32 --kv-heads 8 --dim 128

The rows (ours and the peers, and how the peers' bytes are counted): :mod:`megatron_2d_dev.bench.runners`.

Correctness gate: before any timing every implementation runs once on the same zigzag-sharded inputs, and its
out, dq, dk, dv are compared with an fp64 reference (exact causal softmax attention, computed blockwise on the
ranks: megatron_2d.testing.reference.reference_on_rank). An implementation above the dtype's tolerance (the one
table, megatron_2d.testing.reference.TOLERANCES[dtype].gate) is reported as MISMATCH, one that raises as ERROR,
one that cannot run here as n/a; none of them is timed.

    python tools/bench_compare.py --ranks 4 --peers usp,torch-cp  # only these peers (default all; --no-peers)
    python tools/bench_compare.py --ranks 8 --nodes 2 --cluster dgx-h100 --gpu-seq 65536  # an emulated cluster
    python tools/bench_compare.py --ranks 8 --no-peers --send-first   # each 2D layout with the posting order of
                                                                      # before issue 41 too, paired by round

On an emulated cluster (--cluster / --net-mbit: megatron_2d_dev.bench.cluster) the ranks run in its network
namespaces, and after the table the planner's prediction for the emulated cluster as measured is printed beside
every row it has a kind for (megatron_2d_dev.bench.cluster_plan).

Timing (as tools/bench_attention.py): rounds, the first a warm-up; each times the single-process baseline (the
local kernel's fwd+bwd on the full problem, one thread: rank 0 alone, then min(N, cores) ranks at once; on GPUs
every rank), then one fwd+bwd of every correct implementation, in an order that rotates from round to round.
The ranks keep freed memory (--system-malloc turns that off). After the table, "matched layouts": for each USP
row (Ulysses U x ring R), the best 2D row of hp = U, cp = R: its time / the USP row's, the range of that ratio
over the rounds (both rows are timed in every round), their CPU times' ratio, and a verdict: "ours faster" or
"ours slower" where every round (at least 3) agrees, "within noise" where the rounds disagree. Then "inner ring
size": for each hp x cp timed with several w, the default (one ring, w = cp) against the fastest other w, alike.

Columns
    time ms          median over --repeats rounds of the slowest rank
    cpu ms           median over rounds of the CPU time of the step summed over the ranks, every thread (gloo's
                     too): the work, which does not depend on how N ranks share fewer cores (CPU ranks only)
    x vs <family>    time / the best time of that family in this run (2D (ours), each peer)
    vs ideal         median over rounds of ideal / time, ideal = that round's baseline run by min(N, cores) ranks
                     at once / min(N, cores) (on GPUs: by every rank / N)
    vs ideal alone   the same with the baseline run by rank 0 alone on an otherwise idle machine
    a2a, ring MiB    bytes one rank sends per fwd+bwd: ours measured (groups.comm_bytes), peers by closed form (f)
    err              max relative error, max |x - ref| / max |ref| over the whole tensor, of out/dq/dk/dv
"""

from __future__ import annotations

import argparse
import contextlib
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

from ..cli import add_arguments, add_malloc_argument, add_output_arguments, render_table
from .cluster import add_cluster_arguments, bench_cluster
from .cluster_plan import print_planner_check
from .harness import DTYPES, idle, make_inputs, mib, retain_freed_memory, round_order, single_process_step
from .runners import (  # noqa: F401
    OURS,
    PEERS,
    RING_FLASH,
    SEND_FIRST,
    TE_RELEASE,
    TORCH_CP,
    USP,
    YUNCHANG_VERSION,
    Impl,
    Runner,
    TEContextParallel,
    all_impls,
    ring_flash_impl,
    te_impls,
    torch_cp_impls,
    usp_impls,
)

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


def _all_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum over all ranks."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_once(runner: Runner, native: tuple, device: torch.device) -> tuple[float, float]:
    """One fwd+bwd, all ranks starting together: (seconds to the slowest rank's end, the CPU seconds this process
    spent inside the step, every thread counted: the kernel's, the copies', gloo's)."""
    cpu = []

    def step() -> None:
        t0 = time.process_time()
        runner.step(*native)
        _sync(device)
        cpu.append(time.process_time() - t0)

    return _time_call(step, device), cpu[0]


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


def compare_on_rank(rank: int, world: int, args, impls: Sequence[Impl], device: str = "cpu") -> dict[str, object]:
    """Every rank: the same inputs and fp64 reference; each implementation checked, then the correct ones timed.

    Timing goes in rounds (the first a warm-up), as bench_attention's: a round times the single-process baseline
    twice, rank 0 alone and then the first min(N, cores) ranks at once (every rank on GPUs), and then one fwd+bwd
    of each implementation, in an order that rotates from round to round (harness.round_order); so a slow phase of
    a shared machine hits every implementation and the baseline alike. Times are barrier to barrier (the slowest
    rank's). A row's time is its median over rounds; its efficiencies the medians of per-round ratios, ideal /
    time, ideal = the baseline of the same round / min(N, cores) (N on GPUs). Its CPU time (CPU ranks) is the
    median over rounds of the CPU seconds the step took, summed over the ranks: the work, which the scheduling of
    N ranks on fewer cores does not change. The ranks keep freed memory (harness.retain_freed_memory) unless
    ``args.system_malloc``.

    Returns {"rows": a result per implementation, "order": the order of each timed round, "single": {"alone",
    "busy"}: the baseline's seconds per timed round}."""
    dev = torch.device(device)
    if not getattr(args, "system_malloc", False):
        retain_freed_memory()
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
    share = _share(world, dev.type)
    baseline = None
    if rank < share:
        try:
            baseline = single_process_step(args, DTYPES[args.dtype], device)
        except (RuntimeError, ValueError) as err:  # e.g. out of memory on a GPU without flash-attn: no ideal
            print(f"rank {rank}: no single-process baseline ({type(err).__name__}); no 'vs ideal'", file=sys.stderr)
    failed = _all_max([1.0 if rank < share and baseline is None else 0.0], dev)[0]
    step = (lambda: None) if failed or baseline is None else baseline
    rounds = range(args.repeats + 1)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc=f"{world} ranks, timing rounds", file=sys.stderr)
    timed = [i for i, b in enumerate(built) if b]
    times: dict[int, list[float]] = {i: [] for i in timed}
    cpu_times: dict[int, list[float]] = {i: [] for i in timed}
    single: dict[str, list[float]] = {"alone": [], "busy": []}
    orders = []
    for r in rounds:
        alone = _time_call(step if rank == 0 else idle, dev)
        busy = _time_call(step, dev)
        order = round_order(timed, r)
        measured = {i: _time_once(*built[i], dev) for i in order}
        if r:
            single["alone"].append(alone)
            single["busy"].append(busy)
            orders.append(order)
            for i in order:
                times[i].append(measured[i][0])
                cpu_times[i].append(measured[i][1])
    if failed:
        single = {kind: [math.nan] * len(t) for kind, t in single.items()}
    single = {kind: _all_max(t, dev) for kind, t in single.items()}
    for i, samples in times.items():
        runner = built[i][0]
        samples = _all_max(samples, dev)  # per round, the slowest rank
        results[i]["seconds"] = statistics.median(samples)
        results[i]["round_seconds"] = samples
        if dev.type == "cpu":  # the same on every rank; on GPUs the host's CPU time is not the step's work
            results[i]["cpu_seconds"] = statistics.median(_all_sum(cpu_times[i], dev))  # per round, all ranks
        for key, kind in (("efficiency", "busy"), ("efficiency_alone", "alone")):
            results[i][key] = statistics.median(s / share / t for s, t in zip(single[kind], samples))
        sent = runner.bytes_sent()
        keys = sorted(sent)
        results[i]["bytes"] = dict(zip(keys, _all_max([float(sent[k]) for k in keys], dev)))
        results[i]["bytes_source"] = runner.bytes_source
    return {"rows": results, "order": orders, "single": single}


def _share(world: int, device_type: str) -> int:
    """What the ideal divides the single-process time by: min(N, cores) on CPU, N on GPUs."""
    return min(world, os.cpu_count() or 1) if device_type == "cpu" else world


def _time_call(fn, device: torch.device) -> float:
    """Seconds of ``fn()`` barrier to barrier (the slowest rank's)."""
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


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
    efficiency_alone: float | None = None
    cpu_seconds: float | None = None
    """Median over rounds of the step's CPU seconds summed over the ranks (CPU ranks only)."""
    round_seconds: list[float] = field(default_factory=list)
    """The slowest rank's seconds in each timed round (the rounds of every row are the same rounds)."""


@dataclass
class Report:
    rows: list[Row]
    single_s: float
    """The single-process baseline's median seconds, min(N, cores) ranks running it at once (N GPUs)."""
    ideal_s: float
    device: str
    single_alone_s: float = math.nan
    """The same, rank 0 alone on an otherwise idle machine."""
    single_runs_s: list[float] = field(default_factory=list)
    """The baseline alone, per timed round (a spread says the machine's load changed during the run)."""
    order: list[list[int]] = field(default_factory=list)
    """The implementations' indices (into the run's rows before sorting) in each timed round's order."""


def _run_cuda(args, impls: list[Impl]):
    """torchrun: one process per GPU, NCCL; returns compare_on_rank's result on rank 0, None elsewhere."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        out = compare_on_rank(rank, world, args, impls, "cuda")
    finally:
        dist.destroy_process_group()
    return out if rank == 0 else None


def _finish(args, impls: list[Impl], out: dict[str, object]) -> Report:
    """Rows from rank 0's results: efficiencies and the ratio to each family's best."""
    single = out["single"]
    busy = statistics.median(single["busy"]) if single["busy"] else math.nan
    alone = statistics.median(single["alone"]) if single["alone"] else math.nan
    share = _share(args.ranks, args.device)
    rows = []
    for impl, r in zip(impls, out["rows"]):
        ok = r["seconds"] is not None
        rows.append(
            Row(
                impl.name,
                impl.family,
                r["status"],
                r["seconds"],
                r.get("efficiency") if ok and math.isfinite(r.get("efficiency", math.nan)) else None,
                r["errors"],
                r["bytes"],
                r.get("bytes_source", ""),
                impl.layout,
                efficiency_alone=r.get("efficiency_alone")
                if ok and math.isfinite(r.get("efficiency_alone", math.nan))
                else None,
                cpu_seconds=r.get("cpu_seconds"),
                round_seconds=list(r.get("round_seconds", [])),
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
    return Report(rows, busy, busy / share, args.device, alone, list(single["alone"]), out["order"])


def run_compare(args, extra_impls: Sequence[Impl] = (), rank_setup=None) -> Report | None:
    """Run every implementation (plus ``extra_impls``) once; the Report (None on CUDA ranks other than 0).
    ``rank_setup(rank)`` runs first in each forked rank (an emulated cluster's ranks enter their namespaces)."""
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    impls = all_impls(args) + list(extra_impls)
    if args.device == "cuda":
        out = _run_cuda(args, impls)
        return _finish(args, impls, out) if out is not None else None
    with contextlib.ExitStack() as stack:  # the contexts rows need around the forked run (TE's CPU context), once
        for key, factory in dict(i.context for i in impls if i.context and not i.unavailable).items():
            try:
                stack.enter_context(factory())
            except Exception as err:  # the rows that need it become n/a rows
                for i in impls:
                    if i.context and i.context[0] == key:
                        i.unavailable = f"{key}: {type(err).__name__}: {err}"[:160]
        per_rank = run_on_ranks(
            args.ranks,
            compare_on_rank,
            args,
            impls,
            "cpu",
            timeout_s=args.timeout * (4 + 2 * len(impls)),
            rank_setup=rank_setup,
        )
    return _finish(args, impls, per_rank[0])


MIN_ROUNDS_FOR_VERDICT = 3


@dataclass(frozen=True)
class Paired:
    """Two rows timed in the same rounds: ``row``'s time / ``against``'s."""

    row: str
    against: str
    ratio: float
    """The ratio of the median times (< 1: ``row`` faster)."""
    round_ratios: tuple[float, ...] = ()
    """The ratio in each round (both rows timed in it, at rotated positions)."""
    cpu_ratio: float | None = None
    """The ratio of their CPU seconds over all ranks: the work, apart from how N ranks share the cores."""

    @property
    def verdict(self) -> str:
        """'faster' / 'slower' (``row`` against ``against``) where every round agrees, at least
        MIN_ROUNDS_FOR_VERDICT of them; 'within noise' where the rounds disagree; '-' with too few rounds."""
        if len(self.round_ratios) < MIN_ROUNDS_FOR_VERDICT:
            return "-"
        if max(self.round_ratios) < 1:
            return "faster"
        if min(self.round_ratios) > 1:
            return "slower"
        return "within noise"


def paired(row: Row, against: Row) -> Paired:
    """``row`` against ``against``: their median times, each round's and their CPU times, as ratios."""
    rounds = tuple(a / b for a, b in zip(row.round_seconds, against.round_seconds))
    cpu = row.cpu_seconds / against.cpu_seconds if row.cpu_seconds and against.cpu_seconds else None
    return Paired(row.name, against.name, row.seconds / against.seconds, rounds, cpu)


def _timed_ours(rows: Sequence[Row]) -> list[Row]:
    """Our timed rows with the default dK/dV riders (fp32; the "dK/dV in <dtype>" rows stand beside TE's)."""
    return [
        r
        for r in rows
        if r.family == OURS
        and r.seconds is not None
        and r.layout
        and r.layout.get("dkv", "accumulator") == "accumulator"
    ]


def matched_layouts(rows: Sequence[Row]) -> list[Paired]:
    """For each timed USP row (Ulysses U x ring R), the best timed 2D row of hp = U, cp = R against it; rows
    without a timed 2D match are left out."""
    ours = _timed_ours(rows)
    out = []
    for usp in rows:
        if usp.family != USP or usp.seconds is None or not usp.layout:
            continue
        match = [r for r in ours if (r.layout["hp"], r.layout["cp"]) == (usp.layout["hp"], usp.layout["cp"])]
        if match:
            out.append(paired(min(match, key=lambda r: r.seconds), usp))
    return out


def posting_orders(rows: Sequence[Row]) -> list[Paired]:
    """For each layout timed both ways (``--send-first``): receive first (now) against send first (before)."""
    before = {r.name.removesuffix(" (send first)"): r for r in rows if r.family == SEND_FIRST and r.seconds}
    return [paired(r, before[r.name]) for r in _timed_ours(rows) if r.name in before]


def default_windows(rows: Sequence[Row]) -> list[Paired]:
    """For each hp x cp x placement timed with more than one inner ring size: the default (one ring, w = cp)
    against the fastest other w."""
    ours = _timed_ours(rows)
    out = []
    for key in dict.fromkeys((r.layout["hp"], r.layout["cp"], r.layout["placement"]) for r in ours):
        same = [r for r in ours if (r.layout["hp"], r.layout["cp"], r.layout["placement"]) == key]
        default = [r for r in same if r.layout["w"] == key[1]]
        others = [r for r in same if r.layout["w"] != key[1]]
        if default and others:
            out.append(paired(default[0], min(others, key=lambda r: r.seconds)))
    return out


ADAPTATIONS = {
    RING_FLASH: "ring-flash-attn: zigzag_ring_flash_attn_func on our zigzag shards (its layout); on CPU its "
    "flash_attn kernels are the stand-in (megatron_2d_dev.flash_attn_cpu)",
    USP: "USP: yunchang {version} LongContextAttention(ring_impl_type='zigzag') over its set_seq_parallel_pg groups, "
    "inputs by its zigzag_extract_local; on CPU over the flash_attn stand-in as flash-attn 2.7 (yunchang picks the "
    "call convention by version); a ring of one rank (ulysses N) brings dK/dV home by a local copy instead of a "
    "gloo send to itself; 'K/V repeated by the caller': K/V heads repeated to N before the call (autograd sums "
    "their gradients)",
    "TE": "TE rows on CPU ranks: Transformer Engine {te_release}'s own DotProductAttention and context_parallel.py "
    "(megatron_2d_dev.te_context_parallel), unchanged; its fused attention is the CPU stand-in of its compiled "
    "extension, the cpu_flash kernel our rows run; TE merges partial outputs and moves dK/dV in the input dtype "
    "(ours: fp32 riders by default, the 'dK/dV in <dtype>' rows move TE's bytes); its two CUDA streams run in order, "
    "as everything does on CPU; bytes: closed forms, checked against what TE's code sent (a mismatch is printed)",
    TORCH_CP: "torch CP: _ContextParallel (SDPA) by parallelize_module, inputs by _context_parallel_shard with the "
    "head-tail load balancer, set_rotate_method per row; GQA by SDPA's enable_gqa; on CPU a CP sharding rule for "
    "the CPU SDPA op runs torch's _templated_ring_attention(_backward) (dev/megatron_2d_dev/bench/torch_cp_cpu.py); "
    "per-block kernel: megatron_2d's cpu_flash, as every row",
}


# -- output -----------------------------------------------------------------------------------------------------


def _short(family: str) -> str:
    return "best 2D" if family == OURS else family


def _paired_figures(m: Paired, subject: str) -> str:
    spread = f"({min(m.round_ratios):.2f}-{max(m.round_ratios):.2f})" if m.round_ratios else ""
    cpu = f"cpu {m.cpu_ratio:.2f}" if m.cpu_ratio is not None else ""
    verdict = m.verdict if m.verdict in ("-", "within noise") else f"{subject} {m.verdict}"
    return f"time {m.ratio:.2f} {spread:<11} {cpu:<9} {verdict}"


def print_report(report: Report, args) -> None:
    """The table (fastest first; rows that were not timed last, their reasons below it)."""
    timed = [r.family for r in report.rows if r.seconds is not None]
    families = [f for f in dict.fromkeys([OURS] + timed) if f in timed]  # ours first
    where = f"{args.ranks} CPU ranks" if report.device == "cpu" else f"{args.ranks} GPUs"
    title = (
        f"attention fwd+bwd, {where}, S={args.seq} b={args.batch} hq={args.heads} hkv={args.kv_heads} "
        f"d={args.dim} {args.dtype} causal; single-process {report.single_s * 1e3:.0f} ms "
        f"({report.single_alone_s * 1e3:.0f} ms alone), ideal = single / {_share(args.ranks, args.device)}; "
        f"error tolerance {_tolerance(args.dtype):g}"
    )
    header = (
        ["implementation", "time ms", "cpu ms"]
        + [f"x vs {_short(f)}" for f in families]
        + ["vs ideal", "vs ideal alone", "a2a MiB", "ring MiB", "max rel err"]
    )
    body, notes = [], []
    for r in report.rows:
        worst = max(TENSORS, key=lambda t: r.errors[t] if math.isfinite(r.errors[t]) else math.inf) if r.errors else ""
        err = f"{r.errors[worst]:.1e} {worst}" if r.errors else "-"
        if r.seconds is None:
            kind = r.status.split(":")[0]
            body.append([r.name, kind] + ["-"] * (len(families) + 5) + [err])
            if r.status != kind:
                notes.append(f"{r.name}: {r.status}")
            continue
        mark = " f" if r.bytes_source == "closed form" else ""
        body.append(
            [r.name, f"{r.seconds * 1e3:.0f}", f"{r.cpu_seconds * 1e3:.0f}" if r.cpu_seconds is not None else "-"]
            + [f"{r.ratios[f]:.2f}" for f in families]
            + [
                f"{100 * r.efficiency:.0f}%" if r.efficiency is not None else "-",
                f"{100 * r.efficiency_alone:.0f}%" if r.efficiency_alone is not None else "-",
                mib(r.bytes["a2a"]) + mark,
                mib(r.bytes["ring"]) + mark,
                err,
            ]
        )
        for kind in ("ring", "a2a"):
            if r.bytes.get(f"{kind}_counted", r.bytes[kind]) != r.bytes[kind]:
                notes.append(
                    f"warning: {r.name}: closed-form {kind} bytes {r.bytes[kind]:.0f} != counted "
                    f"{r.bytes[f'{kind}_counted']:.0f}"
                )
    render_table(title, header, body, width=170)
    matched = matched_layouts(report.rows)
    if matched:
        print(
            "matched layouts: the best 2D row of the same hp x cp against the USP row: time ours / USP (< 1: ours "
            "faster), its range over the rounds, CPU time ours / USP (all ranks), and whether every round agrees"
        )
        for m in matched:
            print(f"  {m.against:<46} {m.row:<32} {_paired_figures(m, 'ours')}")
    orders = posting_orders(report.rows)
    if orders:
        print(
            "posting order: each layout with its receives posted first (now) against its sends first (before issue "
            "41): time now / before (< 1: the fix is faster), its range over the rounds, CPU time now / before"
        )
        for m in orders:
            print(f"  {m.row:<46} {'(send first)':<32} {_paired_figures(m, 'now')}")
    windows = default_windows(report.rows)
    if windows:
        print(
            "inner ring size: the default (one ring, w = cp) against the fastest other w of the same hp x cp: "
            "time default / other, its range, CPU time default / other"
        )
        for m in windows:
            print(f"  {m.row:<46} {m.against:<32} {_paired_figures(m, 'default')}")
    if any(r.status == "MISMATCH" for r in report.rows):
        notes.append(
            f"MISMATCH: a relative error above {_tolerance(args.dtype):g} against the fp64 reference "
            f"(see the JSON for out/dq/dk/dv); such rows are not timed"
        )
    runs = [t for t in report.single_runs_s if math.isfinite(t)]
    if runs and max(runs) > 1.25 * min(runs):
        notes.append(
            f"warning: the single-process time (alone) moved between {min(runs) * 1e3:.0f} and "
            f"{max(runs) * 1e3:.0f} ms over the rounds: the machine's load changed during the run; the "
            f"efficiencies are per-round ratios, compare rows with care"
        )
    families_run = {r.family for r in report.rows if not r.status.startswith("n/a")}
    if report.device == "cpu":
        families_run |= {"TE" for f in families_run if f.startswith("TE ")}
    for family, text in ADAPTATIONS.items():
        if family in families_run:
            notes.append("note: " + text.format(version=YUNCHANG_VERSION, te_release=getattr(args, "te_release", "")))
    if any(r.bytes_source == "closed form" for r in report.rows):
        notes.append(
            "f: bytes from the closed forms in dev/megatron_2d_dev/bench/runners.py's docstring (ours are measured)"
        )
    for note in notes:
        print(note)


def write_json(report: Report, args, path: str, extra: dict | None = None) -> None:
    """The run as JSON: its args, the baseline, the rows, and ``extra`` (the emulated cluster and the planner)."""
    with open(path, "w") as f:
        json.dump(
            {
                **(extra or {}),
                "args": vars(args),
                "device": report.device,
                "single_s": report.single_s,
                "single_alone_s": report.single_alone_s,
                "single_runs_s": report.single_runs_s,
                "order": report.order,
                "ideal_s": report.ideal_s,
                "tolerance": _tolerance(args.dtype),
                "rows": [asdict(r) for r in report.rows],
            },
            f,
            indent=1,
        )


def parse_peers(text: str) -> tuple[str, ...]:
    """--peers: 'all' or comma-separated names of :data:`PEERS` -> the names, in PEERS's order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return PEERS
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown or [text]}: choose from {', '.join(PEERS)} or all")
    return tuple(n for n in PEERS if n in names)


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
    p.add_argument(
        "--peers",
        type=parse_peers,
        default=PEERS,
        help=f"the peers to run, comma-separated from {', '.join(PEERS)}, or 'all' (default all)",
    )
    p.add_argument("--no-peers", dest="peers", action="store_const", const=(), help="only our 2D layouts")
    p.add_argument(
        "--te-release",
        default=TE_RELEASE,
        help=f"the Transformer Engine release of the TE rows on CPU ranks (default {TE_RELEASE}; "
        "megatron_2d_dev.te_package installs 2.5.0, 2.8.0, 2.12.0, 2.20.2)",
    )
    p.add_argument(
        "--dkv-comm-dtype",
        choices=("accumulator", "input", "both"),
        default="both",
        help="our rows' dK/dV riders: fp32 ('accumulator', the default of attention_2d), the input dtype ('input', "
        "TE's bytes), or a row of each (default both)",
    )
    p.add_argument(
        "--send-first",
        action="store_true",
        help="also time every 2D layout with the transport's posting order of before issue 41 (sends first)",
    )
    add_malloc_argument(p)
    add_arguments(p, timeout=120.0)
    add_output_arguments(p)
    add_cluster_arguments(p)
    args = p.parse_args(argv)
    args.causal = True  # zigzag rings (ours and the peers) are causal
    if args.device == "cuda":
        args.ranks = int(os.environ.get("WORLD_SIZE", args.ranks))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with bench_cluster(args, args.ranks, DTYPES[args.dtype]) as cluster:
        report = run_compare(args, rank_setup=cluster.rank_setup if cluster else None)
    if report is None:
        return
    print_report(report, args)
    extra = {}
    if cluster is not None:
        extra = {"cluster": cluster.to_dict(), "planner": print_planner_check(report, args, cluster)}
    if args.json:
        write_json(report, args, args.json, extra)


if __name__ == "__main__":
    main()
