"""Generated Megatron configurations: one seeded generator of whole training setups for the 2d backend.

A *scenario* fixes what the CP = 1 reference shares: the model (GPTModel dense or small MoE, HybridModel layers with
``M`` ``G`` ``*`` ``-`` ``E``, MLA; LayerNorm or RMSNorm), its attention settings (sliding windows with a skip
frequency or a list, sinks, softmax scale, qk_layernorm, GQA, RoPE or YaRN), the data (sbhd, or THD packed documents
in one packing mode, with one-token documents, end padding, a CP rank that holds only padding), the dtype and QK-clip
(MuonClip after every step, at a threshold the max logits of these models exceed, so that it clips). Its *draws* then
vary how the same training is laid out: TP (mostly with sequence parallelism, as real jobs run it; always for MoE),
PP and virtual PP (the ``|`` splits of a hybrid pattern), the 2D layout (hp, cp, inner ring size, placement,
Megatron's rank order), DP, the model states (DDP, distributed optimizer with overlapped grad reduce and param
gather, megatron-fsdp ZeRO-2/3, Hybrid ZeRO), the recompute mode, for MoE the expert-parallel size and, for MLA, the
ring. Pure Python and numpy: drawing and the coverage check need no torch.

Each draw trains a few iterations through Megatron's own schedule (:mod:`megatron_2d_dev.config_runs`) and is
compared with its scenario's reference (:func:`reference_of`): the same training at CP = 1, DP = 1, PP = 1, unsharded
DDP, no recompute; at the draw's TP and sequence parallelism where the draw runs SP, else at TP = 1 where the model
at TP = 1 is the same model and at the draw's TP otherwise (see :func:`reference_tp`); with Megatron's own core
attention where it is the same model (sbhd, non-MLA, sinks not split over TP) and otherwise the independent
:class:`~megatron_2d.testing.reference_core_attention.ReferenceCoreAttention`. Under sequence parallelism the norms
are apex's or Transformer Engine's, their compiled kernels stood in (:func:`norm_route`,
:mod:`megatron_2d_dev.sp_norms`).

Invalid combinations are named here, not silently dropped (:func:`expected_refusal`, :func:`skip_reason`): a
refusal is a combination the library must refuse, on every rank, with the documented message (the draw asserts
it); a skip is one that cannot run on this CPU machine, with the reason. Both are counted. The tables are in
docs/testing.md ("Generated Megatron configurations").

Every draw is a pure function of (scenario seed, draw index), so a failure replays from those alone:

    python tools/fuzz_megatron.py --replay 1234:2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

MODELS = ("gpt", "gpt_moe", "hybrid", "mla")
HYBRID_LAYERS = ("M*-", "*-G*", "M-*E", "G*M-", "*E-M", "M*G-", "*-*-")
"""Hybrid layer strings (the pattern without ``|``); every one has an attention layer, and the draws' ``|`` splits
give some pipeline stages none (``'M-|*E'``)."""
DATA = ("sbhd", "zigzag", "sequence", "documents")
"""sbhd batches, or THD packed documents in one of the packing modes (Megatron's per-document split ``--sft``, its
per-sequence split ``--dataloader-inter-document-masking``, the documents layout of
megatron_2d.megatron.packed_data)."""
LENGTH_MIXES = ("ones", "small", "giant", "single", "all_padding_rank")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
POSITIONS = ("rope", "yarn")
WINDOWS = ("none", "every_layer", "skip_freq", "skip_list")
DTYPES = ("fp32", "bf16")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
SEQUENCE_PARALLEL_SHARE = 0.8
"""How often a draw at TP > 1 turns sequence parallelism on (MoE always: megatron-core's MoE layer raises in
training with TP > 1 without it); the rest keep TP without SP covered."""
STATES = ("ddp", "distributed_optimizer", "fsdp_zero2", "fsdp_zero3", "hybrid_zero")
RECOMPUTE = ("none", "selective", "full", "checkpoint_plus_plus")
CHECKPOINT_PLUS_PLUS_KEEP: tuple[str | None, ...] = (None,)
"""The keep-policy axis of Selective Checkpoint++ (``selective_checkpoint_plus_plus_keep``, to come): None is
today's behaviour. Add the policy names here and set the field in :func:`config_models._recompute_fields`."""
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-dp-cp-ep-pp")
"""Megatron's rank order (``initialize_model_parallel(order=)``): its default, ``--use-tp-pp-dp-mapping``'s, and one
that strides the CP groups across the data-parallel ranks (CP ranks not consecutive)."""
MLA_RINGS = ("expanded", "latent")
QK_CLIP_PADDED_DATA = ("zigzag", "sequence")
"""Data whose batches at CP > 1 give core attention padding as document tokens (see the skip rule
``qk_clip_with_padding_as_documents``)."""
QK_CLIP_SHARE = 0.3
"""The share of scenarios that train with QK-clip (drawn from a stream of their own: the other fields stay as they
were)."""
QK_CLIP_THRESHOLD = 1.0
"""QK-clip's threshold in those scenarios: below the max attention logit of the first iterations of every model here
(weights ~ N(0, 1/fan_in) give logits of order one, their max over a batch a few), so the clip scales weights in
each step (config_runs checks that it did)."""
PLACEMENTS = ("head_first", "context_first")
MAX_WORLD = 8
ITERATIONS = 3
GLOBAL_BATCH = 4
"""Samples (sbhd) or packed sequences (THD) per iteration, split over DP and micro-batches."""
DRAWS_PER_SCENARIO = 3
MOE_ROUTERS = ("plain", "aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss", "expert_bias")
"""What a MoE scenario's router adds to its top-k routing: nothing ("plain"), one of megatron-core's load-balancing
losses (``--moe-router-load-balancing-type``, coefficient :data:`MOE_LOSS_COEFF`), the z-loss
(``--moe-z-loss-coeff``), or the aux-loss-free expert bias (``--moe-router-enable-expert-bias``, sigmoid scores).
With the scenarios' top-2 of 2 experts every token goes to both experts, so the load-balancing losses are constants
(no gradient) and the expert bias never moves: the draws run their collectives (and the refusals under hybrid CP);
the z-loss changes the gradients. Their math against CP = 1 with 4 experts: tests/test_megatron_dynamic.py."""
MOE_ROUTER_SHARE = 0.5
"""How often a MoE scenario's router is not "plain" (drawn from a stream of its own, [seed, 6])."""
MOE_LOSS_COEFF = 1e-2
DYNAMIC_SHARE = 0.35
"""How often a draw of a packed (--sft, zigzag) scenario trains under Megatron's hybrid (dynamic) CP instead: its
DP x CP ranks give each document its own CP group (:func:`_with_dynamic_cp`, drawn from a stream of its own, so
the other draws' choices do not move)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Scenario:
    """What a scenario's draws and their CP = 1 reference share."""

    seed: int
    model: str
    layers: str  # one symbol per decoder layer (GPT and MLA: "*" per transformer layer)
    heads: int
    query_groups: int
    moe: bool  # MoE MLPs (GPT's small MoE, or the E layers of a hybrid pattern)
    ssm_heads: int  # Mamba heads (and GDN key heads; GDN value heads twice as many): 8, or 4 (larger head dims)
    normalization: str  # the config's normalization (every norm of the model)
    window: str
    window_size: int
    softmax_type: str
    softmax_scale: float | None
    qk_layernorm: bool
    position: str
    data: str
    seq_length: int  # sbhd: the sequence; THD: the longest packed sequence's real tokens bound
    lengths: tuple[tuple[int, ...], ...]  # THD: document lengths of each of the GLOBAL_BATCH packed sequences
    end_padding: int  # THD zigzag: extra padded slots after the last document, in units of 2 * CP
    dtype: str
    tp: int | None  # MLA: the scenario's TP (the reference's); None: each draw picks its own
    moe_router: str = "plain"  # MoE: what the router adds to top-k routing (MOE_ROUTERS)
    qk_clip: bool = False  # QK-clip after every optimizer step (QK_CLIP_THRESHOLD)

    def windowed_layers(self) -> list[int]:
        """Layer numbers (1-based, over the whole pattern) Megatron windows (``is_layer_window_attention``)."""
        n = len(self.layers)
        if self.window == "none":
            return []
        if self.window == "every_layer":
            return list(range(1, n + 1))
        if self.window == "skip_freq":
            return [i for i in range(1, n + 1) if i % 2 != 0]
        return [i + 1 for i, on in enumerate(self.skip_list()) if on]

    def skip_list(self) -> list[int]:
        """``window_attn_skip_freq`` as a list (1 = windowed), for window 'skip_list'."""
        return [(i + self.seed) % 2 for i in range(len(self.layers))] if self.window == "skip_list" else []


@dataclass(frozen=True)
class Draw:
    """One layout of a scenario's training."""

    scenario: Scenario
    index: int
    tp: int
    sequence_parallel: bool
    pp: int
    vpp: int | None
    splits: tuple[int, ...]  # hybrid: where the pp * vpp segments start (layer indices), else ()
    hp: int
    cp: int
    inner_ring_size: int
    placement: str
    order: str
    dp: int
    state: str
    shard_size: int | None  # hybrid_zero: ranks the states are sharded over (< dp x CP)
    zero_states: str | None  # hybrid_zero: which states are sharded ('optimizer', 'optimizer+grads+params')
    wider_optimizer_shard: bool  # hybrid_zero: optimizer states over all dp x CP ranks (megatron-fsdp outer 'optim')
    recompute: str
    checkpoint_plus_plus_keep: str | None
    mla_ring: str
    reference: bool = False
    perturbed: bool = False  # a reference with every parameter moved by one rounding step (see perturbed_twin_of)
    ep: int = 1  # MoE: expert-parallel size (carved from DP x CP, as Megatron's expert grid does)
    max_seqlen_per_rank: int | None = None  # hybrid (dynamic) CP's --max-seqlen-per-dp-cp-rank; None: static CP
    dynamic_layouts: str | None = None  # hybrid CP: --cp-2d-dynamic-layouts (None: every size by the rule)

    @property
    def dynamic(self) -> bool:
        """Whether the draw trains under Megatron's hybrid (dynamic) CP (its static layout is then hp 1 x one ring,
        unused: every document runs on its own group with that size's layout)."""
        return self.max_seqlen_per_rank is not None

    @property
    def context_parallel_size(self) -> int:
        return self.hp * self.cp

    @property
    def megatron_fsdp(self) -> bool:
        """Whether the model states are megatron-fsdp's (else Megatron's DDP, with or without its distributed
        optimizer)."""
        return self.state in ("fsdp_zero2", "fsdp_zero3") or self.zero_states == "optimizer+grads+params"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.context_parallel_size * self.dp

    @property
    def pattern(self) -> str:
        """The hybrid layer pattern with this draw's ``|`` splits."""
        layers = self.scenario.layers
        bounds = [*self.splits, len(layers)]
        return "|".join(layers[a:b] for a, b in zip(bounds[:-1], bounds[1:]))

    @property
    def num_microbatches(self) -> int:
        return self.scenario_batches // self.micro_batch_size

    @property
    def micro_batch_size(self) -> int:
        return 1 if self.scenario.data != "sbhd" else max(1, self.scenario_batches // 2)

    @property
    def scenario_batches(self) -> int:
        """Samples (or packed sequences) of one iteration on one DP rank."""
        return GLOBAL_BATCH // self.dp

    def replay(self) -> str:
        return f"python tools/fuzz_megatron.py --replay {self.scenario.seed}:{self.index}"

    def describe(self) -> str:
        s = asdict(self.scenario)
        lengths = s.pop("lengths")
        shown = [list(x) if len(x) <= 10 else f"{list(x[:10])}...({len(x)} documents)" for x in lengths]
        mine = {k: v for k, v in asdict(self).items() if k not in ("scenario", "reference")}
        return (
            ", ".join(f"{k}={v}" for k, v in s.items())
            + f", lengths={shown} | "
            + ", ".join(f"{k}={v}" for k, v in mine.items())
        )


# ---- drawing -------------------------------------------------------------------------------------------------------
def _document_lengths(rng: np.random.Generator, mix: str, bound: int) -> tuple[int, ...]:
    """Document lengths of one packed sequence (at most ``bound`` real tokens)."""
    if mix == "ones":  # mostly one-token documents, a few longer ones
        lengths = [1] * int(rng.integers(3, 12)) + rng.integers(2, 12, size=int(rng.integers(1, 3))).tolist()
    elif mix == "small":
        lengths = rng.integers(1, 16, size=int(rng.integers(2, 7))).tolist()
    elif mix == "giant":  # one document longer than the others together
        lengths = rng.integers(1, 4, size=int(rng.integers(0, 5))).tolist() + [int(rng.integers(bound // 2, bound))]
    elif mix == "single":
        lengths = [int(rng.integers(bound // 3, bound))]
    else:  # a few one-token documents: under zigzag or documents every CP rank but one or two holds padding only
        lengths = [1] * int(rng.integers(1, 3))
    lengths = [int(x) for x in lengths]
    while sum(lengths) > bound:
        lengths.pop(0)
    return tuple(lengths[i] for i in rng.permutation(len(lengths)))


def _choice(rng: np.random.Generator, values: Sequence):
    return values[int(rng.integers(len(values)))]


RARE = 0.25
"""How often a draw keeps a value that makes its combination one the library refuses (or cannot run here) once
drawn: such draws are quick and counted, but most of the budget goes to combinations that train."""


def _choice_keeping_rare(rng: np.random.Generator, values: Sequence, invalid) -> object:
    """A uniform choice from ``values``; one for which ``invalid(value)`` holds is kept only with probability
    :data:`RARE` (else drawn again among the others, when there are any)."""
    value = _choice(rng, values)
    valid = [v for v in values if not invalid(v)]
    if invalid(value) and valid and rng.random() >= RARE:
        value = _choice(rng, valid)
    return value


def draw_scenario(seed: int) -> Scenario:
    """Scenario ``seed``: a pure function of it."""
    rng = np.random.default_rng([seed, 0])
    model = _choice(rng, MODELS)
    if model == "hybrid":
        layers = _choice(rng, HYBRID_LAYERS)
    else:
        layers = "*" * int(_choice(rng, (2, 4)))
    ssm = model == "hybrid" and any(x in layers for x in "MG")
    heads = 8 if model == "mla" else int(_choice(rng, (4, 8)))
    # K/V heads divide over TP (megatron-core needs it); fewer of them than hp replicates them
    query_groups = heads if model == "mla" else int(_choice(rng, [d for d in divisors(heads) if d >= 2]))
    refused_data = {"mla": ("sequence", "documents")}.get(model, ("sequence", "documents") if ssm else ())
    data = _choice_keeping_rare(rng, DATA, lambda x: x in refused_data)
    mixes = [_choice(rng, LENGTH_MIXES) for _ in range(GLOBAL_BATCH)]
    seq_length = int(_choice(rng, (32, 48, 64)))
    lengths = tuple(_document_lengths(rng, mix, seq_length) for mix in mixes) if data != "sbhd" else ()
    return Scenario(
        seed=seed,
        model=model,
        layers=layers,
        heads=heads,
        query_groups=query_groups,
        moe=model == "gpt_moe" or "E" in layers,
        ssm_heads=4 if ssm and rng.random() < 0.3 else 8,
        normalization=_choice(np.random.default_rng([seed, 2]), NORMALIZATIONS),  # its own stream: the rest as before
        window=_choice(rng, WINDOWS),
        window_size=int(_choice(rng, (1, 3, 7, 20))),
        softmax_type=_choice(rng, SOFTMAX_TYPES),
        softmax_scale=None if rng.random() < 0.7 else 0.2,
        qk_layernorm=bool(rng.random() < (0.3 if model != "hybrid" else 0.3 * RARE)),
        position=_choice(rng, POSITIONS),
        data=data,
        seq_length=seq_length,
        lengths=lengths,
        end_padding=int(rng.integers(0, 3)) if data == "zigzag" else 0,
        dtype="bf16" if rng.random() < 0.25 else "fp32",
        tp=int(_choice(rng, (1, 2))) if model == "mla" else None,
        moe_router=_moe_router(seed) if model == "gpt_moe" or "E" in layers else "plain",
        qk_clip=_qk_clip(seed, data),
    )


def _moe_router(seed: int) -> str:
    """A MoE scenario's router (:data:`MOE_ROUTERS`), from its own stream: numpy reads [seed, k] as [seed, k, 0], so
    k is none of the per-draw streams' (1, 3, 4) nor another scenario stream's (0, 2, and 5: QK-clip's)."""
    rng = np.random.default_rng([seed, 6])
    return "plain" if rng.random() >= MOE_ROUTER_SHARE else str(_choice(rng, MOE_ROUTERS[1:]))


def _qk_clip(seed: int, data: str) -> bool:
    """Whether scenario ``seed`` trains with QK-clip (its own stream); with data whose max logit counts padding at
    static CP > 1 (the rule ``qk_clip_with_padding_as_documents``; its hybrid-CP draws train) kept only with
    probability :data:`RARE`."""
    # its own stream: [seed, 0] is the scenario's, [seed, 2] the normalization's, and [seed, k] is numpy's stream of
    # [seed, k, 0] (SeedSequence pads the entropy with zeros), so no draw stream [seed, k, index] may use 5 either
    # (6 is the MoE router's)
    rng = np.random.default_rng([seed, 5])
    return bool(rng.random() < QK_CLIP_SHARE and (data not in QK_CLIP_PADDED_DATA or rng.random() < RARE))


def _splits(rng: np.random.Generator, layers: str, segments: int) -> tuple[int, ...]:
    """Start layer of each of ``segments`` non-empty segments (the first at 0)."""
    if segments == 1:
        return (0,)
    inner = sorted(int(x) for x in rng.choice(np.arange(1, len(layers)), size=segments - 1, replace=False))
    return (0, *inner)


def draw_config(seed: int, index: int, qk_clip: bool = True) -> Draw:
    """Draw ``index`` of scenario ``seed``: a pure function of both. ``qk_clip`` False: the draw as the generator
    made it before it drew QK-clip (the scenario without it; what the regressions found before then ran)."""
    scenario = draw_scenario(seed)
    if not qk_clip:
        scenario = replace(scenario, qk_clip=False)
    rng = np.random.default_rng([seed, 1, index])
    if scenario.tp is not None:
        tp = scenario.tp
    else:
        tp = int(_choice(rng, (1, 2)))
    sequence_parallel = tp > 1 and (rng.random() < SEQUENCE_PARALLEL_SHARE or scenario.moe)
    pp = int(_choice_keeping_rare(rng, (1, 2), lambda p: scenario.data == "documents" and p > 1))
    vpp = 2 if pp == 2 and len(scenario.layers) >= 4 and rng.random() < 0.4 else None
    segments = pp * (vpp or 1)
    splits = _splits(rng, scenario.layers, segments) if scenario.model == "hybrid" else ()
    room = MAX_WORLD // (tp * pp)  # ranks left for CP x DP
    sizes = [(c, d) for c in (2, 4, 8) for d in (1, 2) if c * d <= room]
    CP, dp = _choice(rng, sizes)
    hp = int(_choice(rng, divisors(CP)))
    inner_ring_size = int(_choice(rng, divisors(CP // hp)))
    D = dp * CP
    partial = divisors(D)[1:-1]  # shard sizes of partial sharding
    states = [s for s in STATES if s != "hybrid_zero" or partial]
    state = _choice_keeping_rare(rng, states, lambda x: pp > 1 and x in ("fsdp_zero2", "fsdp_zero3"))
    shard_size = int(_choice(rng, partial)) if state == "hybrid_zero" else None
    wider = bool(state == "hybrid_zero" and rng.random() < 0.2)
    zero_states = None
    if state == "hybrid_zero":
        zero_states = "optimizer+grads+params" if wider else _choice(rng, ("optimizer", "optimizer+grads+params"))
    order = _choice_keeping_rare(rng, ORDERS, lambda o: pp > 1 and o == "tp-cp-ep-pp-dp")
    recompute = _choice(rng, RECOMPUTE)
    # MoE: expert parallelism over 2 of the DP x CP ranks, half the time (its own stream: the rest as before)
    ep = 2 if scenario.moe and np.random.default_rng([seed, 3, index]).random() < 0.5 else 1
    draw = Draw(
        scenario=scenario,
        index=index,
        tp=tp,
        sequence_parallel=bool(sequence_parallel),
        pp=pp,
        vpp=vpp,
        splits=splits,
        hp=hp,
        cp=CP // hp,
        inner_ring_size=inner_ring_size,
        placement=_choice(rng, PLACEMENTS),
        order=order,
        dp=dp,
        state=state,
        shard_size=shard_size,
        zero_states=zero_states,
        wider_optimizer_shard=wider,
        recompute=recompute,
        checkpoint_plus_plus_keep=(
            _choice(rng, CHECKPOINT_PLUS_PLUS_KEEP) if recompute == "checkpoint_plus_plus" else None
        ),
        mla_ring=_choice(rng, MLA_RINGS) if scenario.model == "mla" else "expanded",
        ep=ep,
    )
    return _with_qk_clip(_with_dynamic_cp(draw))


def _with_qk_clip(draw: Draw) -> Draw:
    """A QK-clip draw on megatron-fsdp (refused: ``qk_clip_with_megatron_fsdp``) kept in a share :data:`RARE` of
    them, the others moved to DDP or the distributed optimizer (from the stream [seed, 6, index]: its own)."""
    if not (draw.scenario.qk_clip and draw.megatron_fsdp):
        return draw
    rng = np.random.default_rng([draw.scenario.seed, 6, draw.index])
    if rng.random() < RARE:
        return draw
    state = _choice(rng, ("ddp", "distributed_optimizer"))
    return replace(draw, state=state, shard_size=None, zero_states=None, wider_optimizer_shard=False)


def _with_dynamic_cp(draw: Draw) -> Draw:
    """``draw`` under hybrid (dynamic) CP, for a share :data:`DYNAMIC_SHARE` of the packed scenarios' draws (from
    the stream [seed, 4, index]): --max-seqlen-per-dp-cp-rank = seq_length / (DP x CP), rounded up, so the documents
    land in groups of every size; a layout for some of the group sizes (an hp splitting the heads per TP rank, an
    inner ring size, a placement), the rule for the others. What hybrid CP refuses (pipelining, megatron-fsdp,
    expert parallelism) is kept in a share :data:`RARE` of them."""
    from megatron_2d.layout.dynamic import hybrid_group_sizes

    s = draw.scenario
    rng = np.random.default_rng([s.seed, 4, draw.index])  # its own stream (3 is expert parallelism's)
    # refused with hybrid CP: drawn rarely
    refused_model = s.model == "mla" or _has(draw, "MG")
    if s.data != "zigzag" or rng.random() >= DYNAMIC_SHARE * (RARE if refused_model else 1.0):
        return draw
    ranks = draw.dp * draw.context_parallel_size
    entries = []
    for size in hybrid_group_sizes(ranks)[1:]:
        if rng.random() < 0.4:
            continue  # the rule's
        hp = int(_choice(rng, [h for h in divisors(size) if (s.heads // draw.tp) % h == 0]))  # refused: unit tests
        w = int(_choice(rng, divisors(size // hp)))
        entries.append(f"{size}={hp}x{size // hp}/{w}@{_choice(rng, PLACEMENTS)}")
    # megatron-core 0.19.2 refuses hybrid CP with pipelining and megatron-fsdp: kept rarely (the refusals are drawn)
    staged = {}
    if draw.pp > 1 and rng.random() >= RARE:
        staged = dict(pp=1, vpp=None, splits=(0,) if s.model == "hybrid" else ())
    if draw.megatron_fsdp and rng.random() >= RARE:
        state = _choice(rng, ("ddp", "distributed_optimizer"))
        staged.update(state=state, shard_size=None, zero_states=None, wider_optimizer_shard=False)
    # expert parallelism hangs in megatron-core 0.19.2's hybrid schedule (refused by the 2d backend): kept rarely
    if draw.ep > 1 and rng.random() >= RARE:
        staged.update(ep=1)
    return replace(
        draw,
        **staged,
        hp=1,
        cp=draw.context_parallel_size,
        inner_ring_size=draw.context_parallel_size,
        max_seqlen_per_rank=-(-s.seq_length // ranks),
        dynamic_layouts=",".join(entries) or None,
    )


HYBRID_REFUSED_ROUTERS = ("aux_loss", "seq_aux_loss", "global_aux_loss", "expert_bias")
"""The MoE routers megatron-core 0.19.2 gets wrong or hangs on under hybrid CP (refused by the 2d backend,
megatron_2d.megatron.dynamic.moe_router_problems)."""


def scenario_draws(seed: int, count: int = DRAWS_PER_SCENARIO) -> list[Draw]:
    return [draw_config(seed, i) for i in range(count)]


def reference_tp(draw: Draw) -> int:
    """The reference's TP: 1, except where megatron-core's model at the draw's TP is another model than at TP = 1:
    MLA (without sequence parallelism its rope key's gradient keeps only the local heads' share, see
    tests/test_megatron_mla.py) and Mamba / GDN layers (their fused input projections are split over TP per
    component, which weights drawn in the full shape and cut into TP chunks do not reproduce). A TP = 1 reference
    is the stronger check: it also sees TP attributes (which parameters the gradient norm counts on every TP rank)."""
    s = draw.scenario
    if s.model == "mla" or (s.model == "hybrid" and any(x in s.layers for x in "MG")):
        return draw.tp
    return 1


def perturbed_twin_of(draw: Draw) -> Draw:
    """``draw``'s reference with every initial parameter moved by one rounding step of its dtype (seeded signs): how
    far rounding alone moves this model's loss, gradient norm and gradients. The draw's bounds are the table's or a
    multiple of that spread, whichever is larger (:func:`config_runs.compare`): a model that amplifies rounding (a
    near-zero group under Mamba's gated RMSNorm) gets a floor measured on itself, not a looser table."""
    return replace(reference_of(draw), perturbed=True)


def reference_of(draw: Draw) -> Draw:
    """The CP = 1 training ``draw`` is compared with (see the module docstring): at the draw's TP and sequence
    parallelism where the draw runs SP (the same norms, :func:`norm_route`), else at :func:`reference_tp`; equal for
    every draw of a scenario that shares the reference TP and SP, so it is computed once per (scenario, TP, SP)."""
    return replace(
        draw,
        index=-1,
        tp=draw.tp if draw.sequence_parallel else reference_tp(draw),
        sequence_parallel=draw.sequence_parallel,
        pp=1,
        vpp=None,
        splits=(0,) if draw.scenario.model == "hybrid" else (),
        hp=1,
        cp=1,
        inner_ring_size=1,
        placement="head_first",
        order=ORDERS[0],
        dp=1,
        state="ddp",
        shard_size=None,
        zero_states=None,
        wider_optimizer_shard=False,
        recompute="none",
        checkpoint_plus_plus_keep=None,
        mla_ring="expanded",
        reference=True,
        ep=1,
        max_seqlen_per_rank=None,
        dynamic_layouts=None,
    )


def norm_route(draw: Draw) -> str:
    """How the draw's norms are built (:data:`megatron_2d_dev.sp_norms.NORM_ROUTES`): megatron-core's torch norm
    without sequence parallelism; with it, apex's FusedLayerNorm for LayerNorm (megatron-core's local specs pick it
    when apex is installed) and Transformer Engine's norms for RMSNorm (the local specs give RMSNorm the torch norm
    whatever is installed, which refuses SP) and for HybridModel (whose final norm is always TENorm)."""
    if not draw.sequence_parallel:
        return "torch"
    return "te" if draw.scenario.normalization == "RMSNorm" or draw.scenario.model == "hybrid" else "apex"


# ---- what cannot run: refusals the library must give, and skips ----------------------------------------------------
LAUNCH = "launch"
"""Where every refusal of :data:`REFUSALS` fires: the launch checks (``check_launch_args``), before any collective."""
MAMBA_GROUPS = 2  # tiny_hybrid.py's; its Mamba heads: hidden 64 x expand 2 / head dim (16 or 32)


@dataclass(frozen=True)
class Rule:
    """A combination that cannot run: ``applies(draw)``; ``message``: a refusal's expected text (a substring of
    the library's error) or a skip's reason; ``fires_at``: where a refusal must come, on every rank (:data:`LAUNCH`:
    the launch checks on the draw's flags, before Megatron's process groups or any collective)."""

    name: str
    applies: object  # Callable[[Draw], bool]
    message: str
    fires_at: str = LAUNCH


def _heads_per_tp(d: Draw) -> int:
    return d.scenario.heads // d.tp


def _mamba_fails(d: Draw) -> bool:
    heads, groups, CP = d.scenario.ssm_heads // d.tp, MAMBA_GROUPS // d.tp, d.context_parallel_size
    return heads % CP != 0 or (groups < CP and CP % groups != 0) or (groups >= CP and groups % CP != 0)


def _gdn_fails(d: Draw) -> bool:
    CP = d.context_parallel_size
    return (d.scenario.ssm_heads // d.tp) % CP != 0 or (2 * d.scenario.ssm_heads // d.tp) % CP != 0


def _has(d: Draw, symbols: str) -> bool:
    return d.scenario.model == "hybrid" and any(s in d.scenario.layers for s in symbols)


REFUSALS: tuple[Rule, ...] = (
    Rule(
        "hp_does_not_divide_heads",
        lambda d: _heads_per_tp(d) % d.hp != 0,
        "does not divide the",
    ),
    Rule("mamba_heads_over_tp_x_cp", lambda d: _has(d, "M") and _mamba_fails(d), "Mamba layers split"),
    Rule("gdn_heads_over_tp_x_cp", lambda d: _has(d, "G") and _gdn_fails(d), "GDN layers split their heads"),
    Rule(
        "documents_layout_with_mamba_or_gdn",
        lambda d: d.scenario.data == "documents" and _has(d, "MG"),
        "cp_2d_packing='documents' cannot run a model with",
    ),
    Rule(
        "sequence_split_with_mamba_or_gdn",
        lambda d: d.scenario.data == "sequence" and _has(d, "MG"),
        "Megatron's per-sequence split of packed documents",
    ),
    Rule(
        "sequence_split_with_mla",
        lambda d: d.scenario.data == "sequence" and d.scenario.model == "mla",
        "with multi-latent attention is not supported by the 2d backend",
    ),
    Rule(
        "documents_layout_with_mla",
        lambda d: d.scenario.data == "documents" and d.scenario.model == "mla",
        "cp_2d_packing='documents' (--cp-2d-packing documents) with multi-latent attention",
    ),
    Rule(
        "documents_layout_with_pipeline",
        lambda d: d.scenario.data == "documents" and d.pp > 1,
        "runs with pipeline_model_parallel_size 1 only",
    ),
    Rule(
        "megatron_fsdp_with_pipeline",
        lambda d: d.megatron_fsdp and d.pp > 1,
        "--use-megatron-fsdp with --pipeline-model-parallel-size",
    ),
    Rule(
        "partial_distributed_optimizer_with_pipeline_and_aligned_grad_reduce",
        lambda d: d.zero_states == "optimizer" and d.pp > 1,
        "--num-distributed-optimizer-instances",
    ),
    Rule(
        "tp_pp_dp_mapping_with_context_and_pipeline",
        lambda d: d.order == "tp-cp-ep-pp-dp" and d.pp > 1,
        "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size",
    ),
    Rule(
        "qk_clip_with_megatron_fsdp",
        lambda d: d.scenario.qk_clip and d.megatron_fsdp,
        "--qk-clip with --use-megatron-fsdp: megatron-core 0.19.2's clip_qk",
    ),
    Rule(
        "documents_layout_with_sequence_parallelism",
        lambda d: d.scenario.data == "documents" and d.sequence_parallel,
        "cp_2d_packing='documents' (--cp-2d-packing documents) with --sequence-parallel",
    ),
    Rule(
        "dynamic_cp_with_pipeline",
        lambda d: d.dynamic and d.pp > 1,
        "hybrid_context_parallel with pipeline_model_parallel_size",
    ),
    Rule("dynamic_cp_with_megatron_fsdp", lambda d: d.dynamic and d.megatron_fsdp, "with megatron-fsdp is refused"),
    Rule(
        "dynamic_cp_with_expert_parallelism",
        lambda d: d.dynamic and d.ep > 1,
        "hybrid_context_parallel with expert_model_parallel_size 2",
    ),
    Rule(
        "dynamic_cp_with_moe_load_balancing_loss",
        lambda d: d.dynamic and d.scenario.moe_router in ("aux_loss", "seq_aux_loss", "global_aux_loss"),
        "hybrid_context_parallel with the MoE ",
    ),
    Rule(
        "dynamic_cp_with_moe_expert_bias",
        lambda d: d.dynamic and d.scenario.moe_router == "expert_bias",
        "hybrid_context_parallel with --moe-router-enable-expert-bias",
    ),
    Rule(
        "documents_layout_with_moe_expert_bias",
        lambda d: (
            d.scenario.data == "documents" and d.context_parallel_size > 1 and d.scenario.moe_router == "expert_bias"
        ),
        "cp_2d_packing='documents' (--cp-2d-packing documents) with --moe-router-enable-expert-bias",
    ),
    Rule(
        "dynamic_cp_with_mla",
        lambda d: d.dynamic and d.scenario.model == "mla",
        "hybrid_context_parallel with multi-latent attention is refused",
    ),
    Rule(
        "dynamic_cp_with_mamba_or_gdn",
        lambda d: d.dynamic and _has(d, "MG"),
        "Megatron's context parallelism over the static CP group, not each micro-batch's hybrid group",
    ),
    Rule(
        "hybrid_zero_wider_optimizer_shard_with_clipping",
        lambda d: d.state == "hybrid_zero" and d.wider_optimizer_shard,
        "computes the gradient norm over one optimizer instance only",
    ),
)
"""Combinations the library refuses. Several may apply to one draw; the library's first check to see one raises, so
its message must be one of theirs."""

SKIPS: tuple[Rule, ...] = (
    Rule(
        "qk_clip_with_padding_as_documents",
        lambda d: (
            d.scenario.qk_clip
            and d.scenario.data in QK_CLIP_PADDED_DATA
            and d.context_parallel_size > 1
            and not d.dynamic
        ),
        "Megatron's packed batches at static CP > 1 give core attention padding as document tokens (--sft pads "
        "each document to a multiple of 2 * CP and pretrain_gpt.py passes the padded lengths as cu_seqlens_q; "
        "--dataloader-inter-document-masking's split adds a filler document): the padding rows' logits enter the "
        "max attention logit, Transformer Engine's as the 2d backend's, so QK-clip's statistic and clip are not "
        "those of CP = 1, whose batch has no padding (the op's own max excludes padding it is told of: "
        "tests/test_generated_attention.py; under hybrid CP the sub-sample bridge tells it of its end padding, "
        "dynamic_data.params_with_real_length)",
    ),
    Rule(
        "bf16_with_gdn",
        lambda d: d.scenario.dtype == "bf16" and _has(d, "G"),
        "Gated DeltaNet layers amplify rounding-level differences of their inputs about a hundredfold in the "
        "gradients (fp32: 2e-5 from 1e-7), so two bf16 layouts differ by tens of percent however exact both are; "
        "the fp32 draws compare GDN models",
    ),
    Rule(
        "megatron_fsdp_expert_mesh_with_cp_strided_over_dp",
        lambda d: d.megatron_fsdp and d.ep > 1 and d.order == "tp-dp-cp-ep-pp",
        "megatron-core 0.19.2's megatron-fsdp asserts at wrapping that its expert device mesh matches the expert "
        "data-parallel group (mcore_fsdp_adapter._check_mesh_ranks_and_group_ranks_are_consistent), which it does "
        "not when CP ranks are strided over DP (order tp-dp-cp-ep-pp) with EP > 1; Megatron's default order runs",
    ),
    Rule(
        "partial_distributed_optimizer_with_experts_and_cp_strided_over_dp",
        lambda d: d.zero_states == "optimizer" and d.ep > 1 and d.order == "tp-dp-cp-ep-pp",
        "megatron-core 0.19.2 computes rank-dependent gradient norms with num_distributed_optimizer_instances > 1, "
        "EP > 1 and CP ranks strided over DP (order tp-dp-cp-ep-pp, not a Megatron-LM flag): draw 5009:0 logged "
        "1.0206 and 1.0195 against the reference's 1.0353 at iteration 1, and trains exactly with Megatron's default "
        "order, with the unpartitioned distributed optimizer, or at EP 1 (an upstream defect, not a CPU limit)",
    ),
    Rule(
        "qk_layernorm_in_the_local_hybrid_spec",
        lambda d: d.scenario.model == "hybrid" and d.scenario.qk_layernorm,
        "Megatron's local hybrid stack spec (get_hybrid_stack_modelopt_spec, the CPU spec) has no q/k layernorm "
        "modules, and megatron-core refuses qk_layernorm without them; its Transformer Engine spec has them (GPU)",
    ),
)
"""Combinations that cannot run on this CPU machine, with why (counted, never run)."""


def expected_refusals(draw: Draw) -> list[Rule]:
    """Every refusal that applies to ``draw`` (empty: it must train)."""
    return [r for r in REFUSALS if r.applies(draw)]


def skip_reason(draw: Draw) -> Rule | None:
    return next((r for r in SKIPS if r.applies(draw)), None)


# ---- coverage (no training) ----------------------------------------------------------------------------------------
def cp_rank_holds_only_padding(draw: Draw) -> bool:
    """Whether, in some packed sequence of the draw, some CP rank holds no real token (zigzag and documents)."""
    from megatron_2d.packing.sharding import shard_documents, zigzag_rows

    CP = draw.context_parallel_size
    for lengths in draw.scenario.lengths:
        cu = np.concatenate([[0], np.cumsum(lengths)])
        if draw.scenario.data == "zigzag":
            rows = zigzag_rows(cu, CP, range(CP))
            if ((rows >= 0).sum(axis=1) == 0).any():
                return True
        elif draw.scenario.data == "documents":
            sharding = shard_documents(cu, draw.cp, draw.hp)
            views = sharding.views  # [cp, view_len]: each context rank's view, hp slices of it per head rank
            per_rank = views.reshape(draw.cp, draw.hp, -1)
            if ((per_rank >= 0).sum(axis=2) == 0).any():
                return True
    return False


EXPECTED_VALUES: dict[str, set] = {
    "model": set(MODELS),
    "hybrid_symbol": set("MG*-E"),
    "stage_without_attention": {True},
    "mla_ring": set(MLA_RINGS),
    "tp": {1, 2},
    "sequence_parallel": {True, False},
    "sequence_parallel_model": set(MODELS),
    "sequence_parallel_with": {"checkpoint_plus_plus", "thd", "window", "sinks", "mamba", "gdn", "moe", "pipeline"}
    | {f"mla_{ring}" for ring in MLA_RINGS},
    "moe_with_tensor_parallelism": {True},
    "moe_router": set(MOE_ROUTERS),
    "dynamic_moe_router": set(MOE_ROUTERS),
    "ep": {1, 2},
    "expert_parallelism_with_tensor_parallelism": {True},
    "normalization": set(NORMALIZATIONS),
    "norm_route": {"torch", "apex", "te"},
    "pp": {1, 2},
    "vpp": {None, 2},
    "hp": {1, 2, 4, 8},
    "cp": {1, 2, 4, 8},
    "double_ring": {True},
    "placement": set(PLACEMENTS),
    "order": set(ORDERS),
    "dp": {1, 2},
    "state": set(STATES),
    "hybrid_zero_states": {"optimizer", "optimizer+grads+params"},
    "wider_optimizer_shard": {True},
    "window": set(WINDOWS),
    "softmax_type": set(SOFTMAX_TYPES),
    "softmax_scale": {True, False},
    "qk_layernorm": {True, False},
    "kv_replication": {True, False},
    "position": set(POSITIONS),
    "data": set(DATA),
    "end_padding": {True},
    "one_token_documents": {True},
    "padding_only_rank": {True},
    "recompute": set(RECOMPUTE),
    "checkpoint_plus_plus_keep": set(CHECKPOINT_PLUS_PLUS_KEEP),
    "dtype": set(DTYPES),
    "dynamic": {True, False},
    "dynamic_group_size": {1, 2, 4, 8},
    "qk_clip": {True, False},
    "qk_clip_with": {"distributed_optimizer", "tp2", "mla", "mamba", "bf16", "pp2", "sequence_parallel", "ep2"},
}
"""Every value each axis must take over enough draws (:func:`missing_corners`); ``hybrid_symbol`` counts each
symbol of a hybrid pattern on its own."""


def axis_values(draw: Draw) -> dict[str, set]:
    """The values each axis of :data:`EXPECTED_VALUES` takes in ``draw`` (a set per axis; empty where the axis
    does not apply)."""
    s = draw.scenario
    lengths = [x for seq in s.lengths for x in seq]
    hybrid = s.model == "hybrid"
    return {
        "model": {s.model},
        "hybrid_symbol": set(s.layers) if hybrid else set(),
        "stage_without_attention": {hybrid and draw.pp > 1 and any("*" not in seg for seg in draw.pattern.split("|"))},
        "mla_ring": {draw.mla_ring} if s.model == "mla" else set(),
        "tp": {draw.tp},
        "sequence_parallel": {draw.sequence_parallel},
        "sequence_parallel_model": {s.model} if draw.sequence_parallel else set(),
        "sequence_parallel_with": sequence_parallel_with(draw),
        "moe_with_tensor_parallelism": {s.moe and draw.tp > 1},
        "moe_router": {s.moe_router} if s.moe else set(),
        "dynamic_moe_router": {s.moe_router} if s.moe and draw.dynamic else set(),
        "ep": {draw.ep},
        "expert_parallelism_with_tensor_parallelism": {draw.ep > 1 and draw.tp > 1},
        "normalization": {s.normalization},
        "norm_route": {norm_route(draw)},
        "pp": {draw.pp},
        "vpp": {draw.vpp},
        "hp": {draw.hp},
        "cp": {draw.cp},
        "double_ring": {1 < draw.inner_ring_size < draw.cp},
        "placement": {draw.placement},
        "order": {draw.order},
        "dp": {draw.dp},
        "state": {draw.state},
        "hybrid_zero_states": {draw.zero_states} if draw.zero_states else set(),
        "wider_optimizer_shard": {draw.wider_optimizer_shard},
        "window": {s.window},
        "softmax_type": {s.softmax_type},
        "softmax_scale": {s.softmax_scale is not None},
        "qk_layernorm": {s.qk_layernorm},
        "kv_replication": {s.model != "mla" and max(1, s.query_groups // draw.tp) < draw.hp},
        "position": {s.position},
        "data": {s.data},
        "end_padding": {s.end_padding > 0},
        "one_token_documents": {1 in lengths},
        "padding_only_rank": {cp_rank_holds_only_padding(draw)},
        "recompute": {draw.recompute},
        "checkpoint_plus_plus_keep": {draw.checkpoint_plus_plus_keep}
        if draw.recompute == "checkpoint_plus_plus"
        else set(),
        "dtype": {s.dtype},
        "dynamic": {draw.dynamic},
        "dynamic_group_size": dynamic_group_sizes(draw),
        "qk_clip": {s.qk_clip},
        "qk_clip_with": _qk_clip_with(draw) if s.qk_clip else set(),
    }


def _qk_clip_with(draw: Draw) -> set[str]:
    """What a QK-clip draw combines it with, of what megatron-core 0.19.2's own clip_qk cannot run or did not test
    (the distributed optimizer's shards, TP, MLA, Mamba layers, bf16, pipeline stages, sequence parallelism, expert
    parallelism's weights on other ranks)."""
    s = draw.scenario
    return {
        name
        for name, present in (
            ("distributed_optimizer", draw.state in ("distributed_optimizer", "hybrid_zero")),
            ("tp2", draw.tp > 1),
            ("mla", s.model == "mla"),
            ("mamba", _has(draw, "M")),
            ("bf16", s.dtype == "bf16"),
            ("pp2", draw.pp > 1),
            ("sequence_parallel", draw.sequence_parallel),
            ("ep2", draw.ep > 1),
        )
        if present
    }


def sequence_parallel_with(draw: Draw) -> set[str]:
    """What a sequence-parallel draw runs SP with (empty without SP): the SP-specific paths of the 2d backend and of
    Megatron around it (Checkpoint++'s kept inputs, packed documents padded by TP x 2 x CP, windows, sinks, Mamba and
    GDN layers, MoE, pipeline stages, both MLA rings)."""
    if not draw.sequence_parallel:
        return set()
    s = draw.scenario
    tags = {
        "checkpoint_plus_plus": draw.recompute == "checkpoint_plus_plus",
        "thd": s.data != "sbhd",
        "window": s.window != "none",
        "sinks": s.softmax_type != "vanilla",
        "mamba": _has(draw, "M"),
        "gdn": _has(draw, "G"),
        "moe": s.moe,
        "pipeline": draw.pp > 1,
        f"mla_{draw.mla_ring}": s.model == "mla",
    }
    return {tag for tag, on in tags.items() if on}


def dynamic_group_sizes(draw: Draw) -> set[int]:
    """The CP group sizes Megatron's hybrid CP gives the draw's documents (empty for a static draw)."""
    from megatron_2d.layout.dynamic import hybrid_group_sizes, megatron_cp_size

    if not draw.dynamic:
        return set()
    sizes = hybrid_group_sizes(draw.dp * draw.context_parallel_size)
    needs = {megatron_cp_size(n, draw.max_seqlen_per_rank) for seq in draw.scenario.lengths for n in seq}
    return {next((g for g in sizes if g >= need), need) for need in needs}


def missing_corners(draws: Sequence[Draw]) -> dict[str, set]:
    """The axis values of :data:`EXPECTED_VALUES` that none of ``draws`` takes (empty: every corner drawn)."""
    seen: dict[str, set] = {axis: set() for axis in EXPECTED_VALUES}
    for draw in draws:
        for axis, values in axis_values(draw).items():
            seen[axis] |= values
    return {axis: want - seen[axis] for axis, want in EXPECTED_VALUES.items() if want - seen[axis]}


def trains(draw: Draw) -> bool:
    """Whether ``draw`` is expected to train (no refusal, no skip)."""
    return skip_reason(draw) is None and not expected_refusals(draw)


def ci_seeds(count: int = 8, candidates: int = 120) -> list[int]:
    """The scenarios CI trains: greedily, the scenario among seeds 0..candidates-1 whose draws expected to train add
    the most axis values not yet covered (ties: the lower seed), ``count`` times; a pure function of the
    generator."""
    values = {
        seed: [(axis, v) for d in scenario_draws(seed) if trains(d) for axis, vs in axis_values(d).items() for v in vs]
        for seed in range(candidates)
    }
    chosen: list[int] = []
    seen: set = set()
    for _ in range(count):
        seed = max((s for s in values if s not in chosen), key=lambda s: (len(set(values[s]) - seen), -s))
        chosen.append(seed)
        seen |= set(values[seed])
    return sorted(chosen)
