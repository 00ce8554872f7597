"""Dynamic (hybrid) context parallelism under the 2d backend: a 2D layout per group size, its groups built at the
model's construction, the group of each micro-batch read from its PackedSeqParams.

Megatron's hybrid context parallelism (``--hybrid-context-parallel``, ``hybrid_context_parallel=True``) gives every
sequence of a global batch its own CP group of g ranks, a slice of the DP x CP group (sizes, slices and Megatron's
rule for g: :mod:`megatron_2d.layout.dynamic`), and hands each micro-batch's group to attention as
``PackedSeqParams.cp_group`` with ``local_cp_size`` = g (None and 1 for a sequence that runs on one rank). Transformer
Engine runs every such group as one flat ring. The 2d backend runs each size with its own head x context layout:

  * **layouts** (:func:`dynamic_layouts`): ``cp_2d_dynamic_layouts`` (``--cp-2d-dynamic-layouts "4=2x2,8=2x4/2"``)
    for the sizes it names; the planner's rule (:func:`megatron_2d.plan.dynamic.layout_for_size`: the least
    predicted attention time for g x max_seqlen_per_dp_cp_rank tokens with the model's heads, on the
    :data:`RULE_CLUSTER` preset) for the others. The choice is printed once at launch, as the flag that pins it.
  * **groups** (:func:`build_dynamic_groups`, collective over the world): at the model's construction, on every rank,
    the 2D groups (:class:`megatron_2d.Groups2D`) of every slice of every size, with that size's layout; g = 1 is the
    one-rank layout (no process group: plain attention, no collective). They live in the model config's
    :class:`.process_groups.GroupRegistry`, as the static CP groups do.
  * **per call** (:meth:`DynamicGroups.for_batch`): the micro-batch's ``local_cp_size`` and ``cp_group`` pick this
    rank's groups of that size, checked against the slice they were built for (a group that is not one of
    Megatron's hybrid groups is refused). The 2d layer spec's self attention
    (:class:`megatron_2d.megatron.per_sequence.SelfAttention2D`) turns the batch into the sequence layout of those
    groups (Megatron's per-sequence zigzag over 2 x g chunks, what ``get_batch_on_this_cp_rank`` gives hybrid
    batches) with RoPE at each token's position (:func:`dynamic_params`).

The data side (Megatron's hybrid sub-samples into pretrain_gpt.py's batches): :mod:`.dynamic_data`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from ..groups import Groups2D, build_groups_for_layout
from ..layout.choices import PackingMode
from ..layout.dynamic import (
    FLAG,
    check_dynamic_sizes,
    format_dynamic_layouts,
    hybrid_group_sizes,
    hybrid_slices,
    parse_dynamic_layouts,
)
from ..layout.heads import check_head_split, kv_replication
from ..layout.topology import Layout2D, LayoutError
from ..packed_sharding import PackedSharding
from .fields import fields_2d

RULE_CLUSTER = "8xH100"
"""The cluster preset the rule prices layouts on (megatron_2d.plan.hardware); another cluster: pin the layouts with
``--cp-2d-dynamic-layouts`` (``python -m megatron_2d.plan --dynamic --cluster ...`` prints the flag)."""
RULE_VOCAB = 32000
"""The vocabulary the rule's model is given (a TransformerConfig has none): the rule compares attention times only."""


def is_dynamic(config) -> bool:
    """Whether ``config`` (a TransformerConfig or megatron.training's args) runs hybrid (dynamic) CP."""
    return bool(getattr(config, "hybrid_context_parallel", False))


def rule_model(config):
    """The planner's ModelSpec of a Megatron model config (its heads, K/V heads, head dim, layers, MLP width)."""
    from ..plan.hardware import ModelSpec

    heads = config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    return ModelSpec(
        "megatron config",
        layers=config.num_layers,
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=config.num_query_groups or heads,
        ffn_hidden=config.ffn_hidden_size or 4 * config.hidden_size,
        vocab=RULE_VOCAB,
    )


def check_size_layout(config, size: int, layout: Layout2D) -> None:
    """ValueError unless ``layout`` splits the model's heads per TP rank (K/V heads replicated when hp exceeds
    them), naming the group size."""
    tp = config.tensor_model_parallel_size
    heads = config.num_attention_heads // tp
    kv_heads = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
    try:
        check_head_split(heads, layout.head_parallel_size, heads=f"attention heads per TP rank (group size {size})")
        kv_replication(heads, kv_heads, layout.head_parallel_size)
    except ValueError as err:
        raise ValueError(f"{FLAG} size {size}: {err}") from None


def given_layouts(config) -> dict[int, Layout2D]:
    """The layouts ``cp_2d_dynamic_layouts`` names (checked against the model's heads), by group size."""
    fields = fields_2d(config)
    try:
        layouts = parse_dynamic_layouts(fields.cp_2d_dynamic_layouts, fields.cp_2d_placement)
    except LayoutError as err:
        raise ValueError(str(err)) from None
    for size, layout in layouts.items():
        check_size_layout(config, size, layout)
    return layouts


@dataclass(frozen=True)
class DynamicLayouts:
    """The 2D layout of every group size of a run (1 included), and which ones the rule chose."""

    layouts: dict[int, Layout2D]
    from_rule: tuple[int, ...]

    def describe(self, placement: str) -> str:
        """One line for the launch log: the layouts as the flag that pins them, and where they came from."""
        shown = {g: layout for g, layout in self.layouts.items() if g > 1}
        source = (
            "all given by " + FLAG
            if not self.from_rule
            else f"sizes {list(self.from_rule)} by the planner's rule (least predicted attention time for g x "
            f"max_seqlen_per_dp_cp_rank tokens on {RULE_CLUSTER})"
        )
        return f"dynamic 2D layouts per CP group size: {FLAG} '{format_dynamic_layouts(shown, placement)}' ({source})"


def dynamic_layouts(config, dp_cp_size: int) -> DynamicLayouts:
    """Every group size's layout for a DP x CP group of ``dp_cp_size`` ranks: the config's
    ``cp_2d_dynamic_layouts`` entries, the rule for the rest (see the module docstring). The same on every rank."""
    from ..plan.dynamic import layout_for_size
    from ..plan.hardware import get_cluster

    sizes = hybrid_group_sizes(dp_cp_size)
    given = given_layouts(config)
    try:
        check_dynamic_sizes(given, sizes)
    except LayoutError as err:
        raise ValueError(str(err)) from None
    longest = config.max_seqlen_per_dp_cp_rank
    if longest is None:
        raise ValueError(dynamic_config_problems(config)[0])
    model, tp = rule_model(config), config.tensor_model_parallel_size
    layouts: dict[int, Layout2D] = {1: Layout2D(1, 1)}
    rule = []
    for size in sizes[1:]:
        if size in given:
            layouts[size] = given[size]
            continue
        layouts[size] = layout_for_size(model, get_cluster(RULE_CLUSTER), size, size * longest, tp)[0]
        rule.append(size)
    return DynamicLayouts(layouts, tuple(rule))


STATIC_SETTINGS = ("cp_2d_head_parallel_size", "cp_2d_context_size", "cp_2d_inner_ring_size")
"""The static layout's settings: under hybrid CP each group size has its own (``cp_2d_dynamic_layouts``)."""


def dynamic_config_problems(config) -> list[str]:
    """What the 2d backend cannot run under hybrid (dynamic) CP in ``config`` (a TransformerConfig or
    megatron.training's args), each naming the setting and what would work; empty when it can (or when hybrid CP
    is off). Upstream's own refusals (pipeline parallelism, megatron-fsdp, MLA, no per-token loss, CUDA graphs) are
    repeated here so that every route (the Python config included) stops before any collective, with what upstream
    does not refuse but hangs on or computes wrongly (expert parallelism, MoE router statistics:
    :func:`moe_router_problems`)."""
    if not is_dynamic(config):
        return []
    problems = []
    if getattr(config, "max_seqlen_per_dp_cp_rank", None) is None:
        problems.append(
            "hybrid_context_parallel needs max_seqlen_per_dp_cp_rank (--max-seqlen-per-dp-cp-rank): the tokens one "
            "rank can hold, from which Megatron gives each sequence its CP group size"
        )
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        problems.append(
            f"hybrid_context_parallel with pipeline_model_parallel_size {pp}: megatron-core 0.19.2's hybrid schedule "
            f"runs without pipelining (training/arguments.py refuses it too); use --pipeline-model-parallel-size 1"
        )
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    if ep > 1:
        problems.append(
            f"hybrid_context_parallel with expert_model_parallel_size {ep}: megatron-core 0.19.2's hybrid schedule "
            f"runs different numbers of sequences on the ranks of an expert-parallel group, and every MoE layer's "
            f"token dispatch is a collective over that group, so the ranks wait on each other until the timeout "
            f"(Megatron-LM's open dynamic-CP series clamps the group sizes for it, PR #7146); use "
            f"--expert-model-parallel-size 1"
        )
    problems += moe_router_problems(config)
    if getattr(config, "use_megatron_fsdp", False):
        problems.append("hybrid_context_parallel with megatron-fsdp is refused by megatron-core 0.19.2; drop it")
    if getattr(config, "multi_latent_attention", False):
        problems.append(
            "hybrid_context_parallel with multi-latent attention is refused by megatron-core 0.19.2 "
            "(multi_latent_attention.py); drop one of them"
        )
    if not getattr(config, "calculate_per_token_loss", False):
        problems.append(
            "hybrid_context_parallel needs calculate_per_token_loss (--calculate-per-token-loss): ranks run "
            "different numbers of sequences of different lengths, so only a loss summed over tokens and divided by "
            "the global token count weighs every token equally (megatron-core 0.19.2 asserts it too)"
        )
    if getattr(config, "apply_rope_fusion", False):
        problems.append(
            "hybrid_context_parallel with the 2d backend needs apply_rope_fusion=False (--no-rope-fusion): each "
            "micro-batch's RoPE table is laid out for its own CP group, which Transformer Engine's fused THD RoPE "
            "does not read (it assumes the static CP group)"
        )
    if getattr(config, "hierarchical_context_parallel_sizes", None):
        problems.append(
            "hierarchical_context_parallel_sizes with hybrid_context_parallel: each CP group size has its own 2D "
            f"layout; give them with {FLAG} (SIZE=HPxCP entries) instead"
        )
    fields = fields_2d(config)
    static = {name: getattr(fields, name) for name in STATIC_SETTINGS if getattr(fields, name) is not None}
    if static:
        problems.append(
            f"{static} describe one static 2D layout, which hybrid_context_parallel does not run (each CP group "
            f"size runs its own); give them per size with {FLAG} (e.g. '4=2x2,8=2x4/2') or drop them"
        )
    if fields.cp_2d_packing == PackingMode.DOCUMENTS:
        problems.append(
            "cp_2d_packing='documents' with hybrid_context_parallel: Megatron's hybrid schedule unpacks every "
            "sample into its sequences and runs each on its own CP group (Megatron's per-sequence split), so there "
            "is no packed batch to lay out by documents; drop --cp-2d-packing documents"
        )
    return problems


def router_load_balancing(config) -> dict[str, float]:
    """The MoE router's load-balancing types with their coefficients (``moe_router_load_balancing_type`` and
    ``moe_aux_loss_coeff``, each a value or a list, as megatron-core and its flags take them); empty without MoE
    (``num_moe_experts`` / ``--num-experts``)."""
    if not (getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None)):
        return {}
    types = getattr(config, "moe_router_load_balancing_type", "aux_loss") or "aux_loss"
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    types = list(types) if isinstance(types, (list, tuple)) else [types]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    return {kind: float(coeff) for kind, coeff in zip(types, coeffs)}


def moe_router_problems(config) -> list[str]:
    """What megatron-core 0.19.2's MoE router computes wrongly or hangs on under hybrid (dynamic) CP, each naming the
    setting and what runs (the z-loss and plain top-k routing do; :mod:`.dynamic_data` keeps the bridge's padding
    out of them). Measured on CPU ranks against CP = 1 (docs/megatron.md)."""
    balancing = router_load_balancing(config)
    problems = []
    upstream = "Megatron-LM's open dynamic-CP series reduces the router's statistics over the runtime group, PR #7146"
    local = [kind for kind in ("aux_loss", "seq_aux_loss") if balancing.get(kind, 0.0) > 0]
    if local:
        problems.append(
            f"hybrid_context_parallel with the MoE {' and '.join(local)} (--moe-router-load-balancing-type "
            f"{' '.join(local)}, --moe-aux-loss-coeff {' '.join(str(balancing[k]) for k in local)}): megatron-core "
            f"0.19.2's router sums each micro-batch's expert counts over the static TP x CP group, not over the "
            f"micro-batch's hybrid CP group, so at static CP 1 each rank balances its share of a sequence alone (the "
            f"router gradients differ from CP = 1's: measured 4-7%) and at static CP > 1 the ranks of the static "
            f"group, which run other micro-batches, wait on each other until the timeout ({upstream}); use "
            f"--moe-aux-loss-coeff 0 (the z-loss, --moe-z-loss-coeff, runs) or static CP"
        )
    if balancing.get("global_aux_loss", 0.0) > 0:
        problems.append(
            f"hybrid_context_parallel with the MoE global_aux_loss (--moe-aux-loss-coeff "
            f"{balancing['global_aux_loss']}): megatron-core 0.19.2's router all-reduces every micro-batch's expert "
            f"counts over the TP x DP x CP group, whose ranks run different numbers of micro-batches under hybrid CP, "
            f"so they wait on each other until the timeout ({upstream}); use --moe-aux-loss-coeff 0 or static CP"
        )
    if "quantile_balancing" in balancing:
        problems.append(
            "hybrid_context_parallel with --moe-router-load-balancing-type quantile_balancing: megatron-core 0.19.2's "
            "router gathers every micro-batch's logits over the static TP x CP group (one rank's share of a sequence "
            "at static CP 1, other ranks' micro-batches at static CP > 1) and takes no padding mask, which the "
            "hybrid bridge's padding needs; use another --moe-router-load-balancing-type (aux-loss-free: 'none')"
        )
    if getattr(config, "moe_router_enable_expert_bias", False) and balancing:
        problems.append(
            "hybrid_context_parallel with --moe-router-enable-expert-bias: the expert bias is updated from every "
            "routed token's count, and hybrid CP pads each sequence to a multiple of 2 x its CP group size "
            "(megatron_2d.megatron.dynamic_data), tokens a CP = 1 step would not count; megatron-core 0.19.2's router "
            "fails on the padding mask that leaves them out (router.py _apply_expert_bias: a [tokens] mask against "
            "the [tokens, experts] routing map); drop --moe-router-enable-expert-bias or use static CP"
        )
    return problems


def check_dynamic_config(config) -> None:
    """ValueError naming every :func:`dynamic_config_problems` of ``config``."""
    problems = dynamic_config_problems(config)
    if problems:
        raise ValueError(
            "settings not supported with hybrid context parallelism and cp_comm_type '2d':\n  " + "\n  ".join(problems)
        )


@dataclass
class DynamicGroups:
    """One rank's 2D groups of every CP group size of hybrid CP, and the layouts they were built with."""

    layouts: DynamicLayouts
    groups: dict[int, Groups2D]
    """This rank's groups of each size (size 1: the one-rank layout, no process group)."""
    dp_cp_ranks: tuple[int, ...]
    """The DP x CP group (global ranks) this rank's slices are cut from."""
    _checked: dict[int, int] = field(default_factory=dict, repr=False)
    """id(cp_group) -> size, for the hybrid groups already checked against the slices (per call: a dict lookup)."""

    def for_batch(self, local_cp_size, cp_group: dist.ProcessGroup | None) -> Groups2D:
        """This rank's groups for a micro-batch of ``local_cp_size`` ranks on ``cp_group`` (PackedSeqParams'),
        checked: the size is one of the run's and the group is this rank's slice of that size."""
        size = int(local_cp_size)
        if size not in self.groups:
            raise ValueError(
                f"packed_seq_params.local_cp_size {size} is not a CP group size of this run; the DP x CP group of "
                f"{len(self.dp_cp_ranks)} ranks has groups of {sorted(self.groups)}"
            )
        if size == 1:
            if cp_group is not None and dist.get_world_size(cp_group) != 1:
                raise ValueError(
                    f"packed_seq_params.local_cp_size is 1 but its cp_group has {dist.get_world_size(cp_group)} ranks"
                )
            return self.groups[1]
        if cp_group is None:
            raise ValueError(f"packed_seq_params.local_cp_size is {size} but it carries no cp_group")
        if self._checked.get(id(cp_group)) != size:
            ranks = tuple(dist.get_process_group_ranks(cp_group))
            built = self.groups[size].place.cp_ranks
            if ranks != built:
                raise ValueError(
                    f"packed_seq_params.cp_group holds ranks {list(ranks)}, but this rank's hybrid CP group of "
                    f"{size} ranks is {list(built)} (a slice of the DP x CP group, Megatron's "
                    f"get_hybrid_data_context_parallel_groups): the 2D groups were built for that one"
                )
            self._checked[id(cp_group)] = size
        return self.groups[size]

    def batch_params(self, params, rope_group: dist.ProcessGroup | None, t_local: int, device) -> PackedSeqParams:
        """The PackedSeqParams a hybrid-CP micro-batch (``params``: Megatron's, with local_cp_size and cp_group)
        runs with: :func:`dynamic_params` on its group's 2D groups (:meth:`for_batch`). ``t_local``: this rank's
        tokens of it; ``rope_group``: the CP group Megatron's THD RoPE splits by."""
        groups = self.for_batch(params.local_cp_size, params.cp_group)
        return dynamic_params(params, groups, rope_group, t_local, device)

    def static_groups(self, cp_group: dist.ProcessGroup | None) -> Groups2D | None:
        """The groups of the model's static CP group (for a batch without local_cp_size): the slice of its size
        when it is one (Megatron's CP groups are slices of the DP x CP groups in its default rank order), else
        None."""
        ranks = tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else (dist.get_rank(),)
        groups = self.groups.get(len(ranks))
        return groups if groups is not None and groups.place.cp_ranks == ranks else None

    def destroy(self) -> None:
        for groups in self.groups.values():
            groups.destroy()


def _dp_cp_ranks(dp_cp_group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(dp_cp_group)) if dp_cp_group is not None else (dist.get_rank(),)


def _megatron_slice(size: int, dp_cp_size: int) -> tuple[int, ...] | None:
    """This rank's hybrid group of ``size`` as Megatron's parallel state holds it (None when it has none)."""
    from megatron.core import parallel_state

    try:
        group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)
    except (AssertionError, KeyError):
        return None
    return tuple(dist.get_process_group_ranks(group))


def build_dynamic_groups(layouts: DynamicLayouts, dp_cp_group: dist.ProcessGroup | None) -> DynamicGroups:
    """This rank's 2D groups of every size of ``layouts``, built on every rank in the same order (collective over
    the world: every rank calls it with its own DP x CP group and the same layouts). Megatron's hybrid groups (its
    parallel state, ``initialize_model_parallel(hybrid_context_parallel=True)``) must be this rank's slices; any
    rank that finds otherwise stops every rank, with the reason, before a group is built."""
    mine = _dp_cp_ranks(dp_cp_group)
    problem = None
    for size in layouts.layouts:
        if size == 1:
            continue
        want = next(s for s in hybrid_slices(mine, size) if dist.get_rank() in s)
        have = _megatron_slice(size, len(mine))
        if have != tuple(want):
            problem = (
                f"rank {dist.get_rank()}: Megatron's hybrid CP group of {size} ranks is "
                f"{None if have is None else list(have)}, the 2d backend expects the slice {want} of the DP x CP "
                f"group {list(mine)}: initialize megatron's parallel state with hybrid_context_parallel=True "
                f"(--hybrid-context-parallel) in its default rank order"
            )
            break
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, problem))
    problems = [p for _, p in gathered if p]
    if problems:
        raise ValueError(problems[0])
    lists = sorted({ranks for ranks, _ in gathered})
    groups = {}
    for size, layout in sorted(layouts.layouts.items()):
        slices = [s for ranks in lists for s in hybrid_slices(ranks, size)]
        groups[size] = build_groups_for_layout(layout, slices)
    return DynamicGroups(layouts, groups, mine)


@dataclass
class SequenceParams2D(PackedSeqParams):
    """The PackedSeqParams of a hybrid-CP micro-batch that is one sequence (what megatron-core 0.19.2's hybrid
    schedule gives): ``groups`` are its CP group's 2D groups, on which CoreAttention2D runs it as an unpacked
    sequence (Megatron's 2 x g zigzag is the sbhd layout: no packed layout to build, no host read); the THD fields
    and ``rope_positions`` are those Megatron's THD RoPE reads (:func:`dynamic_params`)."""

    groups: Groups2D | None = None
    rope_positions: torch.Tensor | None = None
    padded_layout: PackedSharding | None = None
    """When Megatron's params say where the sequence's padding starts (cu_seqlens [0, L] within
    cu_seqlens_padded [0, L'], what :func:`megatron_2d.megatron.dynamic_data.params_with_real_length` tells under
    QK-clip): the zigzag layout of that one padded document on ``groups``, which CoreAttention2D then runs it as (the
    op leaves the padding rows out of the max logit); else None."""


def zigzag_positions(t_local: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """[t_local] positions of the tokens CP rank ``cp_rank`` of ``cp_size`` holds of one sequence in Megatron's
    zigzag (chunks r and 2 x CP - 1 - r of t_local / 2 tokens)."""
    half = t_local // 2
    chunks = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=device)
    return (chunks[:, None] * half + torch.arange(half, device=device)).reshape(-1)


def dynamic_params(params, groups: Groups2D, rope_group: dist.ProcessGroup | None, t_local: int, device):
    """The PackedSeqParams a hybrid-CP micro-batch runs with on ``groups`` (its CP group's), its RoPE table laid out
    for ``rope_group`` (the static CP group Megatron's THD RoPE splits by); cached on ``params`` (one build per
    micro-batch, the first layer's). One sequence (cu_seqlens [0, L], as the hybrid schedule gives):
    :class:`SequenceParams2D`, read off the shapes alone; with its real length told (cu_seqlens [0, L] within
    cu_seqlens_padded [0, L'], under QK-clip) and L < L', with the layout of the padding (``padded_layout``). Several
    documents: Megatron's per-sequence split over the group, the sequence layout
    (:func:`megatron_2d.megatron.per_sequence.sequence_params`)."""
    from .packed_data import rope_table
    from .per_sequence import sequence_params

    cu = params.cu_seqlens_q
    padded = params.cu_seqlens_q_padded
    told = padded is not None and padded is not cu  # the real length within the padded one
    if cu is None or cu.shape[-1] != 2 or (told and padded.shape[-1] != 2):
        return sequence_params(params, groups, device, rope_group=rope_group)
    cache = params.__dict__.setdefault("_megatron_2d_dynamic", {})
    key = (groups.layout, groups.place, t_local)
    if key not in cache:
        rope_size, rope_rank = (rope_group.size(), rope_group.rank()) if rope_group is not None else (1, 0)
        positions = zigzag_positions(t_local, groups.layout.cp_size, groups.place.cp_index, device)
        rope_cu = torch.tensor([0, rope_size * t_local], dtype=torch.int32, device=device)
        total = groups.layout.cp_size * t_local  # L': the padded sequence, as the shapes give it
        real = int(cu[-1]) if told else total  # a padded micro-batch's one device-to-host read (QK-clip only)
        padded_layout = None
        if real < total:  # collective over the micro-batch's group, whose ranks all run this layer
            padded_layout = PackedSharding([0, real], groups, mode=PackingMode.ZIGZAG, cu_seqlens_padded=[0, total])
        cache[key] = SequenceParams2D(
            qkv_format="thd",
            cu_seqlens_q=rope_cu,
            cu_seqlens_kv=rope_cu,
            cu_seqlens_q_padded=rope_cu,
            cu_seqlens_kv_padded=rope_cu,
            max_seqlen_q=rope_size * t_local,
            max_seqlen_kv=rope_size * t_local,
            groups=groups,
            rope_positions=rope_table(positions, rope_size, rope_rank),
            padded_layout=padded_layout,
        )
    return cache[key]
