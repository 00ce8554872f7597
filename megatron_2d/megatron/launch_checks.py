"""Checks of a Megatron-LM launch (pretrain_gpt.py flags) against what the 2d backend supports.

Every route into the library reaches them, on every rank, before any model is trained:

  * the patched pretrain_gpt.py / pretrain_hybrid.py and ``examples/pretrain_gpt_2d.py`` build the model config with
    :func:`megatron_2d.megatron.arguments.gpt_config_from_args_2d` / ``hybrid_config_from_args_2d``, which call
    :func:`check_launch_args`;
  * the unpatched ``--spec megatron_2d.megatron.spec gpt_layer_spec_2d`` route calls the layer-spec function, and the
    unpatched ``pretrain_hybrid.py --spec megatron_2d.megatron.hybrid_spec hybrid_stack_spec_2d`` route builds
    ``HybridStack2D``; both call :func:`check_current_launch` (megatron.training's parsed arguments, when a launch
    has set them) before any layer is built.

What the layers need of the launch travels explicitly where an entry of ours builds the config: the config carries
it (:class:`LaunchFields`, mixed into TransformerConfig2D: the launch's packing flags, copied by name from the
arguments, and whether the entry checked the launch). megatron.training's global arguments are read
(:func:`current_launch_args`) only where no such path exists: the stock scripts' ``--spec`` routes, whose config is
megatron-core's own TransformerConfig, built by Megatron's builder (the ready ``GPT_LAYER_SPEC_2D`` among them).

Model-level settings are validated by ``settings_from_config`` (hp, window, placement, heads; run on the flags first by
:func:`static_layout_problem`), the attention settings by :mod:`.attention_settings` (dropout among them) and MLA's by
:func:`.mla.check_mla_settings` (its packing refusals, :func:`mla_packing_problem`, run here first); this module covers
what only the command line knows (how the data is packed, :func:`packing_mode`; whether the loss would be normalised per
CP rank over uneven loss masks, :func:`loss_scaling_problem`; a hybrid model's layer pattern; a ready spec under a
pipeline layout with empty stages, :func:`ready_spec_pipeline_problem`; compositions of Megatron's own options that
megatron-core 0.19.2 cannot start or gets wrong, :func:`megatron_composition_problems`, Hybrid ZeRO's clipping among
them), the hybrid layers' needs of the CP group (:func:`check_hybrid_layers`, also run by ``HybridStack2D`` at
construction) and what the documents layout's data path can run (:func:`documents_layout_problem`, also run by
``TransformerConfig2D``). They run before any collective of the library: the model's 2D groups are built after them, at
its construction (:mod:`.process_groups`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from ..layout.choices import MegatronSplit
from ..layout.choices import PackingMode as Mode
from ..layout.hybrid_layers import (
    GDN,
    MAMBA,
    MAMBA_EXPAND,
    SSM_SYMBOLS,
    decoder_layers,
    gdn_cp_problem,
    mamba_cp_problem,
    mamba_num_heads,
)
from ..packing.modes import PackingMode, megatron_split_mode, mode_class
from .dynamic import dynamic_config_problems, dynamic_layouts, is_dynamic
from .fields import fields_2d
from .settings import BACKEND_NAME, layer_comm_types, settings_from_config, uses_2d

PACKED_SEQUENCE_FLAGS: tuple[tuple[str, str], ...] = (("--reset-attention-mask", "reset_attention_mask"),)
"""Document-masking flags whose batches the 2d backend would get wrong, with their argparse destinations:
--reset-attention-mask builds a dense [s, s] mask (not THD). Packed documents reach the 2d backend as THD:
--sft (Megatron's per-document zigzag split), --dataloader-inter-document-masking (Megatron's per-sequence split,
the "sequence" layout; see :func:`packing_mode`), or the documents layout of megatron_2d.megatron.packed_data."""


@dataclass
class LaunchFields:
    """What the model's layers need of the launch, carried by its config (TransformerConfig2D mixes these in), so
    that the layers do not read megatron.training's global arguments on the patched routes.

    ``sft``, ``dataloader_inter_document_masking``: the launch's flags of those names (how Megatron splits packed
    batches, :func:`packing_mode`), which megatron.training's ``core_transformer_config_from_args`` copies into the
    config by name; None: the config was not built from a launch's arguments. ``launch_checked``: the entry that built
    the config checked its launch (:func:`check_launch_args`) and found the training loop's clip step fit for it
    (:func:`qk_clip_step_problem`: the patched entries give the loop the 2d one first), so the layers need not check
    the launch again (:func:`check_current_launch`); set by
    :func:`megatron_2d.megatron.arguments.gpt_config_from_args_2d` / ``hybrid_config_from_args_2d``."""

    sft: bool | None = None
    dataloader_inter_document_masking: bool | None = None
    launch_checked: bool = False


def check_launch_args(args) -> None:
    """Refuse, with ValueError, flags the 2d backend would otherwise get silently wrong (``args``: the Namespace of
    megatron.training's parse_and_validate_args). Nothing is checked when no layer uses ``--cp-comm-type 2d``."""
    if not uses_2d(getattr(args, "cp_comm_type", None)):
        return
    given = [flag for flag, dest in PACKED_SEQUENCE_FLAGS if getattr(args, dest, False)]
    dynamic = dynamic_launch_problems(args)
    if dynamic:  # first: hybrid CP changes what the checks below would say (its split is per sequence)
        raise ValueError(dynamic[0])
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:  # pretrain_hybrid.py: Mamba / GDN layers against the CP group, before any model is built
        check_hybrid_layers(args, decoder_layers(pattern))
    if given:
        raise ValueError(
            f"{', '.join(given)} gives document masks the 2d backend (cp_comm_type "
            f"{layer_comm_types(args.cp_comm_type)}) would not see as packed THD batches; drop "
            f"{', '.join(given)} and pack documents as THD (--dataloader-inter-document-masking, --sft, "
            f"or the documents layout of megatron_2d.megatron.packed_data, see "
            f"examples/pretrain_gpt_2d.py)"
        )
    checks = (
        static_layout_problem,
        chosen_mode(args).launch_problem,
        loss_scaling_problem,
        ready_spec_pipeline_problem,
        documents_layout_problem,
        mla_packing_problem,
    )
    problems = [check(args) for check in checks] + megatron_composition_problems(args)
    for problem in problems:
        if problem:
            raise ValueError(problem)


def dynamic_launch_problems(args) -> list[str]:
    """What a ``--hybrid-context-parallel`` launch with the 2d backend cannot run (``args``: megatron.training's
    parsed arguments), each naming the flags and what would work: the model settings of
    :func:`.dynamic.dynamic_config_problems`, then what only the command line knows. Empty without hybrid CP."""
    if not is_dynamic(args):
        return []
    problems = dynamic_config_problems(args)
    if not hasattr(args, "cp_2d_dynamic_layouts"):
        problems.append(
            "--hybrid-context-parallel through pretrain_gpt.py without the 2d flags (the --spec route): "
            "megatron-core 0.19.2 hands pretrain_gpt.py's get_batch its hybrid sub-samples without the batch "
            "dimension and cu_seqlens it reads (an IndexError on the first step); run the patched pretrain_gpt.py "
            "or examples/pretrain_gpt_2d.py, whose forward step adds them (megatron_2d.megatron.dynamic_data)"
        )
    if (getattr(args, "dataloader_type", None) or "single") != "single":  # None: validate_args makes it single
        problems.append(
            f"--hybrid-context-parallel needs --dataloader-type single (megatron-core 0.19.2's hybrid sampler), "
            f"not {args.dataloader_type!r}"
        )
    if getattr(args, "rerun_mode", "disabled") != "disabled":
        problems.append(
            f"--hybrid-context-parallel with --rerun-mode {args.rerun_mode}: megatron-core 0.19.2's train() wraps "
            f"the hybrid data iterator in a plain iter(), and the rerun state machine then asserts 'data iterator "
            f"is not wrapped with RerunDataIterator' before iteration 1 (fixed after 0.19 by Megatron-LM #6822); "
            f"add --rerun-mode disabled"
        )
    if not getattr(args, "sft", False):
        masking = getattr(args, "dataloader_inter_document_masking", False)
        problems.append(
            "--hybrid-context-parallel needs packed samples that say where each sequence ends (cu_seqlens): "
            "Megatron's hybrid data wrapper unpacks them into their sequences; "
            + (
                "--dataloader-inter-document-masking without --sft makes megatron-core 0.19.2 split each sequence "
                "over the static CP group, not its hybrid one; use --sft"
                if masking
                else "use --sft (SFTDataset's packed conversations)"
            )
        )
    if validates(args):
        problems.append(
            f"--eval-iters {args.eval_iters} with validation data (--split {getattr(args, 'split', None)}) and "
            f"--hybrid-context-parallel: megatron-core 0.19.2 evaluates through the hybrid schedule with an "
            f"unwrapped validation iterator, which reads a raw batch as scheduled sub-samples (an IndexError in "
            f"hybrid_cp_schedule.py at the first evaluation); add --eval-iters 0"
        )
    longest, seq = getattr(args, "max_seqlen_per_dp_cp_rank", None), getattr(args, "seq_length", None)
    dp = getattr(args, "data_parallel_size", None)  # set by megatron's validate_args (None: parsed only)
    ranks = dp * (getattr(args, "context_parallel_size", 1) or 1) if dp else None
    if ranks and longest and seq and seq > ranks * longest:
        problems.append(
            f"--seq-length {seq} > DP x CP x --max-seqlen-per-dp-cp-rank = {ranks} x {longest} = {ranks * longest}: "
            f"a sequence of up to {seq} tokens (SFTDataset's last conversation takes a pack's end padding) would need "
            f"more ranks than the DP x CP group has, and megatron-core 0.19.2's scheduler stops with an assertion "
            f"('cannot reditribute'); raise --max-seqlen-per-dp-cp-rank to at least {-(-seq // ranks)}"
        )
    others = sorted({t for t in layer_comm_types(args.cp_comm_type) if t != BACKEND_NAME}, key=str)
    if others:
        problems.append(
            f"--cp-comm-type {' '.join(map(str, layer_comm_types(args.cp_comm_type)))} mixes the 2d backend with "
            f"{others} under --hybrid-context-parallel; give every layer 2d"
        )
    if not problems and longest and ranks:  # the per-size layouts against the heads and the run's group sizes
        try:
            dynamic_layouts(args, ranks)
        except ValueError as err:
            problems.append(str(err))
    pattern = getattr(args, "hybrid_layer_pattern", None)
    ssm = sorted(set(decoder_layers(pattern)) & SSM_SYMBOLS) if pattern else []
    if ssm:
        problems.append(
            f"--hybrid-layer-pattern {pattern!r} with --hybrid-context-parallel: its {', '.join(ssm)} layers run "
            f"Megatron's context parallelism over the static CP group, not each micro-batch's hybrid group; use "
            f"attention and MLP layers only ('*', '-', 'E')"
        )
    return problems


def validates(args) -> bool:
    """Whether a launch evaluates on validation data (megatron.training's do_valid): --eval-iters > 0 with a
    validation split, a validation path, mock data or --full-validation; True when the split cannot be read."""
    if not getattr(args, "eval_iters", 0):
        return False
    if any(getattr(args, name, None) for name in ("valid_data_path", "mock_data", "full_validation")):
        return True
    split = getattr(args, "split", None)
    if split is None:
        return getattr(args, "data_path", None) is not None
    try:
        weights = [float(part) for part in re.split(r"[,/]", str(split)) if part.strip()]
    except ValueError:
        return True
    return len(weights) > 1 and weights[1] > 0


def documents_layout_problem(config) -> str | None:
    """Why the documents layout (``cp_2d_packing="documents"``) cannot run with ``config`` (a TransformerConfig or
    megatron.training's args: the same names), or None. Its data path
    (:func:`megatron_2d.megatron.packed_data.documents_batch_on_this_cp_rank`) lays each micro-batch out afresh, so
    every CP rank holds as many slots as the fullest one needs that batch: not the fixed [seq_length / CP] tensors
    Megatron's pipeline schedule sends between stages, and a stage without attention has no layout to build."""
    if fields_2d(config).cp_2d_packing != Mode.DOCUMENTS or getattr(config, "context_parallel_size", 1) == 1:
        return None
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        return (
            f"cp_2d_packing='documents' (--cp-2d-packing documents) runs with pipeline_model_parallel_size 1 only, "
            f"not {pp}: the documents layout gives every micro-batch its own number of tokens per CP rank, and "
            f"Megatron's pipeline schedule sends fixed [seq_length / CP] activations between stages; use "
            f"cp_2d_packing='zigzag' (--sft batches, Megatron's per-document split) with pipeline parallelism"
        )
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if getattr(config, "sequence_parallel", False) and tp > 1:
        return (
            f"cp_2d_packing='documents' (--cp-2d-packing documents) with --sequence-parallel at "
            f"tensor_model_parallel_size {tp}: the documents layout gives each CP rank as many slots as the batch "
            f"needs, not a multiple of TP, and sequence parallelism splits every rank's tokens over TP (Megatron's "
            f"padding rule: the packed length divisible by TP x 2 x CP); use cp_2d_packing='zigzag' (--sft "
            f"batches padded by that rule) with sequence parallelism"
        )
    if getattr(config, "moe_router_enable_expert_bias", False) and (
        getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None)
    ):
        return (
            "cp_2d_packing='documents' (--cp-2d-packing documents) with --moe-router-enable-expert-bias: the documents "
            "layout pads each CP rank's slots, and its data path gives a MoE model their padding mask so that the "
            "router's losses and expert counts leave them out (a CP = 1 step has no such tokens); megatron-core "
            "0.19.2's router fails on a padding mask with the expert bias (router.py _apply_expert_bias: a [tokens] "
            "mask against the [tokens, experts] routing map); use cp_2d_packing='zigzag' (--sft batches) or drop "
            "--moe-router-enable-expert-bias"
        )
    return None


def static_layout_problem(args) -> str | None:
    """Why this launch's static 2D layout cannot run, or None: :func:`.settings.settings_from_config` on the flags
    (``args``: megatron.training's parsed arguments), as TransformerConfig2D checks the config: hp x cp = CP, hp
    dividing the attention heads per TP rank (naming the valid hp), w dividing cp, a known placement, whole K/V
    heads. Hybrid CP's per-size layouts are :func:`dynamic_launch_problems`'; at CP = 1 nothing is split."""
    if is_dynamic(args) or (getattr(args, "context_parallel_size", 1) or 1) == 1:
        return None
    try:
        settings_from_config(args)
    except ValueError as err:
        return str(err)
    return None


def mla_packing_problem(config) -> str | None:
    """Why multi-latent attention cannot run on ``config``'s packed batches (a TransformerConfig or
    megatron.training's args: the same names), or None: MLA's RoPE assumes Megatron's per-document split, which
    neither Megatron's per-sequence split nor the documents layout keeps. Run by the launch checks and by
    :func:`.mla.check_mla_settings` (TransformerConfig2D, the layer spec)."""
    if not getattr(config, "multi_latent_attention", False):
        return None
    if megatron_split(config) == MegatronSplit.PER_SEQUENCE:
        return (
            "Megatron's per-sequence split of packed documents (--dataloader-inter-document-masking "
            "without --sft) with multi-latent attention is not supported by the 2d backend: MLA's "
            "RoPE assumes the per-document split; use --sft batches (Megatron's per-document split)"
        )
    if packing_mode(config) == Mode.DOCUMENTS and getattr(config, "context_parallel_size", 1) > 1:
        return (
            "cp_2d_packing='documents' (--cp-2d-packing documents) with multi-latent attention is not supported by "
            "the 2d backend: MLA applies RoPE inside its attention at the positions of Megatron's per-document "
            "split, which the documents layout does not keep; use cp_2d_packing='zigzag' (--sft batches)"
        )
    return None


def megatron_composition_problems(args) -> list[str]:
    """What megatron-core 0.19.2 itself cannot start in this launch, found before it fails deep inside (an einops
    error in megatron-fsdp, an assertion in initialize_model_parallel), with what would work. ``args``:
    megatron.training's parsed arguments."""
    problems = []
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    if getattr(args, "use_megatron_fsdp", False) and pp > 1:
        problems.append(
            f"--use-megatron-fsdp with --pipeline-model-parallel-size {pp}: megatron-core 0.19.2's megatron-fsdp "
            f"lays its device mesh over the data-parallel x tensor-parallel ranks of the whole world "
            f"(mcore_fsdp_adapter._get_dp_tp_mesh), which has no room for pipeline stages, and fails when it wraps "
            f"the model; use --pipeline-model-parallel-size 1 with megatron-fsdp, or the distributed optimizer "
            f"(--use-distributed-optimizer, Hybrid ZeRO's 'optimizer' choice) with pipeline parallelism"
        )
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if (
        instances > 1
        and pp > 1
        and getattr(args, "use_distributed_optimizer", False)
        and not getattr(args, "use_megatron_fsdp", False)
        and getattr(args, "overlap_grad_reduce", False)
        and getattr(args, "align_grad_reduce", True)
    ):
        problems.append(
            f"--num-distributed-optimizer-instances {instances} (partial sharding of the distributed optimizer, "
            f"Hybrid ZeRO's shard_size < dp x cp) with --overlap-grad-reduce and --pipeline-model-parallel-size "
            f"{pp}: megatron-core 0.19.2 reduces the first iteration's gradients twice there (the pipeline schedule "
            f"starts each bucket's reduction through --align-grad-reduce's grad_sync_func, and with several "
            f"instances that reduction is synchronous, so finish_grad_sync does not see it and starts it again), "
            f"a wrong first update; add --no-align-grad-reduce, or drop --overlap-grad-reduce, or shard over all "
            f"dp x cp ranks (--num-distributed-optimizer-instances 1)"
        )
    if getattr(args, "qk_clip", False) and getattr(args, "use_megatron_fsdp", False):
        problems.append(
            "--qk-clip with --use-megatron-fsdp: megatron-core 0.19.2's clip_qk rescales each attention layer's "
            "weight and main_param as whole tensors, but megatron-fsdp keeps the weights and the fp32 main weights "
            "as shards of its own buffers, so the clip acts on tensors its next parameter update overwrites (on CPU "
            "ranks the max logit of the next step moved 300% away from CP = 1's); use the distributed optimizer "
            "(--use-distributed-optimizer, Hybrid ZeRO's 'optimizer' choice) with QK-clip, or only log the max "
            "(--log-max-attention-logit)"
        )
    clip, outer = getattr(args, "clip_grad", 1.0), getattr(args, "outer_dp_sharding_strategy", "no_shard")
    if getattr(args, "use_megatron_fsdp", False) and outer not in (None, "no_shard") and clip and clip > 0:
        problems.append(
            f"--clip-grad {clip} with --outer-dp-sharding-strategy {outer} (Hybrid ZeRO's optimizer states sharded "
            f"wider than its parameters and gradients, optimizer_shard_size > shard_size): megatron-core 0.19.2 "
            f"computes the gradient norm over one optimizer instance only (--num-distributed-optimizer-instances "
            f"{getattr(args, 'num_distributed_optimizer_instances', 1)}), missing the other instances' gradient "
            f"shards, so clipping would scale by a wrong factor; add --clip-grad 0.0, or drop "
            f"--outer-dp-sharding-strategy (optimizer states sharded as the parameters)"
        )
    if getattr(args, "use_tp_pp_dp_mapping", False) and pp > 1 and cp > 1:
        problems.append(
            f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} and --context-parallel-size {cp}: "
            f"megatron-core 0.19.2's initialize_model_parallel builds the experts' rank grid without CP, so under "
            f"the tp-cp-ep-pp-dp order their data-parallel size (dp x {cp}) differs from the data-parallel size (dp) "
            f"and it asserts; drop --use-tp-pp-dp-mapping (Megatron's default tp-cp-ep-dp-pp order)"
        )
    return problems


UNEVEN_LOSS_MASK_FLAGS: tuple[tuple[str, str], ...] = (("--sft", "sft"), ("--eod-mask-loss", "eod_mask_loss"))
"""Flags whose loss masks zero tokens unevenly over the CP ranks, with their argparse destinations: --sft masks
prompts and padding, --eod-mask-loss the end-of-document tokens. tests/test_pretrain_loss_scaling.py measures which
launches train differently at CP = 2 than at CP = 1 without --calculate-per-token-loss: these, whatever the packing
(unpacked, --sft's per-document split, --dataloader-inter-document-masking's per-sequence split), except the
documents layout; plain pretraining and --dataloader-inter-document-masking alone (every loss mask all ones) do
not."""


def loss_scaling_problem(args) -> str | None:
    """Why this 2d launch would train differently at its CP size than at CP = 1, or None.

    Without --calculate-per-token-loss Megatron's schedule divides each CP rank's loss sum by that rank's own count
    of loss tokens and the gradient reduction averages the ranks: the gradient is the mean over tokens only when
    every CP rank holds as many loss tokens, which a loss mask that zeros tokens here and there
    (:data:`UNEVEN_LOSS_MASK_FLAGS`) breaks. The documents layout's loss (examples/pretrain_gpt_2d.py,
    :func:`.packed_data.token_weighted_loss`) weighs every token equally itself."""
    cp_size = getattr(args, "context_parallel_size", 1)
    if cp_size == 1 or getattr(args, "calculate_per_token_loss", False):
        return None
    if chosen_mode(args).token_weighted_loss:
        return None
    uneven = [flag for flag, dest in UNEVEN_LOSS_MASK_FLAGS if getattr(args, dest, False)]
    if not uneven:
        return None
    return (
        f"{' and '.join(uneven)} at --context-parallel-size {cp_size} (cp_comm_type "
        f"{layer_comm_types(args.cp_comm_type)}) needs --calculate-per-token-loss: without it Megatron divides each "
        f"CP rank's loss by that rank's own count of loss tokens, which {' and '.join(uneven)} make uneven over "
        f"the CP ranks, so the gradients would depend on the CP size (a different run than at CP = 1); add "
        f"--calculate-per-token-loss (or, for GPT, pack the documents with --cp-2d-packing documents through "
        f"examples/pretrain_gpt_2d.py, whose loss weighs every token equally)"
    )


READY_GPT_SPEC = "GPT_LAYER_SPEC_2D"


def ready_spec_pipeline_problem(args) -> str | None:
    """Why ``--spec megatron_2d.megatron.spec GPT_LAYER_SPEC_2D`` cannot run this launch's pipeline, or None.

    Megatron's builder calls spec functions (``gpt_layer_spec_2d``) on every rank, and they build the model's 2D
    groups there (:func:`.process_groups.build_model_groups`); a ready spec is not called, so the groups are built
    by the first 2d layer of each rank. A pipeline stage that holds no decoder or MTP layer in
    ``--pipeline-model-parallel-layout`` builds none and would leave the others waiting for it."""
    spec = getattr(args, "spec", None)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if not spec or spec[-1] != READY_GPT_SPEC or not str(spec[0]).startswith("megatron_2d") or layout is None:
        return None
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    if not isinstance(layout, PipelineParallelLayerLayout):
        layout = PipelineParallelLayerLayout(layout, args.pipeline_model_parallel_size)
    stages = layout.layout
    with_layers = (LayerType.decoder, LayerType.mtp)
    empty = [pp for pp, chunks in enumerate(stages) if not any(t in with_layers for chunk in chunks for t in chunk)]
    if not empty:
        return None
    return (
        f"--pipeline-model-parallel-layout {str(layout)!r} gives pipeline stages {empty} no decoder layer, and "
        f"--spec {' '.join(spec)} is a ready spec that Megatron does not call: those stages would never join "
        f"the collectives that build the 2D groups (a hang); use --spec megatron_2d.megatron.spec "
        f"gpt_layer_spec_2d, which builds them on every stage"
    )


def chosen_mode(config) -> type[PackingMode]:
    """The packing mode ``config.cp_2d_packing`` names (a :mod:`megatron_2d.packing.modes` class; the table's
    default when ``config`` has none)."""
    return mode_class(fields_2d(config).cp_2d_packing, "cp_2d_packing")


def packing_mode(config) -> str:
    """The layout THD batches come in (a :data:`megatron_2d.layout.choices.PACKING_MODES` name): the configured
    mode when only this library's data path builds its batches (documents: megatron_2d.megatron.packed_data);
    "sequence" when the launch makes Megatron split them per sequence (--dataloader-inter-document-masking without
    --sft: ``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``) or the config says so; else the
    configured one ("zigzag": Megatron's per-document split, --sft). ``config``: megatron.training's args (the launch
    itself), a TransformerConfig2D built from them (which carries the launch's flags, :class:`LaunchFields`) or any
    other TransformerConfig (the launch is the current one, if any: the stock scripts' ``--spec`` routes)."""
    chosen = chosen_mode(config)
    if is_dynamic(config) and chosen.megatron_split is not None:
        # hybrid CP: Megatron splits each sub-sample over its own group per sequence (get_batch_on_this_cp_rank's
        # hybrid branch); the documents layout is refused with hybrid CP
        return megatron_split_mode(MegatronSplit.PER_SEQUENCE).name
    if chosen.megatron_split is None:
        return chosen.name
    carried = getattr(config, "dataloader_inter_document_masking", None) is not None
    launch = config if carried else current_launch_args()
    if (
        launch is not None
        and getattr(launch, "dataloader_inter_document_masking", False)
        and not getattr(launch, "sft", False)
    ):
        return megatron_split_mode(MegatronSplit.PER_SEQUENCE).name
    return chosen.name


def megatron_split(config) -> str | None:
    """Which of Megatron's splits (:data:`megatron_2d.packing.modes.MEGATRON_SPLITS`) gives the THD batches of
    :func:`packing_mode`; None: this library's data path builds them."""
    return mode_class(packing_mode(config)).megatron_split


def check_hybrid_layers(config, layers: str, mamba_expand: int = MAMBA_EXPAND) -> None:
    """Refuse, with ValueError, hybrid ``layers`` (symbols, e.g. "M*-M*-") the CP group cannot run (``config``: a
    TransformerConfig, or megatron.training's args, which carry the same names):

    * Mamba / GDN heads that do not divide over TP x CP (their all-to-all spans the whole CP group, hp x cp);
    * Mamba / GDN layers on tokens in a packing mode that does not keep Megatron's per-document order
      (:meth:`megatron_2d.packing.modes.PackingMode.ssm_problem`): the documents layout keeps short documents whole
      on one rank, Megatron's per-sequence split cuts the stream regardless of documents (they would run on
      misordered tokens)."""
    present = sorted(set(layers) & SSM_SYMBOLS)
    if not present:
        return
    names = {MAMBA: "Mamba (M)", GDN: "GDN (G)"}
    if getattr(config, "context_parallel_size", 1) > 1:
        problem = mode_class(packing_mode(config)).ssm_problem(" and ".join(names[s] for s in present))
        if problem:
            raise ValueError(problem)
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    problems = []
    if MAMBA in present:
        heads = mamba_num_heads(config.hidden_size, config.mamba_head_dim, config.mamba_num_heads, mamba_expand)
        problems.append(mamba_cp_problem(heads, config.mamba_num_groups, tp, cp))
    if GDN in present:
        problems.append(gdn_cp_problem(config.linear_num_key_heads, config.linear_num_value_heads, tp, cp))
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("; ".join(problems))


def current_launch_args() -> object | None:
    """megatron.training's parsed arguments when a launch (pretrain_gpt.py) has set them, else None. megatron.training
    is not imported here: a library user who builds models directly has no launch to check. Read only where no
    explicit path hands the launch over (see the module docstring: the stock scripts' ``--spec`` routes)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except AssertionError:  # megatron's "args is not initialized"
        return None


def qk_clip_step_problem(args) -> str | None:
    """Why this launch's training loop would fail at its first QK-clip step, or None: the loop's ``clip_qk`` is
    megatron-core 0.19.2's own (the unpatched ``--spec`` route; the 2d entry routes give it
    :func:`megatron_2d.megatron.qk_clip.clip_qk`) and the launch is one that fails in it (see
    :mod:`megatron_2d.megatron.qk_clip`)."""
    clip, log = getattr(args, "qk_clip", False), getattr(args, "log_max_attention_logit", False)
    if not (clip or log) or not uses_2d(getattr(args, "cp_comm_type", None)):
        return None
    loop = sys.modules.get("megatron.training.training")
    from .qk_clip import clip_qk

    if loop is None or getattr(loop, "clip_qk", None) is clip_qk:
        return None
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    pattern = getattr(args, "hybrid_layer_pattern", None) or ""
    failing = []
    if not half:
        failing.append("an fp32 model (it reads model_chunk.module.module.decoder, which only Float16Module has)")
    if pattern and set(decoder_layers(pattern)) & SSM_SYMBOLS:
        failing.append("Mamba / GDN layers (it reads every decoder layer's self_attention)")
    if clip and getattr(args, "tensor_model_parallel_size", 1) > 1 and not getattr(args, "multi_latent_attention", 0):
        failing.append("GQA / MHA at --tensor-model-parallel-size > 1 (its view of linear_qkv's weight)")
    if clip and half and getattr(args, "use_distributed_optimizer", False):
        failing.append("the distributed optimizer in bf16 / fp16 (its flat main-param shards)")
    if not failing:
        return None
    return (
        f"{'--qk-clip' if clip else '--log-max-attention-logit'} with megatron-core 0.19.2's own clip step fails "
        f"after the first optimizer step for {'; '.join(failing)}; launch through the patched pretrain_gpt.py / "
        f"pretrain_hybrid.py or examples/pretrain_gpt_2d.py, whose training loop runs "
        f"megatron_2d.megatron.qk_clip.clip_qk (megatron_2d.megatron.arguments.use_clip_qk_2d(args))"
    )


def check_current_launch(config=None) -> None:
    """:func:`check_launch_args` on the current launch's arguments, if any, and :func:`qk_clip_step_problem`; nothing
    when the entry that built ``config`` (the model's) checked its launch already (:class:`LaunchFields`)."""
    if getattr(config, "launch_checked", False):
        return
    args = current_launch_args()
    if args is not None:
        check_launch_args(args)
        problem = qk_clip_step_problem(args)
        if problem:
            raise ValueError(problem)
