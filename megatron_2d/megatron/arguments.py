"""pretrain_gpt / pretrain_hybrid command-line flags for the 2d backend, and the model config built from them.

    --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 --cp-2d-inner-ring-size 2
    --cp-2d-placement head_first --attention-dropout 0.0

The flags are the settings of the one table, :class:`.fields.Fields2D` (names, types, choices, defaults and help
from there); their destinations equal TransformerConfig2D's field names, so megatron.training's
``core_transformer_config_from_args(args, config_class=TransformerConfig2D)`` copies them into the config.
"""

from __future__ import annotations

import argparse

from .fields import flag, flag_options, table
from .launch_checks import check_launch_args
from .settings import uses_2d

SPEC = ["megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
HYBRID_SPEC = ["megatron_2d.megatron.hybrid_spec", "hybrid_stack_spec_2d"]


def add_2d_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An ``extra_args_provider`` for megatron.training's parse_and_validate_args: one flag per setting of the
    table (:mod:`.fields`), its destination the setting's name."""
    group = parser.add_argument_group(title="2D context parallelism (megatron_2d, --cp-comm-type 2d)")
    for f, _ in table():
        group.add_argument(flag(f.name), **flag_options(f))
    return parser


def transformer_config_from_args_2d(args: argparse.Namespace):
    """TransformerConfig2D (MLATransformerConfig2D with --multi-latent-attention) from parsed args (validated on
    construction)."""
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args

    from .config import MLATransformerConfig2D, TransformerConfig2D

    config = core_transformer_config_from_args(args, config_class=TransformerConfig2D)
    if isinstance(config, TransformerConfig2D) or not getattr(args, "multi_latent_attention", False):
        return config
    # megatron.training builds its own MLATransformerConfig for --multi-latent-attention whatever class it is
    # given: rebuild it with the 2D fields (from the same args)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.update({f.name: getattr(args, f.name) for f, _ in table() if hasattr(args, f.name)})
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
