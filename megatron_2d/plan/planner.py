"""``plan``: evaluate every candidate layout for a job, with the cheapest recompute mode that fits in memory, and
rank them by predicted step time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    kind_kv_heads,
    megatron_flags,
)
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError, get_cluster, get_model
from .hybrid import HybridPattern, with_extra_step
from .kernel_rates import SELECTED_KERNEL, side_kernel
from .memory import CHECKPOINT_PLUS_MODES, LAYER_RECOMPUTE_MODES, RECOMPUTE_MODES
from .memory_options import MemoryPolicy, memory_options, states_record, with_memory
from .packed import PackedWork, modes_for, packed_work, packing_cost
from .step import Estimate, combine_layers, estimate, with_recompute

AUTO = "auto"
"""``recompute=AUTO``: try every mode the kind supports and keep the fastest that fits in memory."""

ROW_KEYS = (
    "kind",
    "hp",
    "cp",
    "w",
    "placement",
    "label",
    "feasible",
    "fits_memory",
    "reason",
    "note",
    "flags",
    "recompute",
    "time_ms",
    "compute_ms",
    "comm_ms",
    "a2a_ms",
    "ring_exposed_ms",
    "comm_total_ms",
    "recompute_ms",
    "recompute_layers",
    "step_ms",
    "mfu",
    "tokens_per_gpu_s",
    "memory_gb",
    "activation_gb",
    "memory_budget_gb",
    "memory_parts_gb",
    "kv_heads_per_rank",
    "dkv_comm_dtype",
    "nvlink_mb",
    "network_mb",
    "links",
    "recompute_options",
    "packing",
    "packed",
    "memory_option",
    "states",
    "memory_options",
    "mla_ring",
    "kernel",
)
"""The keys of every JSON row (feasible or not): values are None where they do not apply."""


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded for the JSON records."""
    return round(seconds * 1e3, 4)


@dataclass(frozen=True)
class Candidate:
    """A layout with its verdict.

    ``feasible``: it can run AND its estimated peak memory fits the GPU (``cluster.memory_budget_gb``) with
    ``recompute``; ``reason`` says why not. ``estimate`` is present whenever the layout can run: for the chosen
    recompute mode, or, when no mode fits, the one that needs the least memory. ``options`` are the estimates of
    every recompute mode tried (RECOMPUTE_MODES order). ``note``: anything the row's numbers do not show."""

    scheme: Scheme
    feasible: bool
    reason: str
    flags: str
    estimate: Estimate | None = None
    options: tuple[Estimate, ...] = ()
    note: str = ""
    memory_budget_gb: float | None = None
    dkv_comm_dtype: str | None = None
    """How the row's dK/dV riders travel: "accumulator" (fp32) or "input" (bf16)."""
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

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record with exactly the keys ``ROW_KEYS`` (times in ms, memory in GB, MFU as a fraction,
        links as nvlink/network/mixed/-); values that do not apply are None."""
        e = self.estimate
        opts = mem_opts = None
        if self.options:
            budget = self.memory_budget_gb
            opts = {m: None for m in RECOMPUTE_MODES}
            for o in self.options:
                if o.states is not None and e.states is not None and o.states.option != e.states.option:
                    continue  # recompute options of the chosen memory option
                opts[o.recompute] = {
                    "step_ms": ms(o.step_s),
                    "recompute_ms": ms(o.recompute_s),
                    "recompute_layers": o.recompute_layers,
                    "memory_gb": round(o.memory_gb, 2),
                    "fits_memory": None if budget is None else o.memory_gb <= budget,
                }
            mem_opts = {}
            for label in dict.fromkeys(o.states.option.label for o in self.options if o.states is not None):
                best, fits = choose_recompute(
                    [o for o in self.options if o.states.option.label == label],
                    budget if budget is not None else float("inf"),
                )
                mem_opts[label] = {
                    "recompute": best.recompute,
                    "recompute_layers": best.recompute_layers,
                    "step_ms": ms(best.step_s),
                    "memory_gb": round(best.memory_gb, 2),
                    "fits_memory": fits if budget is not None else None,
                }
        d: dict[str, object] = {
            "kind": self.kind,
            "hp": self.hp,
            "cp": self.cp,
            "w": self.w,
            "placement": self.placement,
            "label": self.scheme.label(),
            "feasible": self.feasible,
            "fits_memory": self.fits_memory,
            "reason": self.reason,
            "note": self.note,
            "flags": self.flags,
            "recompute": self.recompute,
            "time_ms": ms(e.time_s) if e else None,
            "compute_ms": ms(e.compute_s) if e else None,
            "comm_ms": ms(e.comm_s) if e else None,
            "a2a_ms": ms(e.a2a_s) if e else None,
            "ring_exposed_ms": ms(e.ring_exposed_s) if e else None,
            "comm_total_ms": ms(e.comm_total_s) if e else None,
            "recompute_ms": ms(e.recompute_s) if e else None,
            "recompute_layers": e.recompute_layers if e else None,
            "step_ms": ms(e.step_s) if e else None,
            "mfu": round(e.mfu, 4) if e else None,
            "tokens_per_gpu_s": round(e.tokens_per_gpu_s, 1) if e else None,
            "memory_gb": round(e.memory_gb, 2) if e else None,
            "activation_gb": round(e.activation_gb, 2) if e else None,
            "memory_budget_gb": None if self.memory_budget_gb is None else round(self.memory_budget_gb, 2),
            "memory_parts_gb": (
                {
                    "activations": round(e.activation_gb, 2),
                    **(
                        {k: round(getattr(e.states, k) / 1e9, 2) for k in ("params", "grads", "optimizer", "gathered")}
                        if e.states
                        else {"model_states": round(e.memory.model_states / 1e9, 2)}
                    ),
                    "logits": round(e.memory.logits / 1e9, 2),
                    "comm_buffers": round(e.memory.comm_buffers / 1e9, 2),
                }
                if e and e.memory
                else None
            ),
            "kv_heads_per_rank": e.work.kv_heads_per_rank if e else None,
            "dkv_comm_dtype": self.dkv_comm_dtype if e else None,
            "nvlink_mb": round(e.intra_bytes / 1e6, 2) if e else None,
            "network_mb": round(e.inter_bytes / 1e6, 2) if e else None,
            "links": {p: e.links.describe(getattr(e.links, p)) for p in ("a2a", "inner", "outer")} if e else None,
            "recompute_options": opts,
            "packing": self.packing,
            "packed": (
                {
                    "flops_fraction": round(self.packed.flops_fraction, 4),
                    "ring_fraction": round(self.packed.ring_fraction, 4),
                    "token_fraction": round(self.packed.token_fraction, 4),
                    "ring_tokens": self.packed.ring_tokens,
                    "padding_tokens": self.packed.padding_tokens,
                    "pair_imbalance": round(self.packed.pair_imbalance, 4),
                    "long_documents": self.packed.long_documents,
                }
                if self.packed
                else None
            ),
            "memory_option": e.states.option.label if e and e.states else None,
            "states": states_record(e.states) if e else None,
            "memory_options": mem_opts,
            "mla_ring": self.scheme.mla_ring,
            "kernel": self.kernel,
        }
        assert tuple(d) == ROW_KEYS
        return d


def _resolve(model, cluster):
    m = get_model(model) if isinstance(model, str) else model
    c = get_cluster(cluster) if isinstance(cluster, str) else cluster
    if not isinstance(m, ModelSpec):
        raise PlanError(f"model must be a ModelSpec or a preset name, got {type(m).__name__}")
    if not isinstance(c, ClusterSpec):
        raise PlanError(f"cluster must be a ClusterSpec or a preset name, got {type(c).__name__}")
    return m, c


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


Window = int | Sequence[int | None] | None
"""A sliding window for every layer (tokens back; None: full causal), or a per-layer pattern repeated over the
layers (e.g. (4096, None): every other layer windowed, as gpt-oss alternates)."""


def layer_windows(window: Window, layers: int) -> dict[int | None, int]:
    """{window: number of layers with it}; a sequence is a per-layer pattern, repeated cyclically over ``layers``."""
    if window is None or isinstance(window, int):
        return {window: layers}
    pattern = list(window)
    if not pattern:
        raise PlanError("a per-layer window pattern needs at least one entry (a window in tokens or None)")
    out: dict[int | None, int] = {}
    for i in range(layers):
        w = pattern[i % len(pattern)]
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise PlanError(f"window {w!r} must be a non-negative number of tokens or None (full causal)")
        out[w] = out.get(w, 0) + 1
    return out


def evaluate(
    layout: Scheme,
    model: ModelSpec | str,
    cluster: ClusterSpec | str,
    parallel: ParallelSpec,
    seq: int,
    causal: bool = True,
    window: Window = None,
    recompute: str | Sequence[str] = AUTO,
    dkv_comm_dtype: str = "accumulator",
    lengths: Sequence[int] | None = None,
    packing: str | None = None,
    hybrid: HybridPattern | None = None,
    memory: MemoryPolicy = MemoryPolicy(),
    kernel: str | None = None,
    qk_clip: bool = False,
) -> Candidate:
    """Check and, when the layout can run, estimate it under each memory option and recompute mode and keep the
    fastest that fits.

    ``memory``: which memory options each kind tries (:class:`megatron_2d.plan.memory_options.MemoryPolicy`: by
    default each side its own; ``fair``: stock gets 2D's options and, hypothetically, Checkpoint++).

    ``lengths`` (document lengths summing to ``seq``) with ``packing`` (a mode of
    :func:`megatron_2d.plan.packed.modes_for` the kind): a packed batch, see :mod:`megatron_2d.plan.packed`.

    ``window``: causal sliding window in tokens, None, or a per-layer pattern (see ``Window``). ``recompute``:
    AUTO (every mode the kind supports), one mode, or a list of modes. ``dkv_comm_dtype``: how the 2D ring's
    dK/dV partials travel, the op's ``--cp-2d-dkv-comm-dtype`` (:data:`megatron_2d.layout.choices.DKV_COMM_DTYPES`:
    "accumulator", fp32, the default; "input", bf16), emitted in the flags when not the default; Transformer
    Engine's rings always send the input dtype (see candidates.kind_dkv_comm_dtype). ``hybrid``: a HybridModel
    pattern (:mod:`megatron_2d.plan.hybrid`): the layout's attention is costed on its attention layers, its Mamba /
    GDN layers' own all-to-alls are added. ``kernel``: the kernel 2D layouts run (None: what its selection picks on
    the cluster's architecture; stock layouts always run Transformer Engine's, :mod:`.kernel_rates`), in the flags
    as ``--cp-2d-kernel`` when it is not the selection's. ``qk_clip``: QK-clip's max attention logit in every
    forward (:func:`megatron_2d.plan.step.estimate`'s ``max_logit``: free in a kernel's launch that returns it,
    Transformer Engine's for stock, else the op's separate pass)."""
    model, cluster = _resolve(model, cluster)
    if hybrid is not None:
        model = hybrid.attention_model(model)
    runs_kernel = side_kernel(layout.kind, cluster.arch, kernel, qk_clip)
    kernel_flag = (
        f" --cp-2d-kernel {runs_kernel}" if layout.kind == "2d" and runs_kernel != SELECTED_KERNEL[cluster.arch] else ""
    )
    validate_job(model, parallel, seq)
    _check_dkv_comm_dtype(dkv_comm_dtype)
    budget = cluster.memory_budget_gb
    mix = layer_windows(window, model.layers)
    windowed = next((w for w in mix if w is not None), None)
    modes = _modes(layout.kind, recompute, memory.fair) if layout.kind in RECOMPUTE_BY_KIND else ()
    reason = check_scheme(layout, model, parallel, seq, windowed)
    reason = reason or _recompute_refusal(layout, recompute, memory, modes)
    if lengths is not None:
        _check_packed_job(layout, packing, causal)
    note = _packing_note(layout, packing) if lengths is not None else ""
    dkv = kind_dkv_comm_dtype(layout.kind, dkv_comm_dtype)
    if reason:
        return Candidate(
            layout,
            False,
            reason,
            megatron_flags(layout, parallel, dkv_comm_dtype=dkv) + kernel_flag,
            memory_budget_gb=budget,
            packing=packing if lengths is not None else None,
            kernel=runs_kernel,
        )
    cost = packed = None
    if lengths is not None:
        cost = packing_cost(model, cluster, parallel.tp, layout.hp, layout.cp, layout.placement, runs_kernel)
        packed = _packed_work(layout, lengths, packing, windowed, cost)
    base = _layer_mix_estimate(
        layout, model, cluster, parallel, seq, causal, mix, dkv, lengths, packing, cost, runs_kernel, qk_clip
    )
    if hybrid is not None:
        base = with_extra_step(base, hybrid.ssm_step_s(model, cluster, parallel, layout.cp_size, seq))
    options = _options(base, layout, model, cluster, parallel, seq, memory, modes)
    chosen, fits = choose_recompute(options, budget)
    flags, hypothetical = _flags(
        layout, model, parallel, chosen, dkv, packing if lengths is not None else None, kernel_flag
    )
    if hypothetical:
        note = (
            f"hypothetical (--fair-memory): Selective Checkpoint++ for {layout.kind}; Megatron has no such "
            f"option, the flags recompute fully"
        )
    return Candidate(
        layout,
        fits,
        "" if fits else _out_of_memory(chosen, cluster),
        flags,
        chosen,
        options,
        note=note,
        memory_budget_gb=budget,
        dkv_comm_dtype=dkv,
        packing=packing if lengths is not None else None,
        packed=packed,
        kernel=runs_kernel,
    )


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
    if layout.kind == "a2a+p2p":
        return "THD with a2a+p2p is not in a Transformer Engine release"
    return mode_class(packing).planner_note


def _packed_work(layout: Scheme, lengths, packing: str, window: int | None, cost) -> PackedWork:
    return packed_work(lengths, layout.hp, layout.cp, layout.placement, packing, window, cost)


def _layer_mix_estimate(
    layout: Scheme,
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    causal: bool,
    mix: dict[int | None, int],
    dkv: str,
    lengths,
    packing: str | None,
    cost,
    kernel: str,
    qk_clip: bool = False,
) -> Estimate:
    """The estimate without recompute, its layers weighted by window (``mix``: window -> layers), on ``kernel``
    (with the max logit under ``qk_clip``)."""
    kv_heads = kind_kv_heads(layout.kind, model, parallel)
    mla_ring = "latent" if layout.mla_ring == "latent" else None
    return combine_layers(
        [
            (
                estimate(
                    model,
                    cluster,
                    parallel,
                    layout.hp,
                    layout.cp,
                    layout.w,
                    layout.placement,
                    seq,
                    causal,
                    win,
                    dkv_comm_dtype=dkv,
                    kv_heads=kv_heads,
                    packed=None if lengths is None else _packed_work(layout, lengths, packing, win, cost),
                    mla_ring=mla_ring,
                    kernel=kernel,
                    max_logit=qk_clip,
                ),
                n,
            )
            for win, n in mix.items()
        ]
    )


def _options(
    base: Estimate,
    layout: Scheme,
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    seq: int,
    memory: MemoryPolicy,
    modes: tuple[str, ...],
) -> tuple[Estimate, ...]:
    """``base`` under every memory option of the kind and every recompute mode (as few layers as memory needs)."""
    held = [
        with_memory(base, o, model, cluster, parallel, layout.cp_size, memory.accum_steps(seq, parallel))
        for o in memory_options(layout.kind, parallel, cluster, memory, layout.cp_size)
    ]
    return tuple(_fewest_layers(b, m, cluster.memory_budget_gb, parallel.pp) for b in held for m in modes)


def _flags(
    layout: Scheme,
    model: ModelSpec,
    parallel: ParallelSpec,
    chosen: Estimate,
    dkv: str,
    packing: str | None,
    kernel_flag: str,
) -> tuple[str, bool]:
    """(Megatron flags of the chosen estimate, whether they stand for a hypothetical Checkpoint++ of stock);
    ``kernel_flag``: ``--cp-2d-kernel`` where the layout runs another kernel than the selection's."""
    per_stage = chosen.recompute_layers // parallel.pp
    hypothetical = layout.kind != "2d" and chosen.recompute in CHECKPOINT_PLUS_MODES
    flags = (
        megatron_flags(
            layout,
            parallel,
            "full" if hypothetical else chosen.recompute,
            None if chosen.recompute_layers in (0, model.layers) else per_stage,
            dkv,
        )
        + kernel_flag
    )
    if packing is not None:
        flags += mode_class(packing).planner_flags
    mem_flags = chosen.states.option.flags(layout.kind, parallel.dp_size, layout.cp_size)
    flags += mem_flags if mem_flags.startswith(";") else " " + mem_flags
    return flags, hypothetical


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
        if c.kind == "2d" and c.estimate is not None and c.estimate.neighbour_exchange:
            key = (c.hp, c.cp, c.placement)
            if key in seen:
                continue
            seen.add(key)
            c = replace(
                c,
                scheme=replace(c.scheme, w=c.cp),
                note="w has no effect (neighbour exchange)",
                flags=c.flags.replace(f"--cp-2d-inner-ring-size {c.w} ", f"--cp-2d-inner-ring-size {c.cp} "),
            )
        out.append(c)
    order = {id(c): i for i, c in enumerate(cands)}
    return sorted(out, key=lambda c: order.get(id(c), 0))


def plan(
    model: ModelSpec | str,
    cluster: ClusterSpec | str,
    parallel: ParallelSpec,
    seq: int,
    causal: bool = True,
    window: Window = None,
    recompute: str | Sequence[str] = AUTO,
    dkv_comm_dtype: str = "accumulator",
    lengths: Sequence[int] | None = None,
    hybrid_pattern: str | None = None,
    memory: MemoryPolicy = MemoryPolicy(),
    kernel: str | None = None,
    qk_clip: bool = False,
) -> list[Candidate]:
    """All candidate layouts for the job: feasible ones (they run and fit in memory) fastest step first, then the
    ones that run but do not fit (least memory first), then those that cannot run, with reasons.

    Each layout gets the fastest recompute mode that fits (``recompute``: AUTO, one mode or a list); the first
    row, when feasible, is the recommendation (see :func:`recommended`). ``lengths``: document lengths of a packed
    batch (summing to ``seq``): one row per layout and packed mode (2D: zigzag and documents; stock: THD zigzag).
    ``hybrid_pattern``: a HybridModel's ``--hybrid-layer-pattern`` (see :mod:`megatron_2d.plan.hybrid`).
    ``kernel``: the attention kernel of the 2D rows (None: its selection's; see :func:`evaluate`). ``qk_clip``:
    every layout's attention also computes the max logit (see :func:`evaluate`).

    >>> from megatron_2d.plan import plan, ParallelSpec
    >>> cands = plan("7B-GQA", "8xH100", ParallelSpec(gpus=64), seq=131072)
    >>> best = cands[0]
    >>> best.feasible, best.step_ms <= min(c.step_ms for c in cands if c.kind == "p2p")
    (True, True)
    >>> [c.reason for c in cands if c.kind == "a2a"]
    ['hp=64 does not divide the 32 query heads per TP rank; valid hp: [1, 2, 4, 8, 16, 32]']
    """
    model, cluster = _resolve(model, cluster)
    hybrid = None
    if hybrid_pattern is not None:
        hybrid = HybridPattern.parse(hybrid_pattern)
        problem = hybrid.problem(model, parallel.tp, parallel.cp_size)
        if problem:
            raise PlanError(problem)
    validate_job(model if hybrid is None else hybrid.attention_model(model), parallel, seq)
    if lengths is not None:
        lengths = [int(x) for x in lengths]
        if not lengths or min(lengths) < 1 or sum(lengths) != seq:
            raise PlanError(
                f"packed document lengths must be positive and sum to the sequence length {seq}; got "
                f"{len(lengths)} lengths summing to {sum(lengths)}"
            )
    cands = [
        evaluate(
            l,
            model,
            cluster,
            parallel,
            seq,
            causal,
            window,
            recompute,
            dkv_comm_dtype,
            lengths,
            mode,
            hybrid=hybrid,
            memory=memory,
            kernel=kernel,
            qk_clip=qk_clip,
        )
        for l in enumerate_schemes(model, parallel)
        for mode in (modes_for(l.kind) if lengths is not None else (None,))  # packed: every mode of the kind
    ]
    if window is not None:
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
