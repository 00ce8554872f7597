"""pretrain_gpt / pretrain_hybrid command-line flags for the 2d backend, and the model config built from them.

    --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 --cp-2d-inner-ring-size 2
    --cp-2d-placement head_first --attention-dropout 0.0

The flags are the settings of the one table, :class:`.fields.Fields2D` (names, types, choices, defaults and help
from there); their destinations equal TransformerConfig2D's field names, so megatron.training's
``core_transformer_config_from_args(args, config_class=TransformerConfig2D)`` copies them into the config.

QK-clip (``--qk-clip``, ``--log-max-attention-logit``): Megatron-LM's validate_args demands Transformer Engine 2.9 or
later for them (TEDotProductAttention's ``return_max_logit``), which a launch whose every CP layer runs the 2d backend
does not use: :func:`parse_and_validate_args_2d` leaves that one check out there (and makes Megatron's others:
0 < alpha < 1, threshold > 0), and :func:`use_clip_qk_2d` gives the training loop the clip step that reaches fp32
models, TP > 1, hybrid stacks and the distributed optimizer's shards (:mod:`.qk_clip`). The patched pretrain_gpt.py /
pretrain_hybrid.py and examples/pretrain_gpt_2d.py call both.
"""

from __future__ import annotations

import argparse

from .fields import flag, flag_options, table
from .launch_checks import LaunchFields, check_launch_args, qk_clip_step_problem
from .settings import BACKEND_NAME, layer_comm_types, uses_2d

SPEC = ["megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
HYBRID_SPEC = ["megatron_2d.megatron.hybrid_spec", "hybrid_stack_spec_2d"]


def add_2d_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An ``extra_args_provider`` for megatron.training's parse_and_validate_args: one flag per setting of the
    table (:mod:`.fields`), its destination the setting's name."""
    group = parser.add_argument_group(title="2D context parallelism (megatron_2d, --cp-comm-type 2d)")
    for f, _ in table():
        group.add_argument(flag(f.name), **flag_options(f))
    return parser


QK_CLIP_FLAGS = (("--qk-clip", "qk_clip"), ("--log-max-attention-logit", "log_max_attention_logit"))
"""The flags of the max attention logit, with their argparse destinations."""


def only_2d_layers(cp_comm_type) -> bool:
    """Whether every CP layer runs the 2d backend (none delegates to Transformer Engine's CP attention)."""
    return all(kind == BACKEND_NAME for kind in layer_comm_types(cp_comm_type))


def check_qk_clip_args(args) -> None:
    """Megatron-LM's checks of --qk-clip other than the Transformer Engine version (training/arguments.py)."""
    if getattr(args, "qk_clip", False):
        if not 0.0 < args.qk_clip_alpha < 1.0:
            raise ValueError(f"--qk-clip-alpha {args.qk_clip_alpha} must be between 0.0 and 1.0 when using --qk-clip")
        if not args.qk_clip_threshold > 0:
            raise ValueError(f"--qk-clip-threshold {args.qk_clip_threshold} must be greater than 0 with --qk-clip")


def parse_and_validate_args_2d(**kwargs) -> argparse.Namespace:
    """megatron.training's ``parse_and_validate_args(**kwargs)``, except that a launch whose every CP layer runs the
    2d backend does not need Transformer Engine 2.9 for --qk-clip / --log-max-attention-logit (the 2d op computes the
    max logit itself; Megatron's other QK-clip checks still apply, :func:`check_qk_clip_args`). Layers that run TE's
    CP attention keep Megatron's check whole."""
    from megatron.training import arguments

    validate = arguments.validate_args

    def validate_2d(args, defaults={}):  # noqa: B006  (megatron's own signature)
        deferred = {}
        if only_2d_layers(getattr(args, "cp_comm_type", None)) and not arguments.is_te_min_version("2.9.0"):
            deferred = {dest: True for _, dest in QK_CLIP_FLAGS if getattr(args, dest, False)}
        for dest in deferred:
            setattr(args, dest, False)  # what Megatron's validation reads of them is its TE check alone
        try:
            return validate(args, defaults)
        finally:
            for dest in deferred:
                setattr(args, dest, True)
            if deferred:
                check_qk_clip_args(args)

    arguments.validate_args = validate_2d
    try:
        return arguments.parse_and_validate_args(**kwargs)
    finally:
        arguments.validate_args = validate


def use_clip_qk_2d(args: argparse.Namespace) -> None:
    """Make :func:`megatron_2d.megatron.qk_clip.clip_qk` the clip step of megatron.training's loop (its
    ``training.clip_qk``, called after every optimizer step) when this launch runs the 2d backend with --qk-clip or
    --log-max-attention-logit; megatron-core 0.19.2's own fails on fp32 models, GQA at TP > 1, hybrid stacks with
    Mamba / GDN layers and the distributed optimizer's shards (see :mod:`.qk_clip`)."""
    if not uses_2d(getattr(args, "cp_comm_type", None)):
        return
    if not any(getattr(args, dest, False) for _, dest in QK_CLIP_FLAGS):
        return
    from megatron.training import training

    from .qk_clip import clip_qk

    training.clip_qk = clip_qk


def transformer_config_from_args_2d(args: argparse.Namespace):
    """TransformerConfig2D (MLATransformerConfig2D with --multi-latent-attention) from parsed args (validated on
    construction), carrying the launch's packing flags (:class:`.launch_checks.LaunchFields`)."""
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args

    from .config import MLATransformerConfig2D, TransformerConfig2D

    config = core_transformer_config_from_args(args, config_class=TransformerConfig2D)
    if isinstance(config, TransformerConfig2D) or not getattr(args, "multi_latent_attention", False):
        return config
    # megatron.training builds its own MLATransformerConfig for --multi-latent-attention whatever class it is
    # given: rebuild it with the 2D fields (from the same args)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    given = [f for f, _ in table()] + list(dataclasses.fields(LaunchFields))
    values.update({f.name: getattr(args, f.name) for f in given if hasattr(args, f.name)})
    return MLATransformerConfig2D(**values)


def _model_config_from_args_2d(args: argparse.Namespace, default_spec, model_config_from_args):
    """Megatron's ``*_config_from_args`` with TransformerConfig2D, after the launch checks (which the config then
    says it had, so that its layers do not read the launch again, :class:`.launch_checks.LaunchFields`, unless the
    loop's clip step does not fit the launch: the layers refuse it, as on the ``--spec`` route); ``default_spec``
    when "2d" is selected and no --spec was given."""
    check_launch_args(args)
    if uses_2d(args.cp_comm_type) and args.spec is None:
        args.spec = list(default_spec)
    config = transformer_config_from_args_2d(args)
    config.launch_checked = qk_clip_step_problem(args) is None
    return model_config_from_args(args, config=config)


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
