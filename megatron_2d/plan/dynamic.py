"""Dynamic (hybrid) context parallelism in the planner: the 2D layout each group size runs, and a length mix planned
both ways (one static CP size for every sequence, or a CP group per sequence as Megatron's hybrid CP gives them).

The layout rule (what the Megatron backend asks when no ``--cp-2d-dynamic-layouts`` entry names a size)
    :func:`layout_for_size`: for a group of g ranks, the 2D layout (hp, cp, w, placement) whose predicted attention
    of one layer (forward + backward) is the shortest for the longest sequence such a group gets, g x
    max_seqlen_per_dp_cp_rank tokens, with the model's heads (hp dividing its query heads per TP rank; K/V heads
    replicated beyond its K/V heads). Ties go to one ring (w = cp), head_first, then the smaller hp.

A length mix, both ways (:func:`plan_length_mix`, ``python -m megatron_2d.plan --dynamic``)
    static   CP = the size Megatron would give the longest sequence, DP = N / CP. Sequences are packed first-fit
             decreasing into samples of CP x max_seqlen_per_dp_cp_rank tokens; each sample runs as one packed THD
             batch (Megatron's per-document zigzag) with the best 2D layout of that CP size; samples go to the DP
             replicas longest first, each to the least loaded. Step: the most loaded replica.
    dynamic  each sequence of L tokens gets g = max(1, 2^ceil(log2(L / max_seqlen))) ranks and the rule's layout for
             g; sequences go longest first to the aligned slice of g ranks whose busiest rank is least loaded
             (list scheduling). Step: the most loaded rank. Megatron's scheduler also puts a barrier between its
             rounds of groups, which this leaves out: an optimistic bound on what dynamic CP reaches.
    Each sequence or sample is priced by the planner's whole-model step (:func:`megatron_2d.plan.planner.evaluate`,
    no recompute, the distributed optimizer), so linear layers and all-to-alls count as well as the ring.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..layout.choices import PackingMode, Placement, PlanKind, RecomputeMode
from ..layout.dynamic import format_dynamic_layouts, hybrid_group_sizes, hybrid_slices, megatron_cp_size
from ..layout.heads import head_split_problem
from ..layout.topology import Layout2D, every_layout
from .candidates import Scheme
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError
from .job import Job
from .memory_options import DIST_OPT
from .planner import evaluate
from .step import estimate


def _padded(length: int, size: int) -> int:
    """``length`` rounded up to a multiple of 2 * size (the zigzag's chunks)."""
    return -(-length // (2 * size)) * (2 * size)


def size_candidates(model: ModelSpec, size: int, tp: int = 1, placement: str | None = None) -> list[Layout2D]:
    """Every 2D layout of a group of ``size`` ranks whose hp splits the query heads per TP rank (``placement``: only
    that one, when given; w = 1 left out where it is the same ring as w = cp)."""
    heads = model.heads // tp
    out = []
    for layout in every_layout(size):
        if head_split_problem(heads, layout.head_parallel_size):
            continue
        if placement is not None and layout.head_parallel_size > 1 and layout.context_size > 1:
            if layout.placement != placement:
                continue
        if layout.inner_ring_size == 1 and layout.context_size > 1:
            continue
        out.append(layout)
    return out


@functools.lru_cache(maxsize=256)
def _layout_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout2D, seq: int, tp: int) -> float:
    parallel = ParallelSpec(gpus=layout.cp_size * tp, tp=tp, cp=layout.cp_size, dp=1)
    job = Job(model, cluster, parallel, _padded(seq, layout.cp_size))
    e = estimate(job, Scheme.of(PlanKind.TWO_D, layout))
    return e.time_s


def layout_for_size(
    model: ModelSpec, cluster: ClusterSpec, size: int, seq: int, tp: int = 1, placement: str | None = None
) -> tuple[Layout2D, float]:
    """The rule's layout for a group of ``size`` ranks running sequences of up to ``seq`` tokens, and its predicted
    attention time of one layer (forward + backward, seconds). See the module docstring."""
    candidates = size_candidates(model, size, tp, placement)  # never empty: hp = 1 splits any heads

    def key(layout: Layout2D):
        ties = (layout.inner_ring_size != layout.context_size, layout.placement != Placement.HEAD_FIRST)
        return (round(_layout_time(model, cluster, layout, seq, tp), 15), *ties, layout.head_parallel_size)

    best = min(candidates, key=key)
    return best, _layout_time(model, cluster, best, seq, tp)


def rule_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    dp_cp_size: int,
    max_seqlen_per_rank: int,
    tp: int = 1,
    placement: str | None = None,
) -> dict[int, Layout2D]:
    """The rule's layout for every group size above 1 of a DP x CP group of ``dp_cp_size`` ranks."""
    return {
        size: layout_for_size(model, cluster, size, size * max_seqlen_per_rank, tp, placement)[0]
        for size in hybrid_group_sizes(dp_cp_size)
        if size > 1
    }


# -- a length mix, both ways ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixPlan:
    """One length mix planned both ways (times: one optimizer step's forward + backward of every sequence, in
    seconds, on the busiest rank)."""

    static_s: float
    dynamic_s: float
    static_cp: int
    """The static CP size: the one Megatron gives the longest sequence."""
    static_layout: Layout2D
    static_samples: int
    """Packed samples of CP x max_seqlen tokens the static run needs."""
    dynamic_layouts: dict[int, Layout2D]
    sequences_by_size: dict[int, int]
    """How many sequences each group size gets."""

    @property
    def winner(self) -> str:
        """ "dynamic", "static", or "tie" (within 0.1%)."""
        if abs(self.dynamic_s - self.static_s) <= 1e-3 * max(self.dynamic_s, self.static_s):
            return "tie"
        return "dynamic" if self.dynamic_s < self.static_s else "static"

    @property
    def speedup(self) -> float:
        """The winner's advantage: the slower time over the faster."""
        return max(self.static_s, self.dynamic_s) / min(self.static_s, self.dynamic_s)

    def flags(self, max_seqlen_per_rank: int) -> str:
        """The dynamic run's pretrain_gpt.py flags (the layouts pinned, so the run uses what was planned)."""
        shown = {g: layout for g, layout in self.dynamic_layouts.items() if g > 1}
        pinned = f" --cp-2d-dynamic-layouts '{format_dynamic_layouts(shown)}'" if shown else ""
        return (
            f"--hybrid-context-parallel --max-seqlen-per-dp-cp-rank {max_seqlen_per_rank} --cp-comm-type 2d"
            f"{pinned} --calculate-per-token-loss --sft --rerun-mode disabled --no-rope-fusion"
        )

    def describe(self, lengths: Sequence[int], max_seqlen_per_rank: int) -> list[str]:
        """The plan as lines of text."""
        srt = sorted(lengths)
        static = self.static_layout
        return [
            f"sequence mix: {len(srt)} sequences, {sum(srt)} tokens, longest {srt[-1]}, median {srt[len(srt) // 2]};"
            f" max_seqlen_per_dp_cp_rank {max_seqlen_per_rank}",
            f"static:  CP {self.static_cp} (2d hp {static.head_parallel_size} x cp {static.context_size}, w "
            f"{static.inner_ring_size}, {static.placement}), {self.static_samples} packed samples of "
            f"{self.static_cp * max_seqlen_per_rank} tokens: {self.static_s * 1e3:.1f} ms",
            f"dynamic: sequences per CP group size {self.sequences_by_size}, layouts "
            f"'{format_dynamic_layouts({g: v for g, v in self.dynamic_layouts.items() if g > 1}) or '-'}': "
            f"{self.dynamic_s * 1e3:.1f} ms (list scheduling, no barriers between Megatron's rounds: optimistic)",
            f"static and dynamic tie ({self.speedup:.3f}x)"
            if self.winner == "tie"
            else f"{self.winner} wins by {self.speedup:.2f}x",
            f"flags: {self.flags(max_seqlen_per_rank)}",
        ]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record (times in ms)."""
        return {
            "static_ms": round(self.static_s * 1e3, 4),
            "dynamic_ms": round(self.dynamic_s * 1e3, 4),
            "winner": self.winner,
            "speedup": round(self.speedup, 4),
            "static_cp": self.static_cp,
            "static_layout": format_dynamic_layouts({self.static_cp: self.static_layout}),
            "static_samples": self.static_samples,
            "dynamic_layouts": format_dynamic_layouts({g: v for g, v in self.dynamic_layouts.items() if g > 1}),
            "sequences_by_size": {str(g): n for g, n in self.sequences_by_size.items()},
        }


def _step_s(
    model: ModelSpec, cluster: ClusterSpec, layout: Layout2D, tp: int, seq: int, lengths: Sequence[int] | None
) -> float:
    parallel = ParallelSpec(gpus=layout.cp_size * tp, tp=tp, cp=layout.cp_size, dp=1)
    scheme = Scheme.of(PlanKind.TWO_D, layout)
    packing = PackingMode.ZIGZAG if lengths is not None else None
    job = Job(model, cluster, parallel, seq, recompute=RecomputeMode.NONE, lengths=lengths, memory=DIST_OPT)
    cand = evaluate(scheme, job, packing=packing)
    if cand.estimate is None:
        raise PlanError(f"{scheme.label()} cannot run {seq} tokens: {cand.reason}")
    return cand.estimate.step_s


def pack_sequences(lengths: Sequence[int], capacity: int, size: int) -> list[list[int]]:
    """First-fit decreasing into samples of ``capacity`` tokens, each sequence counted padded to 2 * size (Megatron's
    THD zigzag: SFTDataset pads every conversation to a multiple of 2 * CP); the indices of each sample's
    sequences, in the order they were placed."""
    samples: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        padded = _padded(lengths[i], size)
        for k, free in enumerate(room):
            if padded <= free:
                samples[k].append(i)
                room[k] -= padded
                break
        else:
            samples.append([i])
            room.append(capacity - padded)
    return samples


def _least_loaded(loads: list[float], costs: Sequence[float]) -> list[float]:
    """Each cost, longest first, onto the least loaded of ``loads`` (LPT); the loads after."""
    for cost in sorted(costs, reverse=True):
        i = min(range(len(loads)), key=loads.__getitem__)
        loads[i] += cost
    return loads


def plan_length_mix(
    model: ModelSpec,
    cluster: ClusterSpec,
    dp_cp_size: int,
    lengths: Sequence[int],
    max_seqlen_per_rank: int,
    tp: int = 1,
    layouts: dict[int, Layout2D] | None = None,
) -> MixPlan:
    """``lengths`` (one global batch of sequences) on ``dp_cp_size`` ranks, static and dynamic (module docstring).
    ``layouts``: per-size layouts of the dynamic run (default: the rule's); the static run takes the rule's layout
    for its CP size."""
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise PlanError("a length mix needs at least one sequence, every length >= 1")
    sizes = hybrid_group_sizes(dp_cp_size)
    need = {length: megatron_cp_size(length, max_seqlen_per_rank) for length in set(lengths)}
    too_long = sorted(length for length, g in need.items() if g > dp_cp_size)
    if too_long:
        raise PlanError(
            f"sequences of {too_long} tokens need more than the {dp_cp_size} ranks at max_seqlen_per_dp_cp_rank "
            f"{max_seqlen_per_rank}; raise it or use more ranks"
        )
    rule = rule_layouts(model, cluster, dp_cp_size, max_seqlen_per_rank, tp)
    chosen = {**rule, **(layouts or {})}
    by_size: dict[int, list[int]] = {}
    for length in lengths:
        g = next(s for s in sizes if s >= need[length])  # Megatron's size, or the next group it built
        by_size.setdefault(g, []).append(length)

    # dynamic: each sequence on the least loaded aligned slice of its size
    loads = [0.0] * dp_cp_size
    trivial = Layout2D(1, 1)
    costed = [
        (_step_s(model, cluster, chosen.get(g, trivial), tp, _padded(length, g), None), g)
        for g, group in by_size.items()
        for length in group
    ]
    for cost, g in sorted(costed, reverse=True):
        slices = hybrid_slices(range(dp_cp_size), g)
        best = min(slices, key=lambda ranks: max(loads[r] for r in ranks))
        for r in best:
            loads[r] += cost
    dynamic_s = max(loads)

    # static: CP for the longest, packed samples over DP replicas
    static_cp = next(s for s in sizes if s >= max(need.values()))
    static_layout = rule.get(static_cp, trivial)
    samples = [
        [_padded(lengths[i], static_cp) for i in sample]
        for sample in pack_sequences(lengths, static_cp * max_seqlen_per_rank, static_cp)
    ]
    replicas = dp_cp_size // static_cp
    capacity = static_cp * max_seqlen_per_rank  # SFTDataset pads a pack to its length: the last document absorbs it
    sample_costs = [
        _step_s(model, cluster, static_layout, tp, capacity, [*s[:-1], capacity - sum(s[:-1])] if len(s) > 1 else None)
        for s in samples
    ]
    static_s = max(_least_loaded([0.0] * replicas, sample_costs))
    return MixPlan(
        static_s=static_s,
        dynamic_s=dynamic_s,
        static_cp=static_cp,
        static_layout=static_layout,
        static_samples=len(samples),
        dynamic_layouts={g: chosen.get(g, trivial) for g in sorted(by_size)},
        sequences_by_size={g: len(group) for g, group in sorted(by_size.items())},
    )
