"""Text and JSON renderings of a plan (plain aligned text: no extra dependency; rich when on a terminal).

JSON (``plan_json``): one list, one object per candidate, every object with the same keys: ``job`` (the job's
metadata, identical in every row), ``rank`` (1-based position), ``recommended`` (true on at most one row) and
the row fields of ``planner.ROW_KEYS``. Rows that cannot run, or do not fit, carry None where a value does not
apply. A list (not an object) so that consumers of the earlier output keep working.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from ..layout.choices import DkvCommDtype, MlaRing, PlanKind, RecomputeMode
from .candidates import STOCK_KINDS
from .console import terminal_console
from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .memory import LAYER_RECOMPUTE_MODES
from .memory_options import MemoryPolicy
from .memory_options import describe as describe_states
from .planner import AUTO, Candidate, best_by_kind, recommended

SCHEMA_VERSION = 6  # 6: the kernels each side runs; 5: recompute mode "ckpt++inputs"
_LINK = {"nvlink": "NVL", "network": "NET", "mixed": "mix", "-": "-"}
_COLUMNS = (
    "#",
    "kind",
    "hp",
    "cp",
    "w",
    "placement",
    "a2a",
    "inner",
    "outer",
    "attn ms",
    "compute",
    "exposed",
    "comm/comp",
    "recompute",
    "states",
    "step ms",
    "MFU",
    "tok/GPU/s",
    "mem GB",
)
_RIGHT = {"#", "hp", "cp", "w", "attn ms", "compute", "exposed", "comm/comp", "step ms", "MFU", "tok/GPU/s", "mem GB"}


def seq_label(seq: int) -> str:
    """131072 -> '128K', 1048576 -> '1M'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if seq % size == 0:
            return f"{seq // size}{unit}"
    return str(seq)


def _row(i: int, c: Candidate, cluster: ClusterSpec) -> list[str]:
    e = c.estimate
    links = {p: _LINK[e.links.describe(getattr(e.links, p))] for p in ("a2a", "inner", "outer")}
    mem = f"{e.memory_gb:.1f}" + ("!" if not c.fits_memory else "")
    ratio = e.comm_total_s / e.compute_s if e.compute_s else float("inf")
    w = "any" if c.note.startswith("w has no effect") else str(c.w)
    kind = " ".join(x for x in (c.kind, c.packing, c.scheme.mla_ring) if x)
    return [
        str(i),
        kind,
        str(c.hp),
        str(c.cp),
        w,
        c.placement if c.kind in (PlanKind.TWO_D, PlanKind.A2A_P2P) else "-",
        links["a2a"],
        links["inner"],
        links["outer"],
        f"{e.time_s * 1e3:.2f}",
        f"{e.compute_s * 1e3:.2f}",
        f"{e.comm_s * 1e3:.2f}",
        f"{ratio:.2f}",
        recompute_label(e),
        states_label(e),
        f"{e.step_s * 1e3:,.0f}",
        f"{100 * e.mfu:.1f}%",
        f"{e.tokens_per_gpu_s:,.0f}",
        mem,
    ]


def recompute_label(e) -> str:
    """'none', 'selective', 'full', 'ckpt++', 'ckpt++inputs', or 'ckpt++ 23/32' when only some layers are
    recomputed."""
    if e.recompute in LAYER_RECOMPUTE_MODES and e.recompute_layers < e.layers:
        return f"{e.recompute} {e.recompute_layers}/{e.layers}"
    return e.recompute


def states_label(e) -> str:
    """The memory option of an estimate ('dist-opt', 'fsdp-z3', 'hz-z3/8', ...)."""
    return e.states.option.label if e.states is not None else "dist-opt"


def memory_line(e) -> str:
    """The parts of an estimate's peak memory and its sharding traffic, one line."""
    mb, gb = e.memory, 1e9
    other = (
        f"activations {e.activation_gb:.1f} + logits {mb.logits / gb:.1f} + attention buffers "
        f"{mb.comm_buffers / gb:.1f} GB"
    )
    if e.states is None:
        return f"memory: model states {mb.model_states / gb:.1f} GB (distributed optimizer) + {other}"
    return f"memory: {describe_states(e.states, e.layers)}; {other}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[j]) for r in rows + [list(_COLUMNS)]) for j in range(len(_COLUMNS))]

    def fmt(r: list[str]) -> str:
        return "  ".join(v.rjust(wd) if h in _RIGHT else v.ljust(wd) for v, wd, h in zip(r, widths, _COLUMNS)).rstrip()

    return [fmt(list(_COLUMNS)), fmt(["-" * wd for wd in widths])] + [fmt(r) for r in rows]


def memory_advice(c: Candidate, cluster: ClusterSpec, parallel: ParallelSpec) -> str:
    """What would make the least-memory layout ``c`` fit: its parts and the levers that shrink each.

    Everything but the replicated model states (bf16 weights + fp32 gradients) shrinks as 1/CP at a fixed DP, so
    CP must grow by about (memory - replicated) / (budget - replicated) when the replicated part fits at all."""
    e, mb, gb = c.estimate, c.estimate.memory, 1e9
    budget = cluster.memory_budget_gb
    replicated = (mb.model_states - mb.sharded_states) / gb
    tips = []
    if len({o.recompute for o in c.options}) == 1 and e.recompute != RecomputeMode.FULL:
        tips.append(f"activation recompute (only recompute={e.recompute} was tried: --recompute auto)")
    if replicated < budget:
        factor = (e.memory_gb - replicated) / (budget - replicated)
        tips.append(
            f"about {factor:.1f}x the context-parallel size (more GPUs, or fewer for DP): activations "
            f"{e.activation_gb:.1f} GB, logits, buffers and optimizer states shrink as 1/CP; or a "
            f"shorter sequence"
        )
    else:
        tips.append(f"more CP alone cannot fit: the bf16 weights and fp32 gradients take {replicated:.1f} GB")
    if e.states is None or e.states.option.zero_stage < 3:
        tips.append(
            f"larger TP/PP (now {parallel.tp}/{parallel.pp}) or sharding gradients and parameters (Hybrid "
            f"ZeRO: --memory auto) for the {replicated:.1f} GB of replicated weights and gradients"
        )
    else:
        tips.append(
            f"larger TP/PP (now {parallel.tp}/{parallel.pp}): the model states are sharded already "
            f"({states_label(e)}, {mb.model_states / gb:.1f} GB)"
        )
    tips.append(f"GPUs with more memory (budget now {budget:.1f} GB)")
    return (
        f"smallest memory found: {e.memory_gb:.1f} GB per GPU ({c.scheme.label()}, "
        f"recompute={recompute_label(e)}), {e.memory_gb - budget:.1f} GB over the budget; what would help: "
        + "; ".join(tips)
    )


def memory_policy_text(memory: MemoryPolicy) -> str:
    """What the memory options of a plan were."""
    if memory.choice == "dist-opt":
        return "memory options: the distributed optimizer only (--memory dist-opt)"
    if memory.choice == "stock":
        return "memory options: Megatron's own for every kind (--memory stock; no Hybrid ZeRO partial sharding)"
    who = (
        "stock gets 2D's Hybrid ZeRO and, hypothetically, Checkpoint++ (--fair-memory)"
        if memory.fair
        else "each side its own (--fair-memory: stock gets 2D's)"
    )
    extra = "; with optimizer sharded wider (gradient clipping off)" if memory.choice == "all" else ""
    return f"memory options: {who}{extra}; global batch {memory.global_batch_tokens / 2**20:g}M tokens (--global-batch)"


def kernels_line(candidates: Sequence[Candidate], cluster: ClusterSpec) -> str:
    """Which attention kernel each side runs, at what share of peak (a measured --attn-eff replaces every rate)."""
    parts = []
    te = [PlanKind.P2P, PlanKind.A2A, PlanKind.A2A_P2P]
    for side, kinds in (("stock (TE)", te), ("ds-ulysses", [PlanKind.DS_ULYSSES]), ("2D", [PlanKind.TWO_D])):
        kernel = next((c.kernel for c in candidates if c.kind in kinds and c.kernel), None)
        if kernel is not None:
            rate = cluster.kernel_efficiency(kernel)
            parts.append(f"{side} {kernel} at {100 * rate:.1f}% of peak")
    origin = (
        "--attn-eff / calibrated, every kernel"
        if cluster.attn_efficiency is not None
        else f"{cluster.arch}; rates and sources: megatron_2d.plan.kernel_rates"
    )
    return f"attention kernels: {', '.join(parts)} ({origin})"


def _sections(
    candidates: Sequence[Candidate],
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    top: int | None,
    causal: bool,
    window=None,
    memory: MemoryPolicy = MemoryPolicy(),
):
    """(header lines, table rows, footer lines) of a plan."""
    feasible = [c for c in candidates if c.feasible]
    oom = [c for c in candidates if not c.feasible and c.runs]
    infeasible = [c for c in candidates if not c.runs]
    shown = feasible if top is None else feasible[: max(top, 0)]
    if window is None:
        win = ""
    elif isinstance(window, int):
        win = f", sliding window {window}"
    else:
        win = ", per-layer windows " + ",".join("full" if w is None else str(w) for w in window) + " (repeated)"
    head = [
        f"{model.name} on {cluster.name}: {parallel.gpus} GPUs ({cluster.gpus_per_node}/node), "
        f"TP={parallel.tp} PP={parallel.pp} DP={parallel.dp_size} CP={parallel.cp_size}, "
        f"seq {seq} ({seq_label(seq)}), micro-batch {parallel.micro_batch}, {'causal' if causal else 'full'}"
        f"{win}; memory budget {cluster.memory_budget_gb:.1f} GB per GPU",
        "attn ms = one layer's attention forward+backward on one GPU (compute + exposed communication); "
        "comm/comp = all communication, unoverlapped, / compute;",
        "recompute = the cheapest mode that fits (ckpt++ = Selective Checkpoint++ keeping attention outputs, "
        "ckpt++inputs = keeping its head-layout inputs too); step ms = whole model, one micro-batch, recompute "
        "included; ranked by step ms.",
        "MFU and tok/GPU/s are for the whole model (pipeline bubbles and TP communication not modelled). "
        "Links: NVL = NVLink, NET = network, mix = both.",
        f"link efficiency: {cluster.links.describe()}; states = how model states are held (dist-opt: "
        f"distributed optimizer, fsdp-zN: megatron-fsdp ZeRO-N, hz-zN/S: Hybrid ZeRO-N over S ranks), its "
        f"communication in step ms; {memory_policy_text(memory)}",
        kernels_line(candidates, cluster),
    ]
    rows = [_row(i + 1, c, cluster) for i, c in enumerate(shown)]
    foot: list[str] = []
    best = recommended(candidates)
    if best is None:
        foot.append("No feasible layout.")
        if oom:
            foot.append("  " + memory_advice(oom[0], cluster, parallel))
        else:
            foot.append("  no layout can run at all (reasons below: heads, KV heads, sequence divisibility)")
    else:
        if len(shown) < len(feasible):
            foot.append(f"... {len(feasible) - len(shown)} more feasible layouts (--all to list them)")
        foot += [
            "",
            f"Recommended: {best.scheme.label()}, kernel {best.kernel}, recompute={recompute_label(best.estimate)}, "
            f"states={states_label(best.estimate)}: {best.step_ms:,.0f} ms per step, {best.time_ms:.2f} ms "
            f"attention per layer, MFU {100 * best.estimate.mfu:.1f}%, {best.estimate.memory_gb:.1f} GB "
            f"per GPU",
            f"  {best.flags}",
            f"  {memory_line(best.estimate)}",
        ]
        if best.note:
            foot.append(f"  ({best.note})")
        if model.mla is not None:
            foot.append("Best 2D layout of each MLA ring (expanded: per-head K/V; latent: --cp-2d-mla-ring latent):")
            for ring in MlaRing:
                c = next((c for c in candidates if c.scheme.mla_ring == ring and c.feasible), None)
                if c is not None:
                    foot.append(
                        f"  {ring:<10} {c.step_ms:11,.0f} ms/step ({c.step_ms / best.step_ms:.2f}x the "
                        f"recommended), {c.time_ms:.2f} ms attention/layer, {c.scheme.label()}, "
                        f"recompute={recompute_label(c.estimate)}"
                    )
        foot.append("Best of each stock baseline:")
        kinds = best_by_kind(list(candidates))
        for kind in STOCK_KINDS:
            c = kinds.get(kind)
            if c is None:
                continue
            if c.feasible:
                foot.append(
                    f"  {kind:<10} {c.step_ms:11,.0f} ms/step ({c.step_ms / best.step_ms:.2f}x the "
                    f"recommended), recompute={recompute_label(c.estimate)}, states="
                    f"{states_label(c.estimate)}  {c.flags}"
                )
            else:
                foot.append(f"  {kind:<10} infeasible: {c.reason}")
    if oom:
        foot += ["", f"Do not fit in memory with any recompute mode ({len(oom)}):"]
        listed = oom if top is None else oom[: max(top, 1)]
        foot += [f"  {c.scheme.label():<34} {c.reason}" for c in listed]
        if len(listed) < len(oom):
            foot.append(f"  ... {len(oom) - len(listed)} more (--all to list them)")
    if infeasible:
        foot += ["", f"Infeasible ({len(infeasible)}):"]
        foot += [f"  {c.scheme.label():<34} {c.reason}" for c in infeasible]
    return head, rows, foot


def format_plan(
    candidates: Sequence[Candidate],
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    top: int | None = 15,
    causal: bool = True,
    window=None,
    memory: MemoryPolicy = MemoryPolicy(),
) -> str:
    """The plan as plain text: a header, the fastest ``top`` feasible layouts (all when None), the recommendation
    with its flags, the best of each stock baseline, and the infeasible layouts with their reasons."""
    head, rows, foot = _sections(candidates, model, cluster, parallel, seq, top, causal, window, memory)
    return "\n".join(head + ([""] + _table(rows) if rows else []) + foot)


def print_plan(
    candidates: Sequence[Candidate],
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    top: int | None = 15,
    causal: bool = True,
    stream=None,
    window=None,
    memory: MemoryPolicy = MemoryPolicy(),
) -> None:
    """Print the plan: with ``rich`` when it is installed and ``stream`` is a terminal, else ``format_plan``."""
    stream = stream or sys.stdout
    console = terminal_console(stream, min_width=150)
    if console is None:
        print(format_plan(candidates, model, cluster, parallel, seq, top, causal, window, memory), file=stream)
        return
    from rich.table import Table

    head, rows, foot = _sections(candidates, model, cluster, parallel, seq, top, causal, window, memory)
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


def job_metadata(
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    causal: bool = True,
    window=None,
    recompute=AUTO,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    memory: MemoryPolicy = MemoryPolicy(),
) -> dict[str, object]:
    """The job a plan is for: model, cluster (with the memory budget), parallel sizes, sequence and knobs."""
    return {
        "schema_version": SCHEMA_VERSION,
        "model": asdict(model),
        "cluster": {**asdict(cluster), "memory_budget_gb": round(cluster.memory_budget_gb, 3)},
        "parallel": {
            "gpus": parallel.gpus,
            "tp": parallel.tp,
            "pp": parallel.pp,
            "dp": parallel.dp_size,
            "cp": parallel.cp_size,
            "micro_batch": parallel.micro_batch,
        },
        "seq": seq,
        "causal": causal,
        "window": window if window is None or isinstance(window, int) else list(window),
        "recompute": recompute if isinstance(recompute, str) else list(recompute),
        "dkv_comm_dtype_2d": dkv_comm_dtype,
        "memory": asdict(memory),
    }


def plan_records(candidates: Sequence[Candidate], job: dict[str, object] | None = None) -> list[dict[str, object]]:
    """One record per candidate: {"job", "rank", "recommended", **Candidate.to_dict()} (same keys in every one)."""
    best = recommended(candidates)
    return [{"job": job, "rank": i + 1, "recommended": c is best, **c.to_dict()} for i, c in enumerate(candidates)]


def plan_json(candidates: Sequence[Candidate], job: dict[str, object] | None = None) -> str:
    """``plan_records`` as JSON text (see the module docstring for the schema)."""
    return json.dumps(plan_records(candidates, job), indent=1)
