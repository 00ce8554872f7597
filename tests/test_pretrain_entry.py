"""The pretrain_gpt flags: `--cp-comm-type 2d` and the 2D flags reach a validated TransformerConfig2D and the 2d
layer spec; misconfigured command lines stop with a clear error before any model is built."""

from __future__ import annotations

import pathlib
import re
import sys

import megatron.training.arguments as megatron_arguments  # noqa: E402
import pytest
import torch

from megatron_2d.megatron import TransformerConfig2D  # noqa: E402
from megatron_2d.megatron.arguments import add_2d_arguments, gpt_config_from_args_2d, transformer_config_from_args_2d  # noqa: E402
from megatron_2d.megatron.spec import gpt_layer_spec_2d  # noqa: E402
from megatron_2d_dev.pretrain_runs import argument_docstrings_read_once

pytestmark = pytest.mark.megatron

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-4",
    "--train-iters",
    "10",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--position-embedding-type",
    "rope",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",  # fusions need CUDA/TE
    "--transformer-impl",
    "local",
]  # no Transformer Engine here


@pytest.fixture(scope="module", autouse=True)
def _argument_docstrings_read_once():
    """Megatron's parser reads its help texts from source at every build (0.1 s of CPU a parse): read once for the
    module's ~90 parses (megatron_2d_dev.pretrain_runs.argument_docstrings_read_once); nothing asserted reads them."""
    with argument_docstrings_read_once():
        yield


@pytest.fixture
def parse(monkeypatch):
    """parse_and_validate_args on a simulated 8-rank job (validate_args asks the CUDA arch: answer Hopper)."""
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as the launch scripts set it

    def run(*flags, model=MODEL):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt_2d.py", *model, *flags])
        return megatron_arguments.parse_and_validate_args(extra_args_provider=add_2d_arguments)

    yield run
    from megatron.training.global_vars import unset_global_variables

    unset_global_variables()  # parse_and_validate_args keeps the args in megatron.training's globals


def test_2d_flags_build_the_2d_config_and_spec(parse):
    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--cp-2d-inner-ring-size",
        "2",
        "--cp-2d-placement",
        "context_first",
        "--attention-dropout",
        "0",
    )
    config = gpt_config_from_args_2d(args)
    t = config.transformer
    assert isinstance(t, TransformerConfig2D)
    assert (
        t.cp_comm_type,
        t.context_parallel_size,
        t.cp_2d_head_parallel_size,
        t.cp_2d_inner_ring_size,
        t.cp_2d_placement,
    ) == ("2d", 8, 2, 2, "context_first")
    assert args.spec == ["megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
    spec = config.transformer_layer_spec(t)
    assert spec.submodules.self_attention.submodules.core_attention.module.__name__ == "CoreAttention2D"


@pytest.mark.parametrize("old", ["--cp-2d-window-size", "--cp-2d-ring" + "-window"])  # split: a rename leaves it
def test_the_old_spellings_of_the_inner_ring_size_stop_at_parse(parse, capsys, old):
    """The earlier names of --cp-2d-inner-ring-size (before 0.1.0 was released) are no flags, kept as no aliases: the
    command line stops at parse, naming the flag, rather than running with the default inner ring size."""
    with pytest.raises(SystemExit):
        parse("--context-parallel-size", "8", "--cp-comm-type", "2d", old, "2")
    assert f"unrecognized arguments: {old} 2" in capsys.readouterr().err


MHA_MODEL = MODEL[: MODEL.index("--group-query-attention")] + MODEL[MODEL.index("--num-query-groups") + 2 :]
MLA = [
    "--multi-latent-attention",
    "--q-lora-rank",
    "32",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "12",
    "--rope-type",
    "rope",
]


@pytest.mark.parametrize("ring", ["expanded", "latent"])
def test_mla_flags_build_the_mla_2d_config_and_spec(parse, ring):
    from megatron_2d.megatron import MLATransformerConfig2D

    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--cp-2d-inner-ring-size",
        "2",
        "--attention-dropout",
        "0",
        "--cp-2d-mla-ring",
        ring,
        *MLA,
        model=MHA_MODEL,
    )
    config = gpt_config_from_args_2d(args)
    t = config.transformer
    assert isinstance(t, MLATransformerConfig2D)
    assert (
        t.cp_2d_head_parallel_size,
        t.cp_2d_inner_ring_size,
        t.cp_2d_mla_ring,
        t.kv_lora_rank,
        t.v_head_dim,
        t.qk_head_dim,
        t.rope_type,
    ) == (2, 2, ring, 16, 12, 16, "rope")
    attention = config.transformer_layer_spec(t).submodules.self_attention
    assert attention.submodules.core_attention.module.__name__ == "CoreAttention2D"
    assert attention.module.__name__ == ("MLASelfAttention2D" if ring == "latent" else "MLASelfAttention")


def test_checkpoint_plus_plus_flag_reaches_the_config(parse):
    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--selective-checkpoint-plus-plus",
    )
    assert gpt_config_from_args_2d(args).transformer.selective_checkpoint_plus_plus is True


def test_kernel_flag_reaches_every_2d_layer(parse):
    """--cp-2d-kernel lands in the config's cp_2d_kernel, which each CoreAttention2D runs (its spec names none)."""
    from megatron_2d.megatron.core_attention import CoreAttention2D

    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        "--cp-2d-kernel",
        "torch_cudnn",
    )
    config = gpt_config_from_args_2d(args)
    assert config.transformer.cp_2d_kernel == "torch_cudnn"
    core = config.transformer_layer_spec(config.transformer).submodules.self_attention.submodules.core_attention
    assert core.module is CoreAttention2D and core.params.get("kernel") is None  # the config's field is read


def test_kernel_flag_without_2d_is_refused(parse):
    args = parse("--context-parallel-size", "8", "--cp-comm-type", "p2p", "--cp-2d-kernel", "te_fused")
    with pytest.raises(ValueError, match=r"2D settings \{'cp_2d_kernel': 'te_fused'\} are set but cp_comm_type"):
        gpt_config_from_args_2d(args)


def test_unknown_kernel_is_refused_by_the_parser(parse, capsys):
    with pytest.raises(SystemExit):
        parse("--context-parallel-size", "8", "--cp-comm-type", "2d", "--cp-2d-kernel", "flash_attn3")
    assert "invalid choice: 'flash_attn3'" in capsys.readouterr().err


def test_checkpoint_plus_plus_without_recompute_is_refused(parse):
    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        "--selective-checkpoint-plus-plus",
    )
    with pytest.raises(ValueError, match=r"recompute_granularity is None; set recompute_granularity='full'"):
        gpt_config_from_args_2d(args)


def test_stock_flags_alone_select_hp_through_hierarchical_sizes(parse):
    from megatron_2d.megatron.settings import settings_from_config

    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--hierarchical-context-parallel-sizes",
        "4",
        "2",
        "--attention-dropout",
        "0",
    )
    settings = settings_from_config(gpt_config_from_args_2d(args).transformer)
    assert (settings.head_parallel_size, settings.context_size, settings.placement) == (4, 2, "head_first")


def test_without_2d_the_entry_is_stock(parse):
    args = parse("--context-parallel-size", "8", "--cp-comm-type", "p2p")
    config = gpt_config_from_args_2d(args)
    assert args.spec is None and config.transformer.cp_comm_type == "p2p"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--cp-2d-head-parallel-size", "2", "--cp-2d-context-size", "3"],
            r"2 x 3 = 6 does not equal context_parallel_size 8",
        ),
        (["--cp-2d-head-parallel-size", "16"], r"head-parallel size 16 does not divide the context-parallel size 8"),
        (
            ["--cp-2d-head-parallel-size", "2", "--cp-2d-inner-ring-size", "3"],
            r"inner ring size 3 does not divide the context size",
        ),
        (
            ["--cp-2d-head-parallel-size", "2", "--attention-dropout", "0.1"],
            r"attention_dropout=0.1: attention dropout is not supported",
        ),
    ],
)
def test_misconfigured_command_lines(parse, flags, message):
    flags = ["--context-parallel-size", "8", "--cp-comm-type", "2d", *flags]
    if "--attention-dropout" not in flags:
        flags += ["--attention-dropout", "0"]
    args = parse(*flags)
    with pytest.raises(ValueError, match=message):
        gpt_config_from_args_2d(args)


def test_bad_placement_is_refused_by_the_parser(parse, capsys):
    with pytest.raises(SystemExit):
        parse("--context-parallel-size", "8", "--cp-comm-type", "2d", "--cp-2d-placement", "interleaved")
    assert "invalid choice: 'interleaved' (choose from 'head_first', 'context_first')" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--reset-attention-mask"])
def test_document_masks_outside_thd_are_refused_by_the_library(parse, flag):
    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        flag,
    )
    with pytest.raises(ValueError, match=rf"{flag} gives document masks the 2d backend"):
        gpt_config_from_args_2d(args)
    with pytest.raises(ValueError, match=rf"{flag} gives document masks the 2d backend"):
        gpt_layer_spec_2d(transformer_config_from_args_2d(args))  # the --spec route


@pytest.mark.parametrize(
    "flags, mode",
    [
        (["--sft", "--calculate-per-token-loss"], "zigzag"),
        (["--sft", "--dataloader-inter-document-masking", "--calculate-per-token-loss"], "zigzag"),
        (["--dataloader-inter-document-masking"], "sequence"),
    ],
)
def test_thd_packed_documents_are_accepted(parse, flags, mode):
    """--sft batches are THD with Megatron's per-document zigzag split; --dataloader-inter-document-masking alone
    splits per sequence (the "sequence" layout, whose spec's self attention puts RoPE at document positions)."""
    from megatron_2d.megatron.launch_checks import packing_mode
    from megatron_2d.megatron.per_sequence import SelfAttention2D

    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        *flags,
    )
    gpt_config_from_args_2d(args)
    config = transformer_config_from_args_2d(args)
    assert packing_mode(config) == mode  # from the launch's arguments (parse keeps them)
    spec = gpt_layer_spec_2d(config)
    assert (spec.submodules.self_attention.module is SelfAttention2D) == (mode == "sequence")


TWO_D = ["--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "2", "--attention-dropout", "0"]


@pytest.mark.parametrize(
    "flags, uneven",
    [
        ([], None),
        (["--dataloader-inter-document-masking"], None),
        (["--eod-mask-loss"], "--eod-mask-loss"),
        (["--dataloader-inter-document-masking", "--eod-mask-loss"], "--eod-mask-loss"),
        (["--sft"], "--sft"),
        (["--sft", "--eod-mask-loss"], "--sft and --eod-mask-loss"),
        (["--sft", "--calculate-per-token-loss"], None),
        (["--eod-mask-loss", "--calculate-per-token-loss"], None),
        (["--dataloader-inter-document-masking", "--eod-mask-loss", "--cp-2d-packing", "documents"], None),
    ],
)
def test_loss_normalised_per_cp_rank_over_uneven_loss_masks_is_refused(parse, flags, uneven):
    """Exactly the launches tests/test_pretrain_loss_scaling.py measures training differently at CP > 1 than at
    CP = 1: loss masks that zero tokens unevenly over the CP ranks (--sft, --eod-mask-loss) without
    --calculate-per-token-loss, outside the documents layout (whose loss weighs every token itself)."""
    args = parse("--context-parallel-size", "8", *TWO_D, *flags)
    if uneven is None:
        gpt_config_from_args_2d(args)
        return
    message = (
        f"{uneven} at --context-parallel-size 8 (cp_comm_type ['2d']) needs --calculate-per-token-loss: without "
        f"it Megatron divides each CP rank's loss by that rank's own count of loss tokens, which {uneven} make "
        f"uneven over the CP ranks, so the gradients would depend on the CP size"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        gpt_config_from_args_2d(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        gpt_layer_spec_2d(transformer_config_from_args_2d(args))  # the --spec route


@pytest.mark.parametrize(
    "flags",
    [
        ["--context-parallel-size", "1", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1", "--sft"],
        ["--context-parallel-size", "8", "--cp-comm-type", "p2p", "--sft"],  # not the 2d backend
    ],
)
def test_uneven_loss_masks_are_left_alone_without_2d_cp(parse, flags):
    """At CP = 1 nothing depends on the CP size; without the 2d backend the launch is stock Megatron's."""
    gpt_config_from_args_2d(parse(*flags, "--attention-dropout", "0"))


READY_SPEC = ["--spec", "megatron_2d.megatron.spec", "GPT_LAYER_SPEC_2D"]


@pytest.mark.parametrize(
    "layout, spec, refused",
    [
        ("Ett|L", READY_SPEC, True),  # stage 1 holds no decoder layer and the ready spec is never called there
        ("Et|tL", READY_SPEC, False),  # every stage holds a layer: each builds the groups at its first one
        ("Ett|L", ["--spec", "megatron_2d.megatron.spec", "gpt_layer_spec_2d"], False),  # called on every stage
    ],
)
def test_ready_gpt_spec_under_a_pipeline_layout_with_an_empty_stage_is_refused(parse, layout, spec, refused):
    pp = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", layout]
    args = parse("--context-parallel-size", "4", *TWO_D, *pp, *spec)
    if not refused:
        gpt_config_from_args_2d(args)
        return
    with pytest.raises(ValueError, match=r"gives pipeline stages \[1\] no decoder layer, and --spec megatron_2d"):
        gpt_config_from_args_2d(args)


def test_sequence_packing_with_sft_is_refused(parse):
    args = parse(
        "--context-parallel-size",
        "8",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        "--sft",
        "--cp-2d-packing",
        "sequence",
    )
    with pytest.raises(ValueError, match="--sft batches are split per document"):
        gpt_config_from_args_2d(args)


def launch_flags(mode, tp=1):
    """The flags examples/launch/torchrun_gpt.sh passes for MODE and TP (sourced from gpt_flags.sh)."""
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "launch" / "gpt_flags.sh"
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{script}" && printf "%s\\n" "${{MODEL_FLAGS[@]}}" '
            f'"${{TRAIN_FLAGS[@]}}" "${{PARALLEL_FLAGS[@]}}" "${{CP_FLAGS[@]}}"',
        ],
        env={"MODE": mode, "CP": "8", "HP": "2", "WINDOW": "2", "TP": str(tp), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split("\n")[:-1]


@pytest.mark.parametrize("mode, comm_type", [("2d", "2d"), ("p2p", "p2p"), ("a2a", "a2a"), ("a2a+p2p", "a2a+p2p")])
def test_launch_script_flags_build_a_valid_config(monkeypatch, mode, comm_type):
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    for key, value in (("WORLD_SIZE", "8"), ("RANK", "0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        monkeypatch.setenv(key, value)
    cpu_only = [
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
    ]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_2d.py", *launch_flags(mode), *cpu_only])
    try:
        args = megatron_arguments.parse_and_validate_args(extra_args_provider=add_2d_arguments)
        t = gpt_config_from_args_2d(args).transformer
    finally:
        from megatron.training.global_vars import unset_global_variables

        unset_global_variables()
    assert t.cp_comm_type == comm_type and t.context_parallel_size == 8 and t.num_query_groups == 8
    assert (t.cp_2d_head_parallel_size, t.cp_2d_inner_ring_size) == ((2, 2) if mode == "2d" else (None, None))


# ---- QK-clip: Megatron's Transformer Engine check, the clip step, what cannot run ------------------------------------
QK_CLIP_2D = [
    *("--context-parallel-size", "8", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "2"),
    *("--attention-dropout", "0"),
]


@pytest.fixture
def parse_2d(parse, monkeypatch):
    """parse_and_validate_args_2d on the same simulated job as ``parse`` (each call a launch of its own)."""
    from megatron.training.global_vars import unset_global_variables

    from megatron_2d.megatron.arguments import parse_and_validate_args_2d

    def run(*flags, model=MODEL):
        unset_global_variables()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model, *flags])
        return parse_and_validate_args_2d(extra_args_provider=add_2d_arguments)

    return run


@pytest.mark.parametrize("flag", ["--qk-clip", "--log-max-attention-logit"])
def test_qk_clip_needs_no_transformer_engine_under_2d(parse, parse_2d, flag):
    """Megatron's validate_args asserts TE >= 2.9 for --qk-clip / --log-max-attention-logit (there is none here);
    the 2d entry leaves that check out when every CP layer is 2d, the flag reaches the config, and Megatron's own
    validation is restored afterwards."""
    with pytest.raises(AssertionError, match="only supported with TE >= 2.9.0"):
        parse(*QK_CLIP_2D, flag)
    args = parse_2d(*QK_CLIP_2D, flag, "--qk-clip-threshold", "50")
    dest = flag.removeprefix("--").replace("-", "_")
    assert getattr(args, dest) is True and megatron_arguments.validate_args.__name__ == "validate_args"
    assert getattr(gpt_config_from_args_2d(args).transformer, dest) is True


def test_qk_clip_checks_megatron_makes_still_apply_under_2d(parse_2d):
    with pytest.raises(ValueError, match=r"--qk-clip-alpha 1.5 must be between 0.0 and 1.0"):
        parse_2d(*QK_CLIP_2D, "--qk-clip", "--qk-clip-alpha", "1.5")
    with pytest.raises(ValueError, match=r"--qk-clip-threshold -1.0 must be greater than 0"):
        parse_2d(*QK_CLIP_2D, "--qk-clip", "--qk-clip-threshold", "-1")


def test_layers_on_transformer_engine_keep_megatrons_qk_clip_check(parse_2d):
    """A per-layer cp_comm_type list with Transformer Engine layers needs TE's return_max_logit: Megatron's check."""
    flags = ["--context-parallel-size", "8", "--cp-comm-type", "2d", "p2p", "--cp-2d-head-parallel-size", "2"]
    with pytest.raises(AssertionError, match="only supported with TE >= 2.9.0"):
        parse_2d(*flags, "--qk-clip", "--attention-dropout", "0")


def test_the_2d_entry_gives_the_training_loop_its_clip_step(parse_2d, monkeypatch):
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk
    from megatron.training import training

    from megatron_2d.megatron import qk_clip
    from megatron_2d.megatron.arguments import use_clip_qk_2d

    monkeypatch.setattr(training, "clip_qk", megatron_clip_qk)
    use_clip_qk_2d(parse_2d("--context-parallel-size", "8"))  # no 2d layer: Megatron's own
    assert training.clip_qk is megatron_clip_qk
    use_clip_qk_2d(parse_2d(*QK_CLIP_2D))  # no QK-clip
    assert training.clip_qk is megatron_clip_qk
    use_clip_qk_2d(parse_2d(*QK_CLIP_2D, "--log-max-attention-logit"))
    assert training.clip_qk is qk_clip.clip_qk


def test_qk_clip_with_megatron_fsdp_is_refused(parse_2d, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")  # megatron-fsdp asserts on 1
    args = parse_2d(*QK_CLIP_2D, "--qk-clip", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")
    with pytest.raises(ValueError, match=r"--qk-clip with --use-megatron-fsdp: megatron-core 0.19.2's clip_qk"):
        gpt_config_from_args_2d(args)


def test_the_spec_route_with_megatrons_own_clip_step_is_refused_where_it_fails(monkeypatch):
    """The unpatched --spec route keeps megatron-core's clip step: a launch it fails on is refused at model
    construction (check_current_launch), naming what fails and the routes that work; with the 2d clip step none."""
    import argparse

    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk
    from megatron.training import training

    from megatron_2d.megatron import qk_clip
    from megatron_2d.megatron.launch_checks import qk_clip_step_problem

    monkeypatch.setattr(training, "clip_qk", megatron_clip_qk)

    def launch(**flags):
        base = dict(cp_comm_type="2d", qk_clip=True, log_max_attention_logit=False, bf16=True, fp16=False)
        base.update(tensor_model_parallel_size=1, multi_latent_attention=False, use_distributed_optimizer=False)
        return argparse.Namespace(**{**base, **flags})

    assert qk_clip_step_problem(launch()) is None  # bf16, TP 1, DDP: megatron-core's runs
    assert "an fp32 model" in qk_clip_step_problem(launch(bf16=False))
    assert "GQA / MHA at --tensor-model-parallel-size > 1" in qk_clip_step_problem(launch(tensor_model_parallel_size=2))
    assert qk_clip_step_problem(launch(tensor_model_parallel_size=2, multi_latent_attention=True)) is None
    assert "flat main-param shards" in qk_clip_step_problem(launch(use_distributed_optimizer=True))
    assert "Mamba / GDN layers" in qk_clip_step_problem(launch(hybrid_layer_pattern="M*-"))
    logging_only = launch(qk_clip=False, log_max_attention_logit=True, tensor_model_parallel_size=2)
    assert qk_clip_step_problem(logging_only) is None  # no clip: the view of linear_qkv is not reached
    assert "--log-max-attention-logit with megatron-core" in qk_clip_step_problem(
        launch(qk_clip=False, log_max_attention_logit=True, bf16=False)
    )
    assert qk_clip_step_problem(launch(cp_comm_type="p2p", bf16=False)) is None  # not a 2d launch
    monkeypatch.setattr(training, "clip_qk", qk_clip.clip_qk)
    assert qk_clip_step_problem(launch(bf16=False, use_distributed_optimizer=True)) is None


def test_launch_script_turns_sequence_parallelism_on_with_tp(monkeypatch):
    """With TP > 1 the launch flags add --sequence-parallel, as Megatron-Bridge's and NeMo's recipes do, and the
    config takes it (TP 2 x 2D CP 8 on 16 ranks); at TP 1 they do not."""
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    for key, value in (("WORLD_SIZE", "16"), ("RANK", "0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        monkeypatch.setenv(key, value)
    assert "--sequence-parallel" not in launch_flags("2d") and "--sequence-parallel" in launch_flags("2d", tp=2)
    cpu_only = ["--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_2d.py", *launch_flags("2d", tp=2), *cpu_only])
    try:
        args = megatron_arguments.parse_and_validate_args(extra_args_provider=add_2d_arguments)
        t = gpt_config_from_args_2d(args).transformer
    finally:
        from megatron.training.global_vars import unset_global_variables

        unset_global_variables()
    assert t.sequence_parallel and t.tensor_model_parallel_size == 2 and t.cp_2d_head_parallel_size == 2


# --- hybrid (dynamic) CP: the launch checks of megatron_2d.megatron.launch_checks.dynamic_launch_problems ----------

HYBRID = [
    *("--context-parallel-size 2 --cp-comm-type 2d --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 64").split(),
    *("--calculate-per-token-loss --rerun-mode disabled --attention-dropout 0 --eval-iters 0").split(),
]
HYBRID_MODEL = [f for f in MODEL if f != "--mock-data"] + ["--sft"]  # 8 ranks: DP 4 x CP 2


def test_hybrid_flags_build_the_config_with_per_size_layouts(parse):
    args = parse(*HYBRID, "--cp-2d-dynamic-layouts", "4=4x1,8=2x4/2", model=HYBRID_MODEL)
    t = gpt_config_from_args_2d(args).transformer
    assert (
        t.hybrid_context_parallel and t.cp_2d_dynamic_layouts == "4=4x1,8=2x4/2" and t.max_seqlen_per_dp_cp_rank == 64
    )
    spec = gpt_config_from_args_2d(args).transformer_layer_spec(t)
    assert spec.submodules.self_attention.module.__name__ == "SelfAttention2D"


@pytest.mark.parametrize(
    "flags, model, message",
    [
        ([], MODEL, "needs packed samples that say where each sequence ends (cu_seqlens)"),
        (["--dataloader-inter-document-masking"], MODEL, "split each sequence over the static CP group"),
        (["--rerun-mode", "validate_results"], HYBRID_MODEL, "add --rerun-mode disabled"),
        (["--eval-iters", "2", "--data-path", "x", "--split", "90,10,0"], HYBRID_MODEL, "add --eval-iters 0"),
        (["--eval-iters", "2", "--data-path", "x", "--split", "100,0,0"], HYBRID_MODEL, None),  # nothing to validate
        (["--max-seqlen-per-dp-cp-rank", "16"], HYBRID_MODEL, "raise --max-seqlen-per-dp-cp-rank to at least 32"),
        (["--cp-2d-head-parallel-size", "2"], HYBRID_MODEL, "describe one static 2D layout"),
        (["--cp-2d-packing", "documents"], HYBRID_MODEL, "no packed batch to lay out by documents"),
        (["--cp-2d-dynamic-layouts", "16=2"], HYBRID_MODEL, "group sizes [16], which this run has no groups of"),
        (["--cp-2d-dynamic-layouts", "8=8x1,4=4"], HYBRID_MODEL, None),  # valid: checked as not refused
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], HYBRID_MODEL, None),  # TP 2 + SP runs
        (["--num-experts", "4", "--expert-model-parallel-size", "2"], HYBRID_MODEL, "expert_model_parallel_size 2"),
        # MoE router statistics under hybrid CP (megatron_2d.megatron.dynamic.moe_router_problems)
        (["--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"], HYBRID_MODEL, "with the MoE aux_loss"),
        (
            ["--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"],
            HYBRID_MODEL,
            "with the MoE seq_aux_loss (--moe-router-load-balancing-type seq_aux_loss, --moe-aux-loss-coeff 0.001)",
        ),
        (
            [
                *("--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "global_aux_loss"),
                *("--moe-aux-loss-coeff", "0", "1e-2"),
            ],
            HYBRID_MODEL,
            "with the MoE global_aux_loss (--moe-aux-loss-coeff 0.01)",
        ),
        (
            ["--num-experts", "4", "--moe-router-load-balancing-type", "quantile_balancing"],
            HYBRID_MODEL,
            "with --moe-router-load-balancing-type quantile_balancing",
        ),
        (
            ["--num-experts", "4", "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
            HYBRID_MODEL,
            "with --moe-router-enable-expert-bias",
        ),
        (["--num-experts", "4", "--moe-z-loss-coeff", "1e-3"], HYBRID_MODEL, None),  # the z-loss runs
        (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], HYBRID_MODEL, None),  # per rank
        (["--num-experts", "4", "--moe-aux-loss-coeff", "0"], HYBRID_MODEL, None),  # plain top-k routing runs
        (["--moe-aux-loss-coeff", "1e-2"], HYBRID_MODEL, None),  # no MoE layer: nothing to refuse
        (["--cp-2d-dynamic-layouts", "2=2x2"], HYBRID_MODEL, "hp x cp = 2 x 2 = 4 is not the group size 2"),
        ([], HYBRID_MODEL, None),
    ],
)
def test_hybrid_launch_checks_name_the_flag(parse, flags, model, message):
    from megatron_2d.megatron.launch_checks import check_launch_args

    args = parse(*HYBRID, *flags, model=model)
    if message is None:
        check_launch_args(args)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        check_launch_args(args)


def test_hybrid_refusals_on_the_config_route():
    """TransformerConfig2D refuses, naming the setting, what hybrid CP cannot run (Python users never see the
    launch checks)."""
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        cp_comm_type="2d",
        hybrid_context_parallel=True,
        max_seqlen_per_dp_cp_rank=64,
        calculate_per_token_loss=True,
        apply_rope_fusion=False,
        attention_dropout=0.0,
    )
    assert TransformerConfig2D(**base, cp_2d_dynamic_layouts="4=4x1").cp_2d_dynamic_layouts == "4=4x1"
    for change, message in [
        (dict(max_seqlen_per_dp_cp_rank=None), "needs max_seqlen_per_dp_cp_rank"),
        (dict(calculate_per_token_loss=False), "needs calculate_per_token_loss"),
        (dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32), "pipeline_model_parallel_size 2"),
        (dict(context_parallel_size=2, cp_2d_inner_ring_size=2), "describe one static 2D layout"),
        (dict(cp_2d_dynamic_layouts="8=16"), "head-parallel size 16 does not divide"),
        (dict(cp_2d_dynamic_layouts="16=16"), "size 16: head-parallel size 16 does not divide the 8 attention heads"),
        (dict(hybrid_context_parallel=False, cp_2d_dynamic_layouts="4=2"), "set without hybrid_context_parallel"),
        (dict(num_moe_experts=4, expert_model_parallel_size=2), "with expert_model_parallel_size 2: megatron-core"),
        (dict(num_moe_experts=4, moe_aux_loss_coeff=1e-2), "with the MoE aux_loss"),
        (
            dict(
                num_moe_experts=4,
                moe_router_load_balancing_type=["seq_aux_loss", "aux_loss"],
                moe_aux_loss_coeff=[1e-3, 0.0],
            ),
            "with the MoE seq_aux_loss",
        ),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
            "with the MoE global_aux_loss",
        ),
        (
            dict(num_moe_experts=4, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
            "with --moe-router-enable-expert-bias",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            TransformerConfig2D(**{**base, **change})
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
    assert TransformerConfig2D(**base, **moe, moe_z_loss_coeff=1e-3).moe_z_loss_coeff == 1e-3  # the z-loss runs


def test_hybrid_refuses_rope_fusion_and_mla():
    """Checks megatron-core's own config validation reaches first here (no TE: no RoPE fusion; MLA's own refusal):
    asked of the one function every route calls."""
    from types import SimpleNamespace

    from megatron_2d.megatron.dynamic import dynamic_config_problems

    ok = dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64, calculate_per_token_loss=True)
    assert dynamic_config_problems(SimpleNamespace(**ok)) == []
    assert (
        dynamic_config_problems(SimpleNamespace(**{**ok, "hybrid_context_parallel": False, "apply_rope_fusion": True}))
        == []
    )
    for change, message in [
        (dict(apply_rope_fusion=True), "needs apply_rope_fusion=False (--no-rope-fusion)"),
        (dict(multi_latent_attention=True), "with multi-latent attention is refused by megatron-core 0.19.2"),
        (dict(use_megatron_fsdp=True), "with megatron-fsdp is refused"),
        (dict(hierarchical_context_parallel_sizes=[2, 2]), "give them with --cp-2d-dynamic-layouts"),
    ]:
        problems = dynamic_config_problems(SimpleNamespace(**{**ok, **change}))
        assert len(problems) == 1 and message in problems[0], problems


def test_the_entry_hands_the_launch_to_the_layers_on_the_config(parse, parse_2d, monkeypatch):
    """The patched entries build the config from the launch's arguments: it carries the launch's packing flags and
    says that the launch was checked (LaunchFields), so the spec and the layers read no global arguments; a launch
    whose loop keeps megatron-core's clip step where it fails leaves the layers to check (and refuse) it."""
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk
    from megatron.training import training

    from megatron_2d.megatron import launch_checks
    from megatron_2d.megatron.per_sequence import SelfAttention2D

    args = parse("--context-parallel-size", "8", *TWO_D, "--dataloader-inter-document-masking")
    config = gpt_config_from_args_2d(args).transformer
    assert (config.dataloader_inter_document_masking, config.sft, config.launch_checked) == (True, False, True)

    def no_read():
        raise AssertionError("megatron.training's global arguments were read")

    reader = launch_checks.current_launch_args
    monkeypatch.setattr(launch_checks, "current_launch_args", no_read)
    assert launch_checks.packing_mode(config) == "sequence"
    launch_checks.check_current_launch(config)
    assert gpt_layer_spec_2d(config).submodules.self_attention.module is SelfAttention2D
    monkeypatch.setattr(launch_checks, "current_launch_args", reader)

    monkeypatch.setattr(training, "clip_qk", megatron_clip_qk)
    qk_args = parse_2d(*QK_CLIP_2D, "--qk-clip")  # an fp32 model: megatron-core's clip step fails on it
    assert not gpt_config_from_args_2d(qk_args).transformer.launch_checked
