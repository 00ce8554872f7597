"""``python -m megatron_2d.plan grid``: where 2D must win or lose against the best stock configuration.

For each preset model at its fixed TP/PP (``hardware.GRID_MODELS``), each GPU count and each sequence length, the
planner's best 2D plan and best stock plan (p2p, a2a, a2a+p2p, DeepSpeed-Ulysses), each with the cheapest recompute
that fits in memory, are compared by throughput per GPU: ratio = 2D tokens/GPU/s / stock tokens/GPU/s (> 1: 2D
wins). Each side picks its own CP size among the divisors of the GPUs left by TP x PP, the rest being DP (a stock
user would not run CP=1024 on 32K tokens); ``--fixed-cp`` gives CP all the GPUs left (DP = 1) instead. Each cell
also says why the winner wins (codes below). Each side holds its model states its own way (memory options,
:mod:`.memory_options`: the
data-parallel gradient and parameter communication they cost is in the step); ``--fair-memory`` gives stock 2D's
memory options and, hypothetically, Checkpoint++, so that what remains is 2D's own effect. Results are cached per
cell.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

from ..layout.choices import DkvCommDtype, Placement, PlanKind, RecomputeMode
from ..layout.topology import divisors
from .candidates import STOCK_KINDS, Scheme
from .console import parse_seq, terminal_console
from .hardware import GRID_MODELS, ParallelSpec, PlanError, get_cluster, get_model
from .job import CHOICES as MEMORY_CHOICES
from .job import Job, MemoryPolicy
from .kernel_rates import PLANNED_KERNELS, STOCK_KERNEL
from .memory import CHECKPOINT_PLUS_MODES
from .planner import Candidate, evaluate, plan
from .report import memory_policy_text, seq_label, states_label

GRID_GPUS = (32, 64, 128, 256, 512, 1024)
GRID_SEQS = tuple(1 << k for k in range(15, 23))  # 32K .. 4M
TIE = 0.02
"""Ratios within 2% of 1 are called a tie (the model is not that precise)."""

CODES = {
    "C": "2D: Selective Checkpoint++ fits where stock must recompute attention (selective/full)",
    "S": "2D: fits at a smaller CP than stock (Checkpoint++ or less recompute), so less communication per token",
    "R": "2D: needs less recompute than stock to fit (smaller K/V buffers or states per GPU)",
    "K": "2D: head parallelism beyond the KV heads per TP rank (K/V replicated; stock a2a cannot)",
    "H": "2D: a head x context split stock does not offer (a2a+p2p needs KV heads divisible by its a2a size)",
    "D": "2D: double ring (w < cp) hides the network behind the inner ring",
    "P": "2D: context-first placement (the ring on NVLink)",
    "Z": "2D: a Hybrid ZeRO choice Megatron does not list (states sharded inside the CP group or node) adds > 2%",
    "M": "stock: no stock layout fits in memory",
    "I": "stock: no stock layout can run (heads/KV heads/sequence)",
    "B": "stock: Transformer Engine's dK/dV travel in bf16, ours in fp32 (same layout otherwise)",
    "F": "stock: Transformer Engine's kernel is faster than the one 2D runs (--kernel), the same layout otherwise",
    "U": "stock: a stock layout 2D does not cover better (e.g. DeepSpeed-Ulysses)",
    "=": "tie: within 2% (often the same layout, or attention compute dominating both)",
    "X": "neither fits in memory (or can run)",
}


@dataclass(frozen=True)
class Cell:
    model: str
    gpus: int
    seq: int
    best_2d: Candidate | None
    best_stock: Candidate | None
    ratio: float | None
    """2D tokens/s / stock tokens/s (None when either has no feasible plan)."""
    codes: str
    reason: str

    def text(self) -> str:
        if self.ratio is None:
            return {"M": "2D only", "I": "2D only", "X": "none"}.get(self.codes[:1], "-") + f" {self.codes}"
        return f"{self.ratio:.2f} {self.codes}"


def _twin(stock: Candidate) -> Scheme:
    """The 2D layout that runs the same schedule as a stock one."""
    return Scheme(PlanKind.TWO_D, stock.hp, stock.cp, stock.cp, Placement.HEAD_FIRST)


def explain(
    best_2d: Candidate | None,
    best_stock: Candidate | None,
    cands: Sequence[Candidate],
    model,
    cluster,
    parallel,
    seq,
    stock_parallel=None,
    memory: MemoryPolicy = MemoryPolicy(),
    kernel: str | None = None,
) -> tuple[float | None, str, str]:
    """(ratio, codes, one-line reason) for one cell. ``parallel``/``stock_parallel``: the jobs the 2D and the stock
    plan were made for (the same unless each side picked its own CP); ``cands``: every candidate seen."""
    stock_parallel = stock_parallel or parallel
    if best_2d is None and best_stock is None:
        mem = min((c.estimate.memory_gb for c in cands if c.runs), default=None)
        return None, "X", ("nothing fits" + (f" (least memory {mem:.0f} GB)" if mem is not None else ""))
    if best_stock is None:
        stock = [c for c in cands if c.kind != PlanKind.TWO_D]
        code = "M" if any(c.runs for c in stock) else "I"
        return None, code, CODES[code]
    if best_2d is None:
        return None, "U", "no 2D layout fits"
    e2, es = best_2d.estimate, best_stock.estimate
    ratio = e2.tokens_per_gpu_s / es.tokens_per_gpu_s
    cps = (
        f" (CP {best_2d.scheme.cp_size} vs {best_stock.scheme.cp_size})"
        if best_2d.scheme.cp_size != best_stock.scheme.cp_size
        else ""
    )
    codes = ""
    if ratio > 1 + TIE:
        cp2, cps_ = best_2d.scheme.cp_size, best_stock.scheme.cp_size
        if e2.recompute in CHECKPOINT_PLUS_MODES and es.recompute in (RecomputeMode.SELECTIVE, RecomputeMode.FULL):
            codes += "C"
        elif cp2 < cps_:
            codes += "S"
        elif e2.recompute_layers * e2.recompute_s < es.recompute_layers * es.recompute_s:
            codes += "R"
        if memory.choice in ("auto", "all") and not memory.fair:
            # would 2D lose its lead with Megatron's own memory options only?
            stock_memory = replace(memory, choice="stock")
            plain = evaluate(best_2d.scheme, Job(model, cluster, parallel, seq, memory=stock_memory, kernel=kernel))
            if not plain.feasible or plain.estimate.tokens_per_gpu_s < e2.tokens_per_gpu_s * (1 - TIE):
                codes += "Z"
        # attention per token of a GPU (time_s covers S/CP tokens), at the same or a larger CP than stock's
        if cp2 >= cps_ and (e2.time_s * cp2 < es.time_s * cps_ * (1 - TIE) or not codes):
            layout_codes = ""
            if best_2d.hp > model.kv_heads // parallel.tp:
                layout_codes += "K"
            if best_2d.w < best_2d.cp:
                layout_codes += "D"
            if best_2d.placement == Placement.CONTEXT_FIRST:
                layout_codes += "P"
            codes += layout_codes or "H"
        return ratio, codes, "2D wins: " + "; ".join(CODES[c][4:] for c in codes) + cps
    if ratio < 1 - TIE:

        def same_as_stock(dkv: str, twin_kernel: str | None) -> bool:
            job = Job(
                model,
                cluster,
                stock_parallel,
                seq,
                recompute=es.recompute,
                dkv_comm_dtype=dkv,
                memory=memory,
                kernel=twin_kernel,
            )
            twin = evaluate(_twin(best_stock), job)
            return twin.estimate is not None and abs(twin.estimate.step_s / es.step_s - 1) < 1e-6

        if best_2d.kernel != best_stock.kernel and same_as_stock(DkvCommDtype.INPUT, best_stock.kernel):
            code = "F" if not same_as_stock(DkvCommDtype.INPUT, kernel) else "B"
        else:
            code = "B" if same_as_stock(DkvCommDtype.INPUT, kernel) else "U"
        return ratio, code, "stock wins: " + CODES[code][7:] + cps
    return ratio, "=", "tie" + cps


def _cp_sizes(gpus: int, tp: int, pp: int, seq: int, free_cp: bool) -> list[int | None]:
    left = gpus // (tp * pp)
    if not free_cp:
        return [None]
    return [c for c in divisors(left) if seq % (2 * c) == 0]


@cache
def cell(
    model_name: str,
    gpus: int,
    seq: int,
    cluster_name: str = "8xH100",
    free_cp: bool = True,
    memory: MemoryPolicy = MemoryPolicy(),
    kernel: str | None = None,
) -> Cell:
    """The comparison for one (model, GPUs, sequence) on a preset cluster (cached). ``free_cp``: each side takes
    the CP size (a divisor of the GPUs left by TP x PP; DP the rest) with its best throughput per GPU; ``memory``:
    the memory options each side tries; ``kernel``: 2D's attention kernel (None: its selection's)."""
    model, cluster = get_model(model_name), get_cluster(cluster_name)
    sizes = GRID_MODELS[model_name]
    if gpus % (sizes["tp"] * sizes["pp"]):
        raise PlanError(f"{gpus} GPUs are not divisible by TP x PP = {sizes['tp']} x {sizes['pp']}")
    seen: list[Candidate] = []
    best: dict[str, tuple[Candidate, ParallelSpec]] = {}
    done = set()
    for cp in _cp_sizes(gpus, sizes["tp"], sizes["pp"], seq, free_cp):
        # CP ascending. Once a side runs without recompute, a larger CP only adds communication per token (the
        # compute per token is the same), so that side stops looking (an assumption of the cost model's shape).
        if len(done) == 2:
            break
        parallel = ParallelSpec(gpus=gpus, tp=sizes["tp"], pp=sizes["pp"], cp=cp)
        cands = plan(Job(model, cluster, parallel, seq, memory=memory, kernel=kernel))
        seen += cands
        for side, kinds in (("2d", (PlanKind.TWO_D,)), ("stock", STOCK_KINDS)):
            if side in done:
                continue
            c = next((c for c in cands if c.feasible and c.kind in kinds), None)
            if c is not None and c.recompute == RecomputeMode.NONE:
                done.add(side)
            if c is not None and (
                side not in best or c.estimate.tokens_per_gpu_s > best[side][0].estimate.tokens_per_gpu_s
            ):
                best[side] = (c, parallel)
    if not seen:
        raise PlanError(f"sequence {seq} fits no CP size of {gpus} GPUs (2*CP must divide it)")
    b2, p2 = best.get("2d", (None, None))
    bs, ps = best.get("stock", (None, None))
    ratio, codes, reason = explain(
        b2, bs, seen, model, cluster, p2 or ps or ParallelSpec(gpus=gpus, **sizes), seq, ps, memory, kernel
    )
    return Cell(model_name, gpus, seq, b2, bs, ratio, codes, reason)


def grid(
    models: Sequence[str] = tuple(GRID_MODELS),
    gpus: Sequence[int] = GRID_GPUS,
    seqs: Sequence[int] = GRID_SEQS,
    cluster: str = "8xH100",
    free_cp: bool = True,
    memory: MemoryPolicy = MemoryPolicy(),
    kernel: str | None = None,
) -> list[Cell]:
    """Every cell of the grid (cells whose job is invalid, e.g. a sequence not divisible by 2*CP, are skipped)."""
    out = []
    for m in models:
        for g in gpus:
            for s in seqs:
                try:
                    out.append(cell(m, g, s, cluster, free_cp, memory, kernel))
                except PlanError:
                    continue
    return out


def summary(cells: Sequence[Cell]) -> dict[str, int]:
    """Counts: 2D wins, stock wins, ties, only 2D fits, nothing fits."""
    out = {"2d": 0, "stock": 0, "tie": 0, "2d only": 0, "stock only": 0, "none": 0}
    for c in cells:
        if c.ratio is None:
            out[{"M": "2d only", "I": "2d only", "X": "none"}.get(c.codes, "stock only")] += 1
        elif c.ratio > 1 + TIE:
            out["2d"] += 1
        elif c.ratio < 1 - TIE:
            out["stock"] += 1
        else:
            out["tie"] += 1
    return out


def format_grid(
    cells: Sequence[Cell], cluster: str = "8xH100", free_cp: bool = True, memory: MemoryPolicy = MemoryPolicy()
) -> str:
    """Plain text: one matrix per model (rows GPUs, columns sequence lengths), the code legend and a summary."""
    cp = "each side picks its CP size (DP the rest)" if free_cp else "CP = all GPUs left (DP = 1)"
    lines = [
        f"Best 2D plan / best stock plan, throughput per GPU (> 1: 2D faster), on {cluster}; each with the "
        f"cheapest recompute that fits; {cp}; {memory_policy_text(memory)}.",
        "",
    ]
    ran = next((c.best_2d.kernel for c in cells if c.best_2d is not None), None)
    if ran is not None:
        arch = get_cluster(cluster).arch
        lines[-1:-1] = [
            f"Attention kernels: 2D {ran}, Megatron's stock CP {STOCK_KERNEL[arch]} (Transformer Engine's), "
            f"DeepSpeed-Ulysses flash_attn2; rates: megatron_2d.plan.kernel_rates."
        ]
    models = list(dict.fromkeys(c.model for c in cells))
    for m in models:
        mine = [c for c in cells if c.model == m]
        sizes = GRID_MODELS[m]
        seqs = sorted({c.seq for c in mine})
        gpus = sorted({c.gpus for c in mine})
        by = {(c.gpus, c.seq): c for c in mine}
        model = get_model(m)
        lines.append(f"{m} (heads {model.heads}, KV heads {model.kv_heads}, TP={sizes['tp']} PP={sizes['pp']})")
        header = ["GPUs"] + [seq_label(s) for s in seqs]
        rows = [[str(g)] + [by[(g, s)].text() if (g, s) in by else "" for s in seqs] for g in gpus]
        widths = [max(len(r[j]) for r in rows + [header]) for j in range(len(header))]

        def fmt(r: list[str], widths=widths) -> str:
            return "  ".join(v.rjust(w) for v, w in zip(r, widths)).rstrip()

        lines += [fmt(header)] + [fmt(r) for r in rows] + [""]
    lines.append("Codes:")
    lines += [f"  {k}  {v}" for k, v in CODES.items()]
    s = summary(cells)
    lines += [
        "",
        f"{len(cells)} cells: 2D faster in {s['2d']}, stock faster in {s['stock']}, tie in {s['tie']}, "
        f"only 2D fits in {s['2d only']}, only stock in {s['stock only']}, nothing fits in {s['none']}.",
    ]
    return "\n".join(lines)


def print_grid(
    cells: Sequence[Cell],
    cluster: str = "8xH100",
    stream=None,
    free_cp: bool = True,
    memory: MemoryPolicy = MemoryPolicy(),
) -> None:
    """Print with rich when on a terminal, else ``format_grid``."""
    stream = stream or sys.stdout
    console = terminal_console(stream, min_width=120)
    if console is None:
        print(format_grid(cells, cluster, free_cp, memory), file=stream)
        return
    from rich.table import Table

    console.print(format_grid([], cluster, free_cp, memory).splitlines()[0], markup=False)
    for m in dict.fromkeys(c.model for c in cells):
        mine = [c for c in cells if c.model == m]
        seqs = sorted({c.seq for c in mine})
        by = {(c.gpus, c.seq): c for c in mine}
        sizes = GRID_MODELS[m]
        table = Table(title=f"{m} TP={sizes['tp']} PP={sizes['pp']}", header_style="bold")
        table.add_column("GPUs", justify="right")
        for s in seqs:
            table.add_column(seq_label(s), justify="right")
        for g in sorted({c.gpus for c in mine}):
            row = []
            for s in seqs:
                c = by.get((g, s))
                style = (
                    ""
                    if c is None or c.ratio is None
                    else ("green" if c.ratio > 1 + TIE else "red" if c.ratio < 1 - TIE else "")
                )
                row.append(f"[{style}]{c.text()}[/]" if c and style else (c.text() if c else ""))
            table.add_row(str(g), *row)
        console.print(table)
    for line in ("Codes:" + format_grid(cells, cluster).split("Codes:", 1)[1]).splitlines():
        console.print(line, markup=False)


def details(cells: Sequence[Cell]) -> str:
    """One line per cell: both plans and the reason."""
    out = []
    for c in cells:
        two = (
            f"{c.best_2d.scheme.label()} +{c.best_2d.recompute} {states_label(c.best_2d.estimate)}"
            if c.best_2d
            else "-"
        )
        stock = (
            f"{c.best_stock.scheme.label()} +{c.best_stock.recompute} {states_label(c.best_stock.estimate)}"
            if c.best_stock
            else "-"
        )
        ratio = f"{c.ratio:.2f}" if c.ratio is not None else "  - "
        out.append(
            f"{c.model:<8} {c.gpus:>5} {seq_label(c.seq):>5}  {ratio}  2D: {two:<54} stock: {stock:<46} {c.reason}"
        )
    return "\n".join(out)


def grid_records(cells: Sequence[Cell]) -> list[dict[str, object]]:
    """JSON-ready records, one per cell, all with the same keys (None where a side has no feasible plan)."""

    def side(c: Candidate | None) -> dict[str, object] | None:
        if c is None:
            return None
        e = c.estimate
        return {
            "label": c.scheme.label(),
            "kind": c.kind,
            "cp_size": c.scheme.cp_size,
            "hp": c.hp,
            "cp": c.cp,
            "w": c.w,
            "placement": c.placement,
            "recompute": c.recompute,
            "recompute_layers": e.recompute_layers,
            "states": states_label(e),
            "step_ms": round(e.step_s * 1e3, 4),
            "tokens_per_gpu_s": round(e.tokens_per_gpu_s, 2),
            "memory_gb": round(e.memory_gb, 2),
            "flags": c.flags,
        }

    return [
        {
            "model": c.model,
            "tp": GRID_MODELS[c.model]["tp"],
            "pp": GRID_MODELS[c.model]["pp"],
            "gpus": c.gpus,
            "seq": c.seq,
            "ratio": None if c.ratio is None else round(c.ratio, 4),
            "codes": c.codes,
            "reason": c.reason,
            "best_2d": side(c.best_2d),
            "best_stock": side(c.best_stock),
        }
        for c in cells
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_2d.plan grid", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="8xH100", help="cluster preset (default 8xH100)")
    p.add_argument("--models", nargs="+", default=list(GRID_MODELS), choices=list(GRID_MODELS))
    p.add_argument("--gpus", nargs="+", type=int, default=list(GRID_GPUS))
    p.add_argument(
        "--seqs", nargs="+", type=parse_seq, default=list(GRID_SEQS), help="sequence lengths (default 32K .. 4M)"
    )
    p.add_argument("--details", action="store_true", help="also list both plans and the reason for every cell")
    p.add_argument("--json", action="store_true", help="print the cells as a JSON list instead of the tables")
    p.add_argument(
        "--fixed-cp",
        action="store_true",
        help="CP takes all GPUs left by TP x PP (DP = 1) instead of each side picking its best CP",
    )
    p.add_argument(
        "--memory",
        default="auto",
        choices=MEMORY_CHOICES,
        help="memory options (as for a plan): auto (default), dist-opt, all",
    )
    p.add_argument(
        "--fair-memory",
        action="store_true",
        help="stock gets 2D's memory options and, hypothetically, Checkpoint++: what is left is 2D's own",
    )
    p.add_argument(
        "--kernel",
        choices=PLANNED_KERNELS,
        default=None,
        help="the attention kernel 2D runs (default: its selection's, as stock TE's); stock runs TE's kernel",
    )
    args = p.parse_args(argv)
    memory = MemoryPolicy(args.memory, args.fair_memory)
    try:
        get_cluster(args.cluster)
        cells = grid(args.models, args.gpus, args.seqs, args.cluster, not args.fixed_cp, memory, args.kernel)
    except PlanError as err:
        p.error(str(err))
    if args.json:
        import json

        print(json.dumps(grid_records(cells), indent=1))
        return 0
    print_grid(cells, args.cluster, free_cp=not args.fixed_cp, memory=memory)
    if args.details:
        print()
        print(details(cells))
    return 0
