"""pretrain_gpt / pretrain_hybrid command-line flags for the 2d backend, and the model config built from them.

    --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 --cp-2d-ring-window 2
    --cp-2d-placement head_first --attention-dropout 0.0

Flag destinations equal TransformerConfig2D's field names, so megatron.training's
``core_transformer_config_from_args(args, config_class=TransformerConfig2D)`` copies them into the config. The
deprecated spelling --cp-2d-window-size lands in the config's deprecated field cp_2d_window_size, which the config
checks against cp_2d_ring_window (the one validation path).
"""

from __future__ import annotations

import argparse

from ..deprecation import RenamedFlag
from ..layout.choices import CHECKPOINT_KEEPS, DKV_COMM_DTYPES, MLA_RINGS, PACKING_MODES, RECOMPUTE_CHECKS
from ..layout.topology import PLACEMENTS
from .launch_checks import check_launch_args
from .settings import uses_2d

SPEC = ["megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
HYBRID_SPEC = ["megatron_2d.megatron.hybrid_spec", "hybrid_stack_spec_2d"]


def add_2d_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An ``extra_args_provider`` for megatron.training's parse_and_validate_args."""
    group = parser.add_argument_group(title="2D context parallelism (megatron_2d, --cp-comm-type 2d)")
    group.add_argument(
        "--cp-2d-head-parallel-size",
        type=int,
        default=None,
        help="hp: ranks per head group (all-to-all over heads); divides the context-parallel size "
        "and the attention heads per TP rank. K/V heads are replicated when hp exceeds them.",
    )
    group.add_argument(
        "--cp-2d-context-size",
        type=int,
        default=None,
        help="cp: ranks per context ring; optional, checked to equal context-parallel-size / hp.",
    )
    group.add_argument(
        "--cp-2d-ring-window",
        type=int,
        default=1,
        help="w: context ranks per inner ring (Double-Ring); cp / w windows form the outer ring.",
    )
    group.add_argument("--cp-2d-window-size", type=int, action=RenamedFlag, new_flag="--cp-2d-ring-window")
    group.add_argument(
        "--cp-2d-placement",
        choices=PLACEMENTS,
        default="head_first",
        help="head_first: head groups on adjacent ranks (all-to-all on NVLink); context_first: "
        "context rings on adjacent ranks (ring P2P on NVLink).",
    )
    group.add_argument(
        "--cp-2d-dkv-comm-dtype",
        choices=DKV_COMM_DTYPES,
        default="accumulator",
        help="dK/dV riders in backward: fp32 (accumulator, exact) or the activation dtype (input, "
        "Transformer Engine's bytes, slightly larger error as the ring grows).",
    )
    group.add_argument(
        "--cp-2d-packing",
        choices=PACKING_MODES,
        default="zigzag",
        help="packed documents (THD): zigzag = Megatron's per-document split (--sft batches); "
        "sequence = Megatron's per-sequence split (chosen by itself with "
        "--dataloader-inter-document-masking without --sft); documents = short documents whole "
        "on one context rank, long ones split (needs examples/pretrain_gpt_2d.py's data path, "
        "with --dataloader-inter-document-masking or --sft).",
    )
    group.add_argument(
        "--cp-2d-mla-ring",
        choices=MLA_RINGS,
        default="expanded",
        help="with --multi-latent-attention: what travels the context ring. expanded = per-head K/V "
        "(as every CP backend sends them); latent = the compressed KV and rope key, "
        "up-projected by each rank for its own heads at every ring step (fewer bytes, more "
        "FLOPs; python -m megatron_2d.plan compares both).",
    )
    group.add_argument(
        "--selective-checkpoint-plus-plus",
        action="store_true",
        help="Selective Checkpoint++: with --recompute-granularity full, keep attention outputs and "
        "log-sum-exp from the forward pass so the recompute pass skips attention.",
    )
    group.add_argument(
        "--selective-checkpoint-plus-plus-check",
        choices=RECOMPUTE_CHECKS,
        default="tolerance",
        help="how a recompute is compared with its first pass: within the dtype's rounding noise "
        "(tolerance), or bit for bit (bitwise, a debug mode).",
    )
    group.add_argument(
        "--selective-checkpoint-plus-plus-keep",
        choices=CHECKPOINT_KEEPS,
        default=CHECKPOINT_KEEPS[0],
        help="what Selective Checkpoint++ keeps of attention until the recompute: outputs = the attention "
        "output and its log-sum-exp (the recompute runs the head all-to-alls again, not the ring); "
        "attention-inputs = also the head-layout q and K/V (more memory; the recompute sends nothing).",
    )
    return parser


def transformer_config_from_args_2d(args: argparse.Namespace):
    """TransformerConfig2D (MLATransformerConfig2D with --multi-latent-attention) from parsed args (validated on
    construction)."""
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args

    from .config import Fields2D, MLATransformerConfig2D, TransformerConfig2D

    config = core_transformer_config_from_args(args, config_class=TransformerConfig2D)
    if isinstance(config, TransformerConfig2D) or not getattr(args, "multi_latent_attention", False):
        return config
    # megatron.training builds its own MLATransformerConfig for --multi-latent-attention whatever class it is
    # given: rebuild it with the 2D fields (from the same args)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(Fields2D) if hasattr(args, f.name)})
    return MLATransformerConfig2D(**values)


def _model_config_from_args_2d(args: argparse.Namespace, default_spec, model_config_from_args):
    """Megatron's ``*_config_from_args`` with TransformerConfig2D, after the launch checks; ``default_spec`` when
    "2d" is selected and no --spec was given."""
    check_launch_args(args)
    if uses_2d(args.cp_comm_type) and args.spec is None:
        args.spec = list(default_spec)
    return model_config_from_args(args, config=transformer_config_from_args_2d(args))


def gpt_config_from_args_2d(args: argparse.Namespace):
    """pretrain's GPT model config with TransformerConfig2D; the 2d layer spec when "2d" is selected and no
    --spec was given. Refuses what the 2d backend does not support (:mod:`.launch_checks`) first."""
    from megatron.training.argument_utils import gpt_config_from_args

    return _model_config_from_args_2d(args, SPEC, gpt_config_from_args)


def hybrid_config_from_args_2d(args: argparse.Namespace):
    """pretrain_hybrid's HybridModel config with TransformerConfig2D; the 2d hybrid stack spec when "2d" is selected
    and no --spec was given. Refuses what the 2d backend does not support (:mod:`.launch_checks`: the hybrid pattern's
    Mamba / GDN layers against the CP group included) first."""
    from megatron.training.argument_utils import hybrid_config_from_args

    return _model_config_from_args_2d(args, HYBRID_SPEC, hybrid_config_from_args)
