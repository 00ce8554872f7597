"""Text and JSON renderings of a plan (plain aligned text: no extra dependency)."""

from __future__ import annotations

import json
import shutil
import sys
from typing import List, Optional, Sequence

from .candidates import STOCK_KINDS
from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .planner import Candidate, best_by_kind

_LINK = {"nvlink": "NVL", "network": "NET", "mixed": "mix", "-": "-"}
_COLUMNS = ("#", "kind", "hp", "cp", "w", "placement", "a2a", "inner", "outer", "attn ms", "compute",
            "exposed", "comm/comp", "MFU", "tok/GPU/s", "mem GB")
_RIGHT = {"#", "hp", "cp", "w", "attn ms", "compute", "exposed", "comm/comp", "MFU", "tok/GPU/s", "mem GB"}


def seq_label(seq: int) -> str:
    """131072 -> '128K', 1048576 -> '1M'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if seq % size == 0:
            return f"{seq // size}{unit}"
    return str(seq)


def _row(i: int, c: Candidate, cluster: ClusterSpec) -> List[str]:
    e = c.estimate
    links = {p: _LINK[e.links.describe(getattr(e.links, p))] for p in ("a2a", "inner", "outer")}
    mem = f"{e.memory_gb:.1f}" + ("!" if e.memory_gb > cluster.gpu_memory_gb else "")
    ratio = e.comm_total_s / e.compute_s if e.compute_s else float("inf")
    return [str(i), c.kind, str(c.hp), str(c.cp), str(c.w), c.placement if c.kind in ("2d", "a2a+p2p") else "-",
            links["a2a"], links["inner"], links["outer"], f"{e.time_s * 1e3:.2f}", f"{e.compute_s * 1e3:.2f}",
            f"{e.comm_s * 1e3:.2f}", f"{ratio:.2f}", f"{100 * e.mfu:.1f}%", f"{e.tokens_per_gpu_s:,.0f}", mem]


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(r[j]) for r in rows + [list(_COLUMNS)]) for j in range(len(_COLUMNS))]
    fmt = lambda r: "  ".join(v.rjust(wd) if h in _RIGHT else v.ljust(wd)          # noqa: E731
                              for v, wd, h in zip(r, widths, _COLUMNS)).rstrip()
    return [fmt(list(_COLUMNS)), fmt(["-" * wd for wd in widths])] + [fmt(r) for r in rows]


def _sections(candidates: Sequence[Candidate], model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec,
              seq: int, top: Optional[int], causal: bool):
    """(header lines, table rows, footer lines) of a plan."""
    feasible = [c for c in candidates if c.feasible]
    infeasible = [c for c in candidates if not c.feasible]
    shown = feasible if top is None else feasible[:top]
    head = [f"{model.name} on {cluster.name}: {parallel.gpus} GPUs ({cluster.gpus_per_node}/node), "
            f"TP={parallel.tp} PP={parallel.pp} DP={parallel.dp_size} CP={parallel.cp_size}, "
            f"seq {seq} ({seq_label(seq)}), micro-batch {parallel.micro_batch}, {'causal' if causal else 'full'}",
            "attn ms = one layer's attention forward+backward on one GPU (compute + exposed communication); "
            "comm/comp = all communication, unoverlapped, / compute;",
            "MFU and tok/GPU/s are for the whole model (pipeline bubbles and TP communication not modelled). "
            "Links: NVL = NVLink, NET = network, mix = both."]
    rows = [_row(i + 1, c, cluster) for i, c in enumerate(shown)]
    foot: List[str] = []
    if not feasible:
        foot.append("No feasible layout.")
    else:
        if len(shown) < len(feasible):
            foot.append(f"... {len(feasible) - len(shown)} more feasible layouts (--all to list them)")
        best = feasible[0]
        foot += ["", f"Recommended: {best.layout.label()}: {best.time_ms:.2f} ms per layer, "
                     f"MFU {100 * best.estimate.mfu:.1f}%",
                 f"  {best.flags}",
                 "Best of each stock baseline:"]
        kinds = best_by_kind(list(candidates))
        for kind in STOCK_KINDS:
            c = kinds.get(kind)
            if c is None:
                continue
            if c.feasible:
                foot.append(f"  {kind:<10} {c.time_ms:9.2f} ms  ({c.time_ms / best.time_ms:.2f}x the recommended)  "
                            f"{c.flags}")
            else:
                foot.append(f"  {kind:<10} infeasible: {c.reason}")
        if best.estimate.memory_gb > cluster.gpu_memory_gb:
            foot.append(f"Note: estimated memory {best.estimate.memory_gb:.0f} GB exceeds "
                        f"{cluster.gpu_memory_gb:.0f} GB per GPU (no activation recomputation assumed): add "
                        f"--recompute-activations / --recompute-granularity full, more TP/PP, or more GPUs.")
    if infeasible:
        foot += ["", f"Infeasible ({len(infeasible)}):"]
        foot += [f"  {c.layout.label():<34} {c.reason}" for c in infeasible]
    return head, rows, foot


def format_plan(candidates: Sequence[Candidate], model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                seq: int, top: Optional[int] = 15, causal: bool = True) -> str:
    """The plan as plain text: a header, the fastest ``top`` feasible layouts (all when None), the recommendation
    with its flags, the best of each stock baseline, and the infeasible layouts with their reasons."""
    head, rows, foot = _sections(candidates, model, cluster, parallel, seq, top, causal)
    return "\n".join(head + ([""] + _table(rows) if rows else []) + foot)


def print_plan(candidates: Sequence[Candidate], model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec,
               seq: int, top: Optional[int] = 15, causal: bool = True, stream=None) -> None:
    """Print the plan: with ``rich`` when it is installed and ``stream`` is a terminal, else ``format_plan``."""
    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plan(candidates, model, cluster, parallel, seq, top, causal), file=stream)
        return
    head, rows, foot = _sections(candidates, model, cluster, parallel, seq, top, causal)
    console = Console(file=stream, highlight=False, soft_wrap=True,
                      width=max(shutil.get_terminal_size((160, 24)).columns, 150))
    for line in head:
        console.print(line, markup=False)
    if rows:
        table = Table(header_style="bold")
        for col in _COLUMNS:
            table.add_column(col, justify="right" if col in _RIGHT else "left", no_wrap=True)
        for i, r in enumerate(rows):
            table.add_row(*r, style="bold green" if i == 0 else None)
        console.print(table)
    for line in foot:
        console.print(line, markup=False)


def plan_json(candidates: Sequence[Candidate]) -> str:
    """A JSON list, one object per candidate (see Candidate.to_dict)."""
    return json.dumps([c.to_dict() for c in candidates], indent=1)
