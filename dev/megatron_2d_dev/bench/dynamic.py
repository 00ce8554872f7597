"""Dynamic (hybrid) context parallelism under 2D on CPU ranks: the step time of one global batch of a sequence mix,
dynamic against static, through Megatron's own schedules.

    python tools/bench_dynamic.py --ranks 8 --mix long-tail --tokens 16K --max-seqlen-per-rank 256
    python tools/bench_dynamic.py --ranks 8 --mix equal --tokens 16K --max-seqlen-per-rank 256

The batch (the same in every row): one global batch of the mix's sequences (megatron_2d.plan.lengths.SEQUENCE_MIXES;
long-tail at 16K tokens: ~118 sequences of 64-128 tokens and 3 of 1-2K, the issue's "1-2K with a few at 16-32K"
scaled by 1/16 for CPU ranks), packed first-fit decreasing into samples of seq_length = CP_static x
max_seqlen_per_rank tokens as Megatron's SFTDataset gives them (each sequence padded to the row's 2 x CP, the last
one of a pack taking the pack's end padding, prompts of 2 tokens masked). Model: a tiny megatron-core GPTModel (GQA,
--dtype, bf16 by default: Transformer Engine's fused attention takes bf16 / fp16 only, so the stock rows need it and
every row runs it), one training step (forward, backward, the gradients' all-reduce over DP x CP).

Rows
    dynamic 2D        --hybrid-context-parallel: Megatron's HybridCPDataLoaderWrapper (lengths gathered over DP,
                      BalancedCPScheduler, sequences rerouted by all_to_all) and its hybrid schedule (one sequence
                      per micro-batch, a barrier between rounds); each CP group size runs its 2D layout (--layouts,
                      else the planner's rule, megatron_2d.plan.dynamic)
    dynamic, one ring the same, every group size as hp 1 x one ring of g ranks: the layout stock dynamic CP runs
                      (Transformer Engine's p2p), here on this project's op
    static 2D         --context-parallel-size CP_static (what Megatron gives the longest sequence), DP = N / CP_static;
                      each packed sample one THD micro-batch (Megatron's per-document zigzag) through Megatron's
                      no-pipelining schedule; the rule's layout for CP_static
    static, one ring  the same with hp 1 x one ring of CP_static: stock static p2p's layout, on this project's op
    stock dynamic CP  --hybrid-context-parallel with megatron-core's own TEDotProductAttention over Transformer
                      Engine --te-release's p2p (context_parallel.py, in TE's CPU context), which re-binds TE's CP
                      group from each micro-batch's PackedSeqParams.cp_group; the same data wrapper, scheduler and
                      schedule as dynamic 2D. megatron-core 0.19.2 as released crashes on this path at the first
                      micro-batch of a group of 2 or more (RoPE on the static group; TE's CP stream never allocated):
                      the row runs with Megatron-LM #6821's two fixes (megatron_2d_dev.stock_dynamic_cp)
    static stock CP   --cp-comm-type p2p at CP_static with TEDotProductAttention: TE's own THD context parallelism
                      over the same packed micro-batches as static 2D (each document padded to 2 x CP)

The stock rows run the stock-CP spec (megatron_2d_dev.stock_cp_spec: megatron-core's local linears and norms);
the 2D rows the 2d spec, whose linears and norms are the same local ones. The TE context is entered by the parent
with the CUDA claim only around TE's attention forward (every other op of every row runs without it); TE's fused
attention is the CPU stand-in's, the cpu_flash kernel the 2D rows run.

Columns: wall ms = median over the timed steps of the slowest rank's step (8 ranks on 2 shared cores: roughly the
sum of the ranks' work over 2); cpu ms = median of the CPU seconds the ranks spent per step, summed over ranks (the
work, apart from how the ranks share cores); "vs static 2D" = static 2D's wall / the row's (above 1: faster);
loss = the step's loss, which every row must give alike (the same training: "check" says MISMATCH beyond the
dtype's training bound, megatron_2d.testing.reference, of static 2D's loss, or of the first row's without it).
Rows run in rounds, rotated each round (harness.round_order); each round rebuilds the row's parallel state and model
(its 2D groups), warms up one step and times ``--repeats`` steps. Timing is not a test: compare rows of one run, on
a quiet machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2d.layout.dynamic import (
    format_dynamic_layouts,
    hybrid_group_sizes,
    megatron_cp_size,
    parse_dynamic_layouts,
)
from megatron_2d.plan.console import parse_seq
from megatron_2d.plan.dynamic import pack_sequences
from megatron_2d.plan.lengths import SEQUENCE_MIXES, sequence_lengths
from megatron_2d.testing.reference import TOLERANCES

from ..cli import add_arguments, add_output_arguments, render_table
from .harness import round_order
from .runners import TE_RELEASE

ROWS = ("dynamic 2D", "dynamic, one ring", "static 2D", "static, one ring", "stock dynamic CP", "static stock CP")
STOCK_ROWS = ROWS[4:]
"""The rows that run Transformer Engine's context parallelism (megatron_2d_dev.stock_dynamic_cp)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
STOCK_DYNAMIC_NOTE = (
    "note: stock dynamic CP = megatron-core 0.19.2's hybrid CP over TEDotProductAttention and Transformer Engine "
    "{release}'s p2p, with Megatron-LM #6821's two fixes (RoPE on the micro-batch's CP group, TE's CP stream "
    "allocated): 0.19.2 as released stops at the first micro-batch on a group of 2 or more "
    "(megatron_2d_dev.stock_dynamic_cp)"
)


@dataclass(frozen=True)
class Job:
    """What every rank runs: the mix, the model, the sizes."""

    mix: str
    tokens: int
    max_seqlen_per_rank: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    layouts: str | None
    rounds: int
    repeats: int
    seed: int = 0
    dtype: str = "fp32"
    """A key of :data:`DTYPES`: the model's parameters and activations."""


def sequences(job: Job) -> list[int]:
    return sequence_lengths(job.mix, job.tokens, job.seed).tolist()


def static_cp(job: Job, ranks: int) -> int:
    """The static CP size: the group size Megatron gives the longest sequence (the next it built)."""
    need = megatron_cp_size(max(sequences(job)), job.max_seqlen_per_rank)
    return next(s for s in hybrid_group_sizes(ranks) if s >= need)


def samples_for(job: Job, ranks: int, pad_unit: int):
    """The global batch as SFTDataset packs it (module docstring), each sequence padded to a multiple of
    ``pad_unit`` tokens; the sequences' content does not depend on the padding (every row trains the same data)."""
    from ..dynamic_cp import sequence_samples

    lengths = sequences(job)
    capacity = static_cp(job, ranks) * job.max_seqlen_per_rank
    packs = pack_sequences(lengths, capacity, pad_unit // 2)
    padded = []
    for indices in packs:
        slots = [-(-lengths[i] // pad_unit) * pad_unit for i in indices]
        slots[-1] += capacity - sum(slots)  # the last conversation takes the pack's end padding
        padded.append(slots)
    return packs, sequence_samples(lengths, packs, padded, vocab=128, seed=job.seed)


def tiny_config(job: Job):
    from ..tiny_gpt import TinyGPTConfig

    dtype = DTYPES[job.dtype]
    precision = dict(bf16=True, params_dtype=dtype) if dtype == torch.bfloat16 else {}
    return TinyGPTConfig(
        num_layers=job.layers,
        hidden_size=job.hidden,
        num_attention_heads=job.heads,
        num_query_groups=job.kv_heads,
        vocab_size=128,
        seq_length=job.tokens,
        config_overrides=dict(apply_rope_fusion=False, **precision),
    )


def one_ring_layouts(ranks: int) -> str:
    """Every group size as hp 1 x one ring of all its ranks (stock dynamic CP's layout)."""
    from megatron_2d.layout.topology import Layout2D

    return format_dynamic_layouts({g: Layout2D(g, 1) for g in hybrid_group_sizes(ranks) if g > 1})


def build_row(row: str, job: Job, ranks: int):
    """One row's training step on this rank (it returns the loss reports); parallel state and model built here."""
    from megatron_2d.layout.topology import Layout2D
    from megatron_2d.megatron.dynamic import RULE_CLUSTER, rule_model
    from megatron_2d.plan.dynamic import layout_for_size
    from megatron_2d.plan.hardware import get_cluster

    from .. import dynamic_cp

    cfg = tiny_config(job)
    if row in STOCK_ROWS:
        return build_stock_row(row, job, ranks, cfg)
    if row.startswith("dynamic"):
        layouts = one_ring_layouts(ranks) if row == "dynamic, one ring" else job.layouts
        _, samples = samples_for(job, ranks, pad_unit=2)
        model, config = dynamic_cp.hybrid_model(cfg, 1, job.max_seqlen_per_rank, layouts)
        return lambda: dynamic_cp.hybrid_train_step(model, config, samples)
    cp = static_cp(job, ranks)
    _, samples = samples_for(job, ranks, pad_unit=2 * cp)
    layout = Layout2D(cp, 1)  # static, one ring (and CP = 1)
    if row == "static 2D" and cp > 1:  # the layout dynamic 2D runs at this size: given, else the rule's
        given = parse_dynamic_layouts(job.layouts).get(cp)
        rule = layout_for_size(
            rule_model(_rule_source(job)), get_cluster(RULE_CLUSTER), cp, cp * job.max_seqlen_per_rank
        )
        layout = given if given is not None else rule[0]
    model = dynamic_cp.static_model(
        cfg, cp, layout.head_parallel_size, inner_ring_size=layout.inner_ring_size, placement=layout.placement
    )
    return lambda: dynamic_cp.static_train_step(model, samples)


def build_stock_row(row: str, job: Job, ranks: int, cfg):
    """A stock row's training step (module docstring): megatron-core's TEDotProductAttention over TE's p2p, in the
    TE context the parent entered; the same samples as the 2D row of the same kind."""
    from .. import dynamic_cp, stock_dynamic_cp

    if row == "stock dynamic CP":
        _, samples = samples_for(job, ranks, pad_unit=2)
        model, config = stock_dynamic_cp.stock_hybrid_model(cfg, job.max_seqlen_per_rank)

        def step():
            with stock_dynamic_cp.hybrid_cp_fixes():
                return dynamic_cp.hybrid_train_step(model, config, samples)

        return step
    cp = static_cp(job, ranks)
    _, samples = samples_for(job, ranks, pad_unit=2 * cp)
    model = stock_dynamic_cp.stock_static_model(cfg, cp)
    return lambda: dynamic_cp.static_train_step(model, samples)


def _rule_source(job: Job):
    """The fields the rule reads of a model config, for the static row's layout (the same rule as dynamic 2D)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_attention_heads=job.heads,
        num_query_groups=job.kv_heads,
        kv_channels=job.hidden // job.heads,
        hidden_size=job.hidden,
        num_layers=job.layers,
        ffn_hidden_size=4 * job.hidden,
    )


def _loss(reports) -> torch.Tensor:
    from megatron.core import parallel_state

    local = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return local


def run_ranks(rank: int, world: int, job: Job, rows: list[str]) -> dict:
    """Every row, ``job.rounds`` rounds (rotated), on this rank: per row the steps' (wall s of the slowest rank, CPU
    s summed over ranks) and the step's loss."""
    from ..megatron_cpu import install_megatron_cpu_shims

    install_megatron_cpu_shims()
    timed: dict[str, list[tuple[float, float]]] = {row: [] for row in rows}
    losses: dict[str, float] = {}
    for r in range(job.rounds):
        for i in round_order(list(range(len(rows))), r):
            row = rows[i]
            step = build_row(row, job, world)
            loss = _loss(step())  # warm-up
            losses[row] = float(loss[0] / loss[1])
            for _ in range(job.repeats):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                wall = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
                both = wall.clone()
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                dist.all_reduce(both, op=dist.ReduceOp.SUM)
                timed[row].append((float(wall[0]), float(both[1])))
    return {"timed": timed, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, ranks=8, layers=2, hidden=128, heads=8, kv_heads=2, repeats=2)
    parser.add_argument("--mix", choices=SEQUENCE_MIXES, default="long-tail", help="sequence mix (default long-tail)")
    parser.add_argument("--tokens", type=parse_seq, default=16384, help="tokens of the global batch (default 16K)")
    parser.add_argument(
        "--max-seqlen-per-rank", type=parse_seq, default=256, help="--max-seqlen-per-dp-cp-rank (default 256)"
    )
    parser.add_argument("--layouts", default=None, help="--cp-2d-dynamic-layouts of dynamic 2D (default: the rule)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, rotated (default 3)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, help="rows to run (default all)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bf16", help="every row's dtype (default bf16; the stock rows need it)"
    )
    parser.add_argument(
        "--te-release",
        default=TE_RELEASE,
        help=f"the Transformer Engine release of the stock rows (default {TE_RELEASE})",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    stock = [row for row in args.rows if row in STOCK_ROWS]
    if stock and args.dtype != "bf16":
        parser.error(
            f"rows {stock} run Transformer Engine's fused attention, which takes bf16 / fp16 only: --dtype bf16, or "
            f"leave them out of --rows"
        )
    job = Job(
        args.mix,
        args.tokens,
        args.max_seqlen_per_rank,
        args.layers,
        args.hidden,
        args.heads,
        args.kv_heads,
        args.layouts,
        args.rounds,
        args.repeats,
        dtype=args.dtype,
    )
    from megatron_2d.testing.distributed import run_on_ranks

    notes = {row: why for row in stock if (why := stock_unavailable(args.te_release))}
    runnable = [row for row in args.rows if row not in notes]
    with stock_context(args.te_release if set(stock) - set(notes) else None):
        result = run_on_ranks(args.ranks, run_ranks, job, runnable, timeout_s=args.timeout)[0]
    print(describe(job, args.ranks))
    records = table(result, args.rows, DTYPES[job.dtype], notes)
    if "stock dynamic CP" in result["timed"]:
        print(STOCK_DYNAMIC_NOTE.format(release=args.te_release))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"job": vars(args), "rows": records}, fh, indent=1)


def stock_unavailable(release: str) -> str | None:
    """Why the stock rows cannot run here (None: they can)."""
    from .. import te_package

    if te_package.is_installed(release):
        return None
    return (
        f"n/a: Transformer Engine {release} is not installed under {te_package.releases_dir()} "
        f"(python -m megatron_2d_dev.te_package install)"
    )


@contextlib.contextmanager
def stock_context(release: str | None) -> Iterator[None]:
    """The CPU shims, and with ``release`` Transformer Engine's CPU context with megatron-core's TE extension, for
    the ranks forked inside (the claim only around TE's attention: megatron_2d_dev.stock_cp_spec). The model
    modules are imported first, without TE: GPTModel's final norm and the 2d spec module's default spec are chosen
    when first imported, and must be the local ones (megatron_2d_dev.stock_cp_spec refuses TE's norm)."""
    from megatron_2d.megatron import spec  # noqa: F401

    from .. import dynamic_cp, stock_dynamic_cp  # noqa: F401
    from ..megatron_cpu import install_megatron_cpu_shims

    install_megatron_cpu_shims()
    if release is None:
        yield
        return
    from ..te_context_parallel import te_context_parallel_on_cpu

    with te_context_parallel_on_cpu(release, megatron=True, claim_cuda=False):
        yield


def describe(job: Job, ranks: int) -> str:
    lengths = sorted(sequences(job))
    sizes = {}
    for n in lengths:
        g = megatron_cp_size(n, job.max_seqlen_per_rank)
        sizes[g] = sizes.get(g, 0) + 1
    return (
        f"{job.mix}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {lengths[-1]}, median "
        f"{lengths[len(lengths) // 2]}; {ranks} ranks, max_seqlen_per_dp_cp_rank {job.max_seqlen_per_rank}: "
        f"sequences per CP size {dict(sorted(sizes.items()))}, static CP {static_cp(job, ranks)}; model "
        f"{job.layers} layers, hidden {job.hidden}, {job.heads} heads / {job.kv_heads} K/V"
    )


def table(
    result: dict, rows: list[str], dtype: torch.dtype = torch.float32, notes: dict[str, str] | None = None
) -> list[dict]:
    """Print the table; the JSON records. ``notes``: why a row did not run."""
    timed, losses = result["timed"], result["losses"]
    median = {row: statistics.median(w for w, _ in timed[row]) for row in timed}
    cpu = {row: statistics.median(c for _, c in timed[row]) for row in timed}
    base = median.get("static 2D")
    reference = losses.get("static 2D", next(iter(losses.values()), None))
    bound = TOLERANCES[dtype].training.loss
    body, records = [], []
    for row in rows:
        if row not in timed:
            note = (notes or {}).get(row, "n/a: not run")
            body.append([row, "-", "-", "-", "-", note])
            records.append({"row": row, "note": note})
            continue
        error = abs(losses[row] - reference) / abs(reference)
        same = error <= bound
        ratio = f"{base / median[row]:.2f}x" if base else "-"
        body.append(
            [
                row,
                f"{median[row] * 1e3:.0f}",
                f"{cpu[row] * 1e3:.0f}",
                ratio,
                f"{losses[row]:.6f}",
                f"{'ok' if same else 'MISMATCH'} {error:.1e}",
            ]
        )
        records.append(
            {
                "row": row,
                "wall_ms": median[row] * 1e3,
                "cpu_ms": cpu[row] * 1e3,
                "loss": losses[row],
                "same": same,
                "loss_error": error,
                "steps": [[w * 1e3, c * 1e3] for w, c in timed[row]],
            }
        )
    render_table(
        f"dynamic vs static CP, one training step ({_DTYPE_NAMES[dtype]}; loss check: relative to "
        f"{'static 2D' if 'static 2D' in losses else 'the first row'}, bound {bound:g})",
        ["row", "wall ms", "cpu ms", "vs static 2D", "loss", "check"],
        body,
    )
    return records


_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
