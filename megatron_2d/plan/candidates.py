"""The layouts a planner compares: every 2D (hp, cp, w, placement) for a CP size and the stock baselines.

Kinds
    2d          this project: hp x cp, inner ring size w, head_first | context_first, K/V replicated when hp > Hkv;
                dK/dV travel the ring in fp32 by default ("accumulator") or in the input dtype ("input",
                ``--cp-2d-dkv-comm-dtype input``)
    p2p         Megatron/TE ring (zigzag), hp = 1, no window; dK/dV in the input dtype  --cp-comm-type p2p
    a2a         Megatron/TE Ulysses, hp = CP; heads and KV heads divisible by CP  --cp-comm-type a2a
    a2a+p2p     Megatron/TE hierarchical: an a2a level of A adjacent ranks, a ring of CP/A; A divides heads
                and KV heads (no replication), no window; dK/dV in the input dtype
    ds-ulysses  DeepSpeed-Ulysses (Megatron-DeepSpeed): all-to-all only, degree CP divides the query heads; with
                GQA, Megatron-DeepSpeed repeats the K/V heads to all query heads before the all-to-all, so the
                all-to-all carries MHA-sized K/V (an assumption: repeat to Ht, not to the least count that works)

For an MLA model every 2D layout comes twice: the ring carrying per-head K/V (``mla_ring`` "expanded", as every
stock kind) and carrying the latent ("latent", ``--cp-2d-mla-ring latent``).

Layouts with w = 1 and w = cp are the same single ring (the one-rank inner rings' outer ring visits the same peers in
the same order), so only w = cp is enumerated.

Recompute modes per kind (``RECOMPUTE_BY_KIND``): Selective Checkpoint++ is this project's (2d only); every kind
can run without recompute, with Megatron's selective (core attention) or full recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..layout.choices import PLAN_KINDS, DkvCommDtype, MlaRing, Placement, PlanKind, RecomputeMode
from ..layout.heads import head_split_problem, valid_head_parallel_sizes
from ..layout.topology import Layout2D, LayoutError, divisors, every_layout
from .hardware import ModelSpec, ParallelSpec
from .memory import CHECKPOINT_PLUS_MODES, LAYER_RECOMPUTE_MODES, RECOMPUTE_MODES

KINDS = PLAN_KINDS
STOCK_KINDS = KINDS[1:]
TE_DKV_COMM_DTYPE = DkvCommDtype.INPUT
"""Transformer Engine's p2p backward sends dK/dV in the input dtype (bf16 training)."""
TE_RINGS = (PlanKind.P2P, PlanKind.A2A_P2P)
"""The stock kinds with a ring: Transformer Engine's, which refuses a sliding window and sends dK/dV in the input
dtype."""
STOCK_RECOMPUTE = (RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL)
RECOMPUTE_BY_KIND = {kind: RECOMPUTE_MODES if kind == PlanKind.TWO_D else STOCK_RECOMPUTE for kind in KINDS}


def recompute_flags(mode: str, block_layers: int | None = None) -> str:
    """pretrain_gpt.py arguments of recompute ``mode`` (--recompute-activations is selective core attention);
    ``block_layers``: a layer recompute mode on that many layers per pipeline stage (--recompute-method block), else
    on every layer (uniform)."""
    if mode == RecomputeMode.NONE:
        return ""
    if mode == RecomputeMode.SELECTIVE:
        return "--recompute-activations"
    if mode not in LAYER_RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}")
    method = ("uniform", 1) if block_layers is None else ("block", block_layers)
    flags = "--recompute-granularity full --recompute-method {} --recompute-num-layers {}".format(*method)
    if mode in CHECKPOINT_PLUS_MODES:
        keep = CHECKPOINT_PLUS_MODES[mode]
        flags += f" --selective-checkpoint-plus-plus --selective-checkpoint-plus-plus-keep {keep}"
    return flags


RECOMPUTE_FLAGS = {mode: recompute_flags(mode) for mode in RECOMPUTE_MODES}
"""pretrain_gpt.py arguments of each recompute mode on every layer (:func:`recompute_flags`)."""


def kind_dkv_comm_dtype(kind: str, dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR) -> str:
    """How the dK/dV partials of ``kind`` travel (:data:`megatron_2d.layout.choices.DKV_COMM_DTYPES`): Transformer
    Engine's rings in the input dtype; ours as ``dkv_comm_dtype`` says (the op's ``--cp-2d-dkv-comm-dtype``)."""
    return TE_DKV_COMM_DTYPE if kind in TE_RINGS else dkv_comm_dtype


def kind_kv_heads(kind: str, model: ModelSpec, parallel: ParallelSpec) -> int | None:
    """K/V heads per TP rank after repetition when ``kind`` fixes them (DeepSpeed-Ulysses: all Ht query heads);
    None: the cost model's L = lcm(Hkvt, hp)."""
    return model.heads // parallel.tp if kind == PlanKind.DS_ULYSSES else None


@dataclass(frozen=True)
class Scheme:
    """One way to run attention over a CP group: ``kind`` with head-parallel size ``hp``, ring length ``cp``,
    inner ring size ``w`` (w == cp: one ring, no outer ring) and ``placement`` of the ranks."""

    kind: str
    hp: int
    cp: int
    w: int
    placement: str = Placement.HEAD_FIRST
    mla_ring: str | None = None
    """2D layouts of an MLA model: "expanded" (per-head K/V on the ring) or "latent"; None otherwise."""

    @property
    def cp_size(self) -> int:
        return self.hp * self.cp

    @property
    def shape(self) -> Layout2D:
        """The (hp, cp, w, placement) part as the project's one layout type, with its rank math; LayoutError when
        it is not a valid layout (``check_scheme`` returns that message as the reason)."""
        return Layout2D(self.cp_size, self.hp, self.w, self.placement)

    @classmethod
    def of(cls, kind: str, shape: Layout2D) -> Scheme:
        return cls(kind, shape.head_parallel_size, shape.context_size, shape.inner_ring_size, shape.placement)

    def label(self) -> str:
        if self.kind == PlanKind.TWO_D:
            ring = "" if self.mla_ring is None else f" {self.mla_ring}"
            return f"2d{ring} hp={self.hp} cp={self.cp} w={self.w} {self.placement}"
        if self.kind == PlanKind.A2A_P2P:
            return f"a2a+p2p [{self.hp}, {self.cp}]"
        return f"{self.kind} (CP={self.cp_size})"


def check_scheme(
    layout: Scheme, model: ModelSpec, parallel: ParallelSpec, seq: int, window: int | None = None
) -> str | None:
    """None when ``layout`` can run, else the reason (naming the values and what would be valid).

    ``window``: a sliding window of that many tokens; Transformer Engine refuses it with p2p and a2a+p2p CP."""
    k, hp, cp, w = layout.kind, layout.hp, layout.cp, layout.w
    if window is not None and k in TE_RINGS:
        return f"Transformer Engine refuses sliding-window attention with {k} context parallelism (use a2a or 2d)"
    CP = parallel.cp_size
    if k not in KINDS:
        return f"unknown kind {k!r}; valid kinds: {', '.join(KINDS)}"
    try:
        _ = layout.shape  # the one validation of (hp, cp, w, placement): topology.Layout2D's
    except LayoutError as err:
        return str(err)
    if hp * cp != CP:
        return f"hp*cp = {hp}*{cp} = {hp * cp} != CP={CP}; valid hp: {divisors(CP)}"
    Ht, Hkvt = model.heads // parallel.tp, model.kv_heads // parallel.tp
    chunks = CP if k == PlanKind.DS_ULYSSES else 2 * CP
    if seq % chunks:
        what = "CP" if k == PlanKind.DS_ULYSSES else "2*CP (zigzag: two chunks per rank)"
        return f"sequence length {seq} is not divisible by {what} = {chunks}; pad to {-(-seq // chunks) * chunks}"
    if head_split_problem(Ht, hp):
        return (
            f"hp={hp} does not divide the {Ht} query heads per TP rank; valid hp: "
            f"{valid_head_parallel_sizes(Ht, divisors(CP))}"
        )
    if k == PlanKind.TWO_D:
        return None
    if k == PlanKind.P2P:
        return None if (hp, w) == (1, cp) else "p2p is hp=1 with a single ring (w=cp)"
    if k in (PlanKind.A2A, PlanKind.DS_ULYSSES):
        if cp != 1:
            return f"{k} is all-to-all only: hp must be CP={CP}"
        if k == PlanKind.A2A and Hkvt % hp:
            return (
                f"degree {hp} does not divide the {Hkvt} KV heads per TP rank (Megatron/TE do not replicate "
                f"K/V; use 2d, which does)"
            )
        return None
    # a2a+p2p
    if not 1 < hp < CP or w != cp or layout.placement != Placement.HEAD_FIRST:
        return "a2a+p2p needs 1 < A < CP, a single ring (w = cp) and the a2a level on adjacent ranks"
    if Hkvt % hp:
        valid = [a for a in divisors(CP) if 1 < a < CP and Hkvt % a == 0 and Ht % a == 0]
        return (
            f"a2a size {hp} does not divide the {Hkvt} KV heads per TP rank (Megatron/TE do not replicate K/V); "
            f"valid a2a sizes: {valid or 'none (2d replicates K/V)'}"
        )
    return None


def enumerate_schemes(model: ModelSpec, parallel: ParallelSpec) -> list[Scheme]:
    """Every 2D layout for CP, then the baselines, including ones that ``check_scheme`` will reject.

    For 2D, hp runs over the divisors of CP; an hp that does not divide the heads appears once (as an infeasible
    row). When hp == 1 or cp == 1 the two placements are the same layout, listed once as head_first; w = 1 is the
    same ring as w = cp and is left out when cp > 1.
    """
    CP = parallel.cp_size
    Ht = model.heads // parallel.tp
    out: list[Scheme] = []
    for shape in every_layout(CP):  # by hp, then w, then placement
        hp, cp, w = shape.head_parallel_size, shape.context_size, shape.inner_ring_size
        if Ht % hp:
            if w == 1 and shape.placement == Placement.HEAD_FIRST:  # once per hp
                out.append(Scheme(PlanKind.TWO_D, hp, cp, cp))
            continue
        if w > 1 or cp == 1:
            layout = Scheme.of(PlanKind.TWO_D, shape)
            out.extend([layout] if model.mla is None else [replace(layout, mla_ring=ring) for ring in MlaRing])
    out.append(Scheme(PlanKind.P2P, 1, CP, CP))
    out.append(Scheme(PlanKind.A2A, CP, 1, 1))
    out.extend(Scheme(PlanKind.A2A_P2P, a, CP // a, CP // a) for a in divisors(CP) if 1 < a < CP)
    out.append(Scheme(PlanKind.DS_ULYSSES, CP, 1, 1))
    return out


def megatron_flags(
    layout: Scheme,
    parallel: ParallelSpec,
    recompute: str = RecomputeMode.NONE,
    block_layers: int | None = None,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
) -> str:
    """The pretrain_gpt.py arguments that select ``layout`` (TP/PP included when > 1) and ``recompute``;
    ``block_layers``: recompute only that many layers per pipeline stage (--recompute-method block);
    ``dkv_comm_dtype``: how a 2D layout's dK/dV riders travel (``--cp-2d-dkv-comm-dtype``, when not the default)."""
    flags = _layout_flags(layout, parallel)
    if layout.kind == PlanKind.TWO_D and dkv_comm_dtype != DkvCommDtype.ACCUMULATOR:
        flags += f" --cp-2d-dkv-comm-dtype {dkv_comm_dtype}"
    extra = recompute_flags(recompute, block_layers if recompute in LAYER_RECOMPUTE_MODES else None)
    if not extra:
        return flags
    if layout.kind == PlanKind.DS_ULYSSES:
        return f"{flags}; activation checkpointing: {recompute}"
    return f"{flags} {extra}"


def _layout_flags(layout: Scheme, parallel: ParallelSpec) -> str:
    pre = ""
    if parallel.tp > 1:
        pre += f"--tensor-model-parallel-size {parallel.tp} "
    if parallel.pp > 1:
        pre += f"--pipeline-model-parallel-size {parallel.pp} "
    cp = f"{pre}--context-parallel-size {layout.cp_size}"
    if layout.kind == PlanKind.TWO_D:
        ring = f" --cp-2d-mla-ring {MlaRing.LATENT}" if layout.mla_ring == MlaRing.LATENT else ""
        return (
            f"{cp} --cp-comm-type {layout.kind} --cp-2d-head-parallel-size {layout.hp} "
            f"--cp-2d-inner-ring-size {layout.w} --cp-2d-placement {layout.placement}{ring}"
        )
    if layout.kind in (PlanKind.P2P, PlanKind.A2A):
        return f"{cp} --cp-comm-type {layout.kind}"
    if layout.kind == PlanKind.A2A_P2P:
        return f"{cp} --cp-comm-type {layout.kind} --hierarchical-context-parallel-sizes {layout.hp} {layout.cp}"
    return f"(no Megatron flag: DeepSpeed-Ulysses, sequence-parallel size {layout.cp_size} in DeepSpeed)"
