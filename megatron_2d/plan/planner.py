"""``plan``: evaluate every candidate layout for a job, with the cheapest recompute mode that fits in memory, and
rank them by predicted step time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter

from ..layout.choices import RECOMPUTE_MODES, PlanKind, RecomputeMode
from ..layout.topology import divisors
from ..packing.modes import mode_class
from .attention_time import RIDER_BYTES
from .candidates import (
    KINDS,
    RECOMPUTE_BY_KIND,
    STOCK_KINDS,
    Scheme,
    check_scheme,
    enumerate_schemes,
    kind_dkv_comm_dtype,
    megatron_flags,
)
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError
from .hybrid import with_extra_step
from .job import AUTO, Job, Window, layer_windows
from .kernel_rates import SELECTED_KERNEL, side_kernel
from .memory import CHECKPOINT_PLUS_MODES, LAYER_RECOMPUTE_MODES
from .memory_options import MemoryPolicy, memory_options, states_record, with_memory
from .packed import PackedWork, modes_for, packed_work, packing_cost
from .step import Estimate, combine_layers, estimate, with_recompute

__all__ = ["AUTO", "ROW_KEYS", "Candidate", "Job", "Row", "Window", "evaluate", "layer_windows", "plan"]


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded for the JSON records."""
    return round(seconds * 1e3, 4)


@dataclass(frozen=True)
class Candidate:
    """A layout with its verdict, for ``job``.

    ``feasible``: it can run AND its estimated peak memory fits the GPU (``cluster.memory_budget_gb``) with
    ``recompute``; ``reason`` says why not. ``estimate`` is present whenever the layout can run: for the chosen
    recompute mode, or, when no mode fits, the one that needs the least memory. ``options`` are the estimates of
    every recompute mode tried (RECOMPUTE_MODES order). ``note``: anything the row's numbers do not show. ``flags``
    are built from these fields (:func:`candidate_flags`)."""

    scheme: Scheme
    job: Job
    feasible: bool
    reason: str
    estimate: Estimate | None = None
    options: tuple[Estimate, ...] = ()
    note: str = ""
    dkv_comm_dtype: str | None = None
    """How the row's dK/dV riders travel: "accumulator" (fp32) or "input" (bf16); None when it cannot run."""
    packing: str | None = None
    """Packed documents: the mode this row runs ("zigzag": Megatron/TE THD; "documents": ours); None unpacked."""
    packed: PackedWork | None = None
    kernel: str | None = None
    """The attention kernel the row runs (:mod:`megatron_2d.plan.kernel_rates`): stock TE's, 2D its selection's
    or ``--kernel``'s."""

    kind = property(lambda self: self.scheme.kind)
    hp = property(lambda self: self.scheme.hp)
    cp = property(lambda self: self.scheme.cp)
    w = property(lambda self: self.scheme.w)
    placement = property(lambda self: self.scheme.placement)
    memory_budget_gb = property(lambda self: self.job.cluster.memory_budget_gb)
    flags = property(lambda self: candidate_flags(self))
    """The pretrain_gpt.py arguments that run the row (:func:`candidate_flags`)."""

    @property
    def runs(self) -> bool:
        """The layout can run (it may still not fit in memory)."""
        return self.estimate is not None

    @property
    def fits_memory(self) -> bool | None:
        """The estimate's peak memory fits the budget (None when the layout cannot run)."""
        if self.estimate is None or self.memory_budget_gb is None:
            return None
        return self.estimate.memory_gb <= self.memory_budget_gb

    @property
    def recompute(self) -> str | None:
        """The recompute mode of ``estimate`` (None when the layout cannot run)."""
        return self.estimate.recompute if self.estimate else None

    @property
    def time_ms(self) -> float | None:
        """Attention forward + backward of one layer, ms (None when the layout cannot run)."""
        return self.estimate.time_s * 1e3 if self.estimate else None

    @property
    def step_ms(self) -> float | None:
        """Whole model, one micro-batch, recompute included, ms (None when the layout cannot run)."""
        return self.estimate.step_s * 1e3 if self.estimate else None

    @property
    def hypothetical(self) -> bool:
        """A stock row whose chosen recompute is Selective Checkpoint++ (``--fair-memory``): Megatron has no such
        option, its flags recompute fully."""
        return self.kind != PlanKind.TWO_D and self.recompute in CHECKPOINT_PLUS_MODES

    def row(self) -> Row:
        """The row's JSON columns (:class:`Row`)."""
        return Row(**{f.name: (f.metadata["get"] or attrgetter(f.name))(self) for f in fields(Row)})

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record with exactly the keys ``ROW_KEYS``, the fields of :class:`Row`."""
        row = self.row()
        return {name: getattr(row, name) for name in ROW_KEYS}


def candidate_flags(c: Candidate) -> str:
    """The pretrain_gpt.py arguments of ``c`` from its fields: its layout (TP/PP), the dK/dV dtype and kernel of a
    2D row (``--cp-2d-kernel`` where it runs another than the selection's); for a row that runs, also its chosen
    recompute (fully where ``hypothetical``; ``--recompute-method block`` when it recomputes some layers), packing
    mode and memory option."""
    layout, parallel, e = c.scheme, c.job.parallel, c.estimate
    dkv = kind_dkv_comm_dtype(layout.kind, c.job.dkv_comm_dtype)
    selected = SELECTED_KERNEL[c.job.cluster.arch]
    kernel = f" --cp-2d-kernel {c.kernel}" if layout.kind == PlanKind.TWO_D and c.kernel != selected else ""
    if e is None:
        return megatron_flags(layout, parallel, dkv_comm_dtype=dkv) + kernel
    per_stage = e.recompute_layers // parallel.pp
    recompute = RecomputeMode.FULL if c.hypothetical else e.recompute
    block = None if e.recompute_layers in (0, e.layers) else per_stage
    flags = megatron_flags(layout, parallel, recompute, block, dkv) + kernel
    if c.packing is not None:
        flags += mode_class(c.packing).planner_flags
    mem_flags = e.states.option.flags(layout.kind, parallel.dp_size, layout.cp_size)
    return flags + (mem_flags if mem_flags.startswith(";") else " " + mem_flags)


def _column(get: Callable[[Candidate], object] | None = None):
    """A :class:`Row` field whose value is ``get(candidate)`` (None: the candidate's attribute of its name)."""
    return field(metadata={"get": get})


def _of_estimate(attr: str, form: Callable[[object], object] = lambda v: v):
    """A :class:`Row` field: ``form`` of the chosen estimate's ``attr`` (None when the layout cannot run)."""
    get = attrgetter(attr)
    return _column(lambda c: None if c.estimate is None else form(get(c.estimate)))


def _rounded(digits: int, scale: float = 1.0) -> Callable[[float], float]:
    return lambda v: round(v / scale, digits)


def _memory_parts(c: Candidate) -> dict[str, float] | None:
    e = c.estimate
    if not e or not e.memory:
        return None
    states = ("params", "grads", "optimizer", "gathered")
    return {
        "activations": round(e.activation_gb, 2),
        **(
            {k: round(getattr(e.states, k) / 1e9, 2) for k in states}
            if e.states
            else {"model_states": round(e.memory.model_states / 1e9, 2)}
        ),
        "logits": round(e.memory.logits / 1e9, 2),
        "comm_buffers": round(e.memory.comm_buffers / 1e9, 2),
    }


def _option_record(o: Estimate, budget: float | None) -> dict[str, object]:
    return {
        "step_ms": ms(o.step_s),
        "recompute_ms": ms(o.recompute_s),
        "recompute_layers": o.recompute_layers,
        "memory_gb": round(o.memory_gb, 2),
        "fits_memory": None if budget is None else o.memory_gb <= budget,
    }


def _recompute_options(c: Candidate) -> dict[str, object] | None:
    """Each recompute mode's figures under the chosen memory option (None for the modes not tried)."""
    if not c.options:
        return None
    e, opts = c.estimate, {m: None for m in RECOMPUTE_MODES}
    for o in c.options:
        if o.states is not None and e.states is not None and o.states.option != e.states.option:
            continue  # recompute options of the chosen memory option
        opts[o.recompute] = _option_record(o, c.memory_budget_gb)
    return opts


def _memory_option_records(c: Candidate) -> dict[str, object] | None:
    """Each memory option's best recompute mode and its figures."""
    if not c.options:
        return None
    budget, out = c.memory_budget_gb, {}
    for label in dict.fromkeys(o.states.option.label for o in c.options if o.states is not None):
        best, fits = choose_recompute(
            [o for o in c.options if o.states.option.label == label],
            budget if budget is not None else float("inf"),
        )
        out[label] = {
            "recompute": best.recompute,
            "recompute_layers": best.recompute_layers,
            "step_ms": ms(best.step_s),
            "memory_gb": round(best.memory_gb, 2),
            "fits_memory": fits if budget is not None else None,
        }
    return out


def _packed_record(c: Candidate) -> dict[str, object] | None:
    p = c.packed
    if p is None:
        return None
    return {
        "flops_fraction": round(p.flops_fraction, 4),
        "ring_fraction": round(p.ring_fraction, 4),
        "token_fraction": round(p.token_fraction, 4),
        "ring_tokens": p.ring_tokens,
        "padding_tokens": p.padding_tokens,
        "pair_imbalance": round(p.pair_imbalance, 4),
        "long_documents": p.long_documents,
    }


@dataclass(frozen=True)
class Row:
    """One JSON record of a plan, its columns in order (times in ms, memory in GB, MFU as a fraction, links as
    nvlink/network/mixed/-); values that do not apply are None. Each field says once how it comes from a
    :class:`Candidate` (:meth:`Candidate.row`)."""

    kind: str = _column()
    hp: int = _column()
    cp: int = _column()
    w: int = _column()
    placement: str = _column()
    label: str = _column(lambda c: c.scheme.label())
    feasible: bool = _column()
    fits_memory: bool | None = _column()
    reason: str = _column()
    note: str = _column()
    flags: str = _column()
    recompute: str | None = _column()
    time_ms: float | None = _of_estimate("time_s", ms)
    compute_ms: float | None = _of_estimate("compute_s", ms)
    comm_ms: float | None = _of_estimate("comm_s", ms)
    a2a_ms: float | None = _of_estimate("a2a_s", ms)
    ring_exposed_ms: float | None = _of_estimate("ring_exposed_s", ms)
    comm_total_ms: float | None = _of_estimate("comm_total_s", ms)
    recompute_ms: float | None = _of_estimate("recompute_s", ms)
    recompute_layers: int | None = _of_estimate("recompute_layers")
    step_ms: float | None = _of_estimate("step_s", ms)
    mfu: float | None = _of_estimate("mfu", _rounded(4))
    tokens_per_gpu_s: float | None = _of_estimate("tokens_per_gpu_s", _rounded(1))
    memory_gb: float | None = _of_estimate("memory_gb", _rounded(2))
    activation_gb: float | None = _of_estimate("activation_gb", _rounded(2))
    memory_budget_gb: float | None = _column(
        lambda c: None if c.memory_budget_gb is None else round(c.memory_budget_gb, 2)
    )
    memory_parts_gb: dict | None = _column(_memory_parts)
    kv_heads_per_rank: int | None = _of_estimate("work.kv_heads_per_rank")
    dkv_comm_dtype: str | None = _column(lambda c: c.dkv_comm_dtype if c.estimate else None)
    nvlink_mb: float | None = _of_estimate("intra_bytes", _rounded(2, 1e6))
    network_mb: float | None = _of_estimate("inter_bytes", _rounded(2, 1e6))
    links: dict | None = _of_estimate(
        "links", lambda l: {p: l.describe(getattr(l, p)) for p in ("a2a", "inner", "outer")}
    )
    recompute_options: dict | None = _column(_recompute_options)
    packing: str | None = _column()
    packed: dict | None = _column(_packed_record)
    memory_option: str | None = _of_estimate("states", lambda s: s.option.label if s else None)
    states: dict | None = _of_estimate("states", states_record)
    memory_options: dict | None = _column(_memory_option_records)
    mla_ring: str | None = _column(lambda c: c.scheme.mla_ring)
    kernel: str | None = _column()


ROW_KEYS = tuple(f.name for f in fields(Row))
"""The keys of every JSON row (feasible or not): values are None where they do not apply."""


def validate_job(model: ModelSpec, parallel: ParallelSpec, seq: int) -> None:
    """Errors no layout can fix: TP must divide the heads and KV heads, PP the layers; seq must be positive."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise PlanError(f"sequence length must be a positive integer, got {seq!r}")
    if model.heads % parallel.tp or model.kv_heads % parallel.tp:
        raise PlanError(
            f"tp={parallel.tp} must divide heads={model.heads} and kv_heads={model.kv_heads}; valid tp: "
            f"{divisors(model.kv_heads)}"
        )
    if model.layers % parallel.pp:
        raise PlanError(f"pp={parallel.pp} does not divide layers={model.layers}; valid pp: {divisors(model.layers)}")


def kind_recompute_modes(kind: str, fair: bool = False) -> tuple[str, ...]:
    """The recompute modes ``kind`` can use; ``fair`` (--fair-memory): stock kinds get Selective Checkpoint++ too,
    hypothetically (Megatron has no such option)."""
    return RECOMPUTE_MODES if fair and kind in STOCK_KINDS else RECOMPUTE_BY_KIND[kind]


def _modes(kind: str, recompute: str | Sequence[str], fair: bool = False) -> tuple[str, ...]:
    allowed = kind_recompute_modes(kind, fair)
    wanted = allowed if recompute == AUTO else ((recompute,) if isinstance(recompute, str) else tuple(recompute))
    for m in wanted:
        if m not in RECOMPUTE_MODES:
            raise PlanError(f"recompute mode {m!r} is not one of {AUTO}, {', '.join(RECOMPUTE_MODES)}")
    return tuple(m for m in RECOMPUTE_MODES if m in wanted and m in allowed)


def choose_recompute(options: Sequence[Estimate], budget_gb: float) -> tuple[Estimate, bool]:
    """(chosen estimate, fits): the fastest option (step time) whose memory fits ``budget_gb``, ties to the
    simpler memory option, then to the earlier (cheaper) recompute mode; when none fits, the one with the least
    memory and False."""

    def simpler(o: Estimate):
        return (o.states.option.rank if o.states is not None else 0, RECOMPUTE_MODES.index(o.recompute))

    fitting = [o for o in options if o.memory_gb <= budget_gb]
    if fitting:
        return min(fitting, key=lambda o: (round(o.step_s, 12), simpler(o))), True
    return min(options, key=lambda o: (o.memory_gb, simpler(o))), False


def _fewest_layers(base: Estimate, mode: str, budget_gb: float, pp: int) -> Estimate:
    """Full and ckpt++ recompute only as many layers as memory needs (Megatron's block method: the same number
    on every pipeline stage, so a multiple of PP); all of them when even that does not fit."""
    if mode in LAYER_RECOMPUTE_MODES:
        n = base.memory.layers_to_fit(mode, budget_gb * 1e9, pp)
        return with_recompute(base, mode, n)
    return with_recompute(base, mode)


def evaluate(layout: Scheme, job: Job | ModelSpec | str, /, *fields, packing: str | None = None, **named) -> Candidate:
    """Check ``layout`` for ``job`` and, when it can run, estimate it under each memory option and recompute mode
    and keep the fastest that fits. ``job``: a :class:`Job`, or its fields as before Job (``evaluate(layout,
    model, cluster, parallel, seq, window=...)``).

    The job's ``memory``: which memory options each kind tries (:class:`megatron_2d.plan.memory_options
    .MemoryPolicy`: by default each side its own; ``fair``: stock gets 2D's options and, hypothetically,
    Checkpoint++). Its ``lengths`` (document lengths summing to ``seq``) with ``packing`` (a mode of
    :func:`megatron_2d.plan.packed.modes_for` the kind): a packed batch, see :mod:`megatron_2d.plan.packed`.

    ``window``: causal sliding window in tokens, None, or a per-layer pattern (see ``Window``): each window's layers
    are estimated apart and combined. ``recompute``: AUTO (every mode the kind supports), one mode, or a list of
    modes. ``dkv_comm_dtype``: how the 2D ring's dK/dV partials travel, the op's ``--cp-2d-dkv-comm-dtype``
    (:data:`megatron_2d.layout.choices.DKV_COMM_DTYPES`: "accumulator", fp32, the default; "input", bf16), emitted
    in the flags when not the default; Transformer Engine's rings always send the input dtype (see
    candidates.kind_dkv_comm_dtype). ``hybrid_pattern``: a HybridModel pattern (:mod:`megatron_2d.plan.hybrid`):
    the layout's attention is costed on its attention layers, its Mamba / GDN layers' own all-to-alls are added.
    ``kernel``: the kernel 2D layouts run (None: what its selection picks on the cluster's architecture; stock
    layouts always run Transformer Engine's, :mod:`.kernel_rates`), in the flags as ``--cp-2d-kernel`` when it is
    not the selection's. ``qk_clip``: QK-clip's max attention logit in every forward (free in a kernel's launch
    that returns it, Transformer Engine's for stock, else the op's separate pass: :func:`.step.estimate`)."""
    job = Job.of(job, fields, named)
    model, cluster, parallel, seq = job.attention_model, job.cluster, job.parallel, job.seq
    runs_kernel = side_kernel(layout.kind, cluster.arch, job.kernel, job.qk_clip)
    validate_job(model, parallel, seq)
    _check_dkv_comm_dtype(job.dkv_comm_dtype)
    mix = layer_windows(job.window, model.layers)
    windowed = next((w for w in mix if w is not None), None)
    modes = _modes(layout.kind, job.recompute, job.memory.fair) if layout.kind in RECOMPUTE_BY_KIND else ()
    reason = check_scheme(layout, model, parallel, seq, windowed)
    reason = reason or _recompute_refusal(layout, job.recompute, job.memory, modes)
    packing = packing if job.lengths is not None else None
    if job.lengths is not None:
        _check_packed_job(layout, packing, job.causal)
    note = _packing_note(layout, packing) if job.lengths is not None else ""
    if reason:
        return Candidate(layout, job, False, reason, packing=packing, kernel=runs_kernel)
    cost = packed = None
    if job.lengths is not None:
        cost = packing_cost(model, cluster, parallel.tp, layout.hp, layout.cp, layout.placement, runs_kernel)
        packed = _packed_work(layout, job.lengths, packing, windowed, cost)
    base = _layer_mix_estimate(job, layout, mix, packing, cost)
    if job.hybrid is not None:
        base = with_extra_step(base, job.hybrid.ssm_step_s(model, cluster, parallel, layout.cp_size, seq))
    options = _options(base, layout, job, modes)
    chosen, fits = choose_recompute(options, cluster.memory_budget_gb)
    candidate = Candidate(
        layout,
        job,
        fits,
        "" if fits else _out_of_memory(chosen, cluster),
        chosen,
        options,
        note=note,
        dkv_comm_dtype=kind_dkv_comm_dtype(layout.kind, job.dkv_comm_dtype),
        packing=packing,
        packed=packed,
        kernel=runs_kernel,
    )
    if candidate.hypothetical:
        note = (
            f"hypothetical (--fair-memory): Selective Checkpoint++ for {layout.kind}; Megatron has no such "
            f"option, the flags recompute fully"
        )
        candidate = replace(candidate, note=note)
    return candidate


def _check_dkv_comm_dtype(dkv_comm_dtype: str) -> None:
    if dkv_comm_dtype not in RIDER_BYTES:
        raise PlanError(
            f"dkv_comm_dtype {dkv_comm_dtype!r} is not one of {list(RIDER_BYTES)} (the op's names: "
            f"'accumulator' sends fp32 dK/dV, 'input' the input dtype)"
        )


def _recompute_refusal(layout: Scheme, recompute, memory: MemoryPolicy, modes: tuple[str, ...]) -> str:
    """Why the layout cannot run with the recompute asked for ("" when some mode is left)."""
    if modes:
        return ""
    return (
        f"recompute {recompute!r} is not available for {layout.kind} (Selective Checkpoint++ is 2D only; "
        f"--fair-memory lends it to stock); {layout.kind} supports: "
        f"{', '.join(kind_recompute_modes(layout.kind, memory.fair))}"
    )


def _check_packed_job(layout: Scheme, packing: str | None, causal: bool) -> None:
    """Errors no layout of this kind can fix for a packed batch."""
    if packing not in modes_for(layout.kind):
        raise PlanError(f"packed mode {packing!r} is not one of {modes_for(layout.kind)} for kind {layout.kind}")
    if not causal:
        raise PlanError("packed lengths are modelled for causal attention (drop --no-causal)")


def _packing_note(layout: Scheme, packing: str | None) -> str:
    """What a packed row's numbers do not show about running it."""
    if layout.kind == PlanKind.A2A_P2P:
        return "THD with a2a+p2p is not in a Transformer Engine release"
    return mode_class(packing).planner_note


def _packed_work(layout: Scheme, lengths, packing: str, window: int | None, cost) -> PackedWork:
    return packed_work(lengths, layout.hp, layout.cp, layout.placement, packing, window, cost)


def _layer_mix_estimate(job: Job, layout: Scheme, mix: dict[int | None, int], packing: str | None, cost) -> Estimate:
    """The estimate without recompute, its layers weighted by window (``mix``: window -> layers), of the job's
    attention layers."""
    attention = replace(job, model=job.attention_model, hybrid_pattern=None)
    return combine_layers(
        [
            (
                estimate(
                    replace(attention, window=win),
                    layout,
                    packed=None if job.lengths is None else _packed_work(layout, job.lengths, packing, win, cost),
                ),
                n,
            )
            for win, n in mix.items()
        ]
    )


def _options(base: Estimate, layout: Scheme, job: Job, modes: tuple[str, ...]) -> tuple[Estimate, ...]:
    """``base`` under every memory option of the kind and every recompute mode (as few layers as memory needs)."""
    model, cluster, parallel, memory = job.attention_model, job.cluster, job.parallel, job.memory
    held = [
        with_memory(base, o, model, cluster, parallel, layout.cp_size, memory.accum_steps(job.seq, parallel))
        for o in memory_options(layout.kind, parallel, cluster, memory, layout.cp_size)
    ]
    return tuple(_fewest_layers(b, m, cluster.memory_budget_gb, parallel.pp) for b in held for m in modes)


def _out_of_memory(chosen: Estimate, cluster: ClusterSpec) -> str:
    return (
        f"out of memory: needs {chosen.memory_gb:.1f} GB per GPU even with recompute={chosen.recompute} "
        f"and {chosen.states.option.label} "
        f"(budget {cluster.memory_budget_gb:.1f} GB = {cluster.usable_memory_fraction:.0%} of "
        f"{cluster.gpu_memory_gb:g} GB)"
    )


def _sort_key(c: Candidate):
    # Ties (e.g. all-hidden rings) go to stock kinds first (fewer moving parts), then less network traffic.
    e = c.estimate
    return (
        round(e.step_s, 9),
        round(e.time_s, 9),
        KINDS.index(c.kind) == 0,
        round(e.inter_bytes),
        c.hp,
        -c.w,
        c.placement,
    )


def _collapse_windows(cands: list[Candidate]) -> list[Candidate]:
    """With a sliding window the op may use the neighbour exchange, where the inner ring size w has no effect: keep
    one row per (hp, cp, placement), the one with w = cp, noting it."""
    out: list[Candidate] = []
    seen = set()
    for c in sorted(cands, key=lambda c: -c.w):
        if c.kind == PlanKind.TWO_D and c.estimate is not None and c.estimate.neighbour_exchange:
            key = (c.hp, c.cp, c.placement)
            if key in seen:
                continue
            seen.add(key)
            c = replace(
                c,
                scheme=replace(c.scheme, w=c.cp),
                note="w has no effect (neighbour exchange)",
            )  # its flags follow its fields: the inner ring size is now cp
        out.append(c)
    order = {id(c): i for i, c in enumerate(cands)}
    return sorted(out, key=lambda c: order.get(id(c), 0))


def plan(job: Job | ModelSpec | str | None = None, /, *fields, **named) -> list[Candidate]:
    """All candidate layouts for ``job``: feasible ones (they run and fit in memory) fastest step first, then the
    ones that run but do not fit (least memory first), then those that cannot run, with reasons. ``job``: a
    :class:`Job`, or its fields as before Job (``plan(model, cluster, parallel, seq, window=...)``).

    Each layout gets the fastest recompute mode that fits (the job's ``recompute``: AUTO, one mode or a list); the
    first row, when feasible, is the recommendation (see :func:`recommended`). ``lengths``: document lengths of a
    packed batch (summing to ``seq``): one row per layout and packed mode (2D: zigzag and documents; stock: THD
    zigzag). ``hybrid_pattern``: a HybridModel's ``--hybrid-layer-pattern`` (see :mod:`megatron_2d.plan.hybrid`).
    ``kernel``: the attention kernel of the 2D rows (None: its selection's; see :func:`evaluate`). ``qk_clip``:
    every layout's attention also computes the max logit (see :func:`evaluate`).

    >>> from megatron_2d.plan import Job, plan, ParallelSpec
    >>> cands = plan(Job("7B-GQA", "8xH100", ParallelSpec(gpus=64), seq=131072))
    >>> best = cands[0]
    >>> best.feasible, best.step_ms <= min(c.step_ms for c in cands if c.kind == "p2p")
    (True, True)
    >>> [c.reason for c in cands if c.kind == "a2a"]
    ['hp=64 does not divide the 32 query heads per TP rank; valid hp: [1, 2, 4, 8, 16, 32]']
    """
    job = Job.of(job, fields, named)
    parallel, seq, lengths = job.parallel, job.seq, job.lengths
    if job.hybrid is not None:
        problem = job.hybrid.problem(job.model, parallel.tp, parallel.cp_size)
        if problem:
            raise PlanError(problem)
    validate_job(job.attention_model, parallel, seq)
    if lengths is not None and (not lengths or min(lengths) < 1 or sum(lengths) != seq):
        raise PlanError(
            f"packed document lengths must be positive and sum to the sequence length {seq}; got "
            f"{len(lengths)} lengths summing to {sum(lengths)}"
        )
    cands = [
        evaluate(l, job, packing=mode)
        for l in enumerate_schemes(job.model, parallel)
        for mode in (modes_for(l.kind) if lengths is not None else (None,))  # packed: every mode of the kind
    ]
    if job.window is not None:
        cands = _collapse_windows(cands)
    ok = sorted((c for c in cands if c.feasible), key=_sort_key)
    oom = sorted(
        (c for c in cands if not c.feasible and c.runs), key=lambda c: (c.estimate.memory_gb, c.estimate.step_s)
    )
    cannot, seen = [], set()
    for c in cands:
        if not c.runs and c.scheme not in seen:  # one row per layout, not per packed mode
            seen.add(c.scheme)
            cannot.append(c)
    return ok + oom + cannot


def recommended(candidates: Sequence[Candidate]) -> Candidate | None:
    """The recommendation: the first feasible candidate (fastest step that fits in memory), or None."""
    return next((c for c in candidates if c.feasible), None)


def best_by_kind(candidates: Sequence[Candidate]) -> dict[str, Candidate]:
    """The first (fastest) candidate of each kind; when a kind has no feasible layout, its first layout that runs
    (least memory), else its first infeasible one."""
    out: dict[str, Candidate] = {}
    for c in candidates:
        if c.kind not in out or _standing(c) > _standing(out[c.kind]):
            out[c.kind] = c
    return out


def _standing(c: Candidate) -> int:
    """2 for a feasible candidate, 1 for one that runs but does not fit, 0 for one that cannot run."""
    return 2 if c.feasible else (1 if c.runs else 0)
