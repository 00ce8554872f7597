"""Megatron's training loop through pretrain_hybrid.py (Megatron-LM core_v0.19.0) on forked CPU ranks: a HybridModel
with Mamba and 2D attention layers ('M*-M*-') logs the same lm loss per iteration as CP=1, through the patched
script and through the unpatched one with --spec; its checkpoint resumes at another 2D layout and at CP=1; a
launch the CP group cannot run stops every rank with our message; --sft (packed conversations, THD) at CP=4 logs the
CP=1 losses.

The CP=1 reference is the unpatched script with Megatron's local hybrid spec (its own attention) on one rank. Mamba
kernels are the CPU stand-ins (megatron_2d_dev.hybrid_cpu, installed in the ranks by pretrain_cpu). Runs:
hidden 64, 8 heads / 2 KV heads, Mamba 8 heads of 16 in 2 groups, RoPE, seq 128, global batch 2, 4 iterations.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.megatron_lm import copy_scripts
from megatron_2d_dev.pretrain_runs import (
    assert_same_training,
    run_pretrain,
    run_pretrain_outcomes,
    trained,
)
from megatron_2d_dev.sft_data import PROMPT_FORMAT

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[1]
ITERATIONS = 4
RTOL = TOLERANCES[torch.float32].end_to_end


def make_flags(*env):
    """The flags of tools/pretrain_gpt_cpu.sh with ENTRY=hybrid (what `make pretrain-hybrid-cpu` runs)."""
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "pretrain_gpt_cpu.sh"), "--print-flags"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={"ENTRY": "hybrid", "PATH": "/usr/bin:/bin", **dict(env)},
    )
    return out.stdout.split("\n")[:-1]


CP1 = make_flags(("CP", "1"))
CP4 = make_flags()
BASE = CP4[: CP4.index("--context-parallel-size")]
SPEC_2D = ["--spec", "megatron_2d.megatron.hybrid_spec", "hybrid_stack_spec_2d"]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    paths = {
        "stock": copy_scripts(root / "stock", script="pretrain_hybrid.py"),
        "patched": copy_scripts(root / "patched", patched=True, script="pretrain_hybrid.py"),
    }
    folder = str(paths["stock"].parent)
    sys.path.insert(0, folder)
    importlib.import_module("pretrain_hybrid")  # forked ranks find its imports loaded
    yield paths
    sys.path.remove(folder)
    for name in ("pretrain_hybrid", "hybrid_builders", "model_provider"):
        sys.modules.pop(name, None)


def training(logs):
    """The lm loss and grad norm per iteration from the last rank's log (Megatron logs there), checked complete."""
    found = trained(logs[-1])
    assert sorted(found.losses) == list(range(1, ITERATIONS + 1)), f"missing iterations:\n{logs[-1][-3000:]}"
    return found


def assert_same(got, expected, iterations=range(1, ITERATIONS + 1)):
    assert_same_training(got, expected, RTOL, iterations)


@pytest.fixture(scope="module")
def reference(scripts):
    found = training(run_pretrain(1, scripts["stock"], CP1))
    assert found.losses[ITERATIONS] < found.losses[1]
    return found


def test_make_target_flags():
    assert "M*-M*-" in BASE and CP4[len(BASE) :] == [
        "--context-parallel-size",
        "4",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--cp-2d-inner-ring-size",
        "2",
        "--cp-2d-placement",
        "head_first",
    ]
    assert CP1 == BASE[:8] + ["--spec", "megatron_2d_dev.hybrid_cpu", "megatron_local_hybrid_stack_spec"] + BASE[8:]


@pytest.mark.distributed
def test_patched_pretrain_hybrid_2d_equals_cp1(scripts, reference):
    logs = run_pretrain(4, scripts["patched"], CP4)
    assert_same(training(logs), reference)


@pytest.mark.distributed
def test_unpatched_pretrain_hybrid_with_spec_equals_cp1(scripts, reference):
    flags = SPEC_2D + [
        "--context-parallel-size",
        "4",
        "--hierarchical-context-parallel-sizes",
        "2",
        "2",
        "--cp-comm-type",
        "2d",
    ]
    assert_same(training(run_pretrain(4, scripts["stock"], BASE + flags)), reference)


@pytest.mark.distributed
def test_checkpoint_saved_at_cp4_resumes_at_4x1_and_at_cp1(scripts, reference, tmp_path):
    """Saved at iteration 2 with CP=4 as 2x2 (Mamba layers' conv, dt_bias, A_log, D, norm included), resumed with
    CP=4 as 4x1 and at CP=1 by the stock script with Megatron's own local spec: iterations 3-4 equal the
    uninterrupted run (compared per iteration, see per_iteration_losses)."""
    ckpt = tmp_path / "ckpt"
    save = [
        "--context-parallel-size",
        "4",
        "--cp-comm-type",
        "2d",
        "--cp-2d-head-parallel-size",
        "2",
        "--save",
        str(ckpt),
        "--save-interval",
        "2",
        "--exit-interval",
        "2",
    ]
    first = trained(run_pretrain(4, scripts["patched"], BASE + save)[-1])
    assert_same(first, reference, iterations=[1, 2])
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()
    resumes = {
        "cp4 as 4x1": (
            4,
            scripts["patched"],
            BASE + ["--context-parallel-size", "4", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "4"],
        ),
        "cp1, stock spec": (1, scripts["stock"], CP1),
    }
    for name, (world, script, flags) in resumes.items():
        logs = run_pretrain(world, script, flags + ["--load", str(ckpt)])
        assert f"loading distributed checkpoint from {ckpt} at iteration 2" in logs[0], name
        resumed = trained(logs[-1])
        assert sorted(resumed.losses) == [3, 4], f"{name}: {resumed}"
        assert_same(resumed.per_iteration(), reference.per_iteration(), iterations=[3, 4])


PIPELINE_PATTERN = "M-|*-"
PP2 = ["--pipeline-model-parallel-size", "2"]
PIPELINE_BASE = make_flags(("PATTERN", PIPELINE_PATTERN))
PIPELINE_BASE = PIPELINE_BASE[: PIPELINE_BASE.index("--context-parallel-size")] + PP2
PIPELINE_2D_ROUTES = {
    "patched, hp 1 x cp 2": (
        "patched",
        ["--context-parallel-size", "2", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1"],
    ),
    "--spec, hp 2 x cp 1": (
        "stock",
        SPEC_2D
        + ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1", "--cp-comm-type", "2d"],
    ),
}


@pytest.fixture(scope="module")
def pipeline_reference(scripts):
    """PP=2 at CP=1 with Megatron's local hybrid spec (megatron seeds each pipeline stage differently, so the
    reference keeps PP=2)."""
    logs = run_pretrain(2, scripts["stock"], make_flags(("CP", "1"), ("PATTERN", PIPELINE_PATTERN)) + PP2)
    found = training(logs)
    assert found.losses[ITERATIONS] < found.losses[1]
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("route", list(PIPELINE_2D_ROUTES))
def test_pipeline_stage_without_attention_at_2d_cp2_equals_cp1(scripts, pipeline_reference, route):
    """--pipeline-model-parallel-size 2 with pattern 'M-|*-': the first stage holds a Mamba and an MLP layer and
    no attention layer, yet joins the collectives that build the 2D groups (at the model's construction, on every
    rank), so the run trains; loss and grad norm per iteration equal PP=2 at CP=1. (When the first 2d attention
    layer built the groups, the second stage waited for the first until the 60 s timeout.)"""
    script, flags = PIPELINE_2D_ROUTES[route]
    logs = run_pretrain(4, scripts[script], PIPELINE_BASE + flags, timeout_s=60)
    assert "layers='M-'" in logs[0] and "layers='*-'" in logs[2]  # Megatron's log of each stage's layers
    assert_same(training(logs), pipeline_reference)


MISCONFIGURED = {
    "Mamba heads over CP (patched)": (
        "patched",
        CP4 + ["--mamba-num-heads", "6"],
        "Mamba layers split their heads over the whole CP group: 6 Mamba heads",
    ),
    "Mamba heads over CP (--spec)": (
        "stock",
        BASE
        + SPEC_2D
        + [
            "--mamba-num-heads",
            "6",
            "--context-parallel-size",
            "4",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
            "--cp-comm-type",
            "2d",
        ],
        "Mamba layers split their heads over the whole CP group: 6 Mamba heads",
    ),
    "documents layout with Mamba": (
        "patched",
        CP4 + ["--cp-2d-packing", "documents"],
        "cp_2d_packing='documents' cannot run a model with Mamba (M) layers",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(MISCONFIGURED))
def test_misconfigured_hybrid_launch_stops_every_rank_with_our_message(scripts, case):
    script, flags, message = MISCONFIGURED[case]
    for rank, outcome in enumerate(run_pretrain_outcomes(4, scripts[script], flags, timeout_s=90)):
        assert outcome.exit_status != 0 and message in outcome.error, f"rank {rank}: {outcome.error}"


# --- SFT: packed conversations (THD) through pretrain_hybrid.py --sft ---------------------------------------------

SFT_FLAGS = [
    "--sft",
    "--tokenizer-type",
    "SFTTokenizer",
    "--sft-tokenizer-prompt-format",
    PROMPT_FORMAT,
    "--split",
    "100,0,0",
    "--no-create-attention-mask-in-dataloader",
    "--calculate-per-token-loss",
]
"""Megatron's SFT route: SFTTokenizer and SFTDataset (which refuses the default attention mask). Per-token loss: without
it Megatron scales each CP rank's loss by that rank's own count of loss tokens, so with SFT's loss masks (prompts
masked, uneven over the ranks) the gradient depends on the CP size whatever the attention; the launch checks refuse
--sft at CP > 1 without it (the last test here; tests/test_pretrain_loss_scaling.py measures it)."""


def sft_flags(pattern, corpus):
    """The make target's flags for ``pattern`` (model, schedule) with its mock data and NullTokenizer replaced."""
    flags = make_flags(("PATTERN", pattern))
    flags = flags[: flags.index("--context-parallel-size")]
    for flag, values in (("--tokenizer-type", 1), ("--vocab-size", 1), ("--mock-data", 0)):
        at = flags.index(flag)
        flags = flags[:at] + flags[at + 1 + values :]
    return flags + SFT_FLAGS + corpus


SFT_2D_ROUTES = {
    "*-*-": (
        "stock",
        SPEC_2D
        + ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2", "--cp-comm-type", "2d"],
    ),
    "M*-M*-": ("patched", CP4[len(BASE) :]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("pattern", list(SFT_2D_ROUTES))
def test_sft_packed_conversations_at_2d_cp4_equal_cp1(scripts, sft_corpus, pattern):
    """pretrain_hybrid.py --sft: each sample packs 2-4 conversations (THD, Megatron's zigzag split per conversation
    at CP=4, Mamba's THD context parallelism for 'M'), prompts masked from the loss, one-token assistant turns. The
    2D run (hp 2 x cp 2; --spec route for '*-*-', patched route for 'M*-M*-') logs the CP=1 losses. CP=1 is the stock
    script with our spec on one rank: Megatron's local attention refuses packed batches (and TE's does not run on
    CPU), so its attention is ours at CP=1, the packed reference tests/test_megatron_hybrid_packed.py uses."""
    base = sft_flags(pattern, sft_corpus)
    reference = training(run_pretrain(1, scripts["stock"], base + SPEC_2D))
    script, route = SFT_2D_ROUTES[pattern]
    assert_same(training(run_pretrain(4, scripts[script], base + route)), reference)


@pytest.mark.distributed
def test_sft_without_per_token_loss_stops_every_rank_with_our_message(scripts, sft_corpus):
    """pretrain_hybrid.py --sft at 2D CP=4 without --calculate-per-token-loss would train differently than at CP=1
    (each CP rank's loss divided by its own count of loss tokens; tests/test_pretrain_loss_scaling.py measures it
    on pretrain_gpt.py): refused at launch on every rank."""
    flags = [f for f in sft_flags("M*-M*-", sft_corpus) if f != "--calculate-per-token-loss"]
    message = "--sft at --context-parallel-size 4 (cp_comm_type ['2d']) needs --calculate-per-token-loss"
    for rank, outcome in enumerate(run_pretrain_outcomes(4, scripts["patched"], flags + CP4[len(BASE) :], 90)):
        assert outcome.exit_status != 0 and message in (outcome.error or ""), f"rank {rank}: {outcome.error}"


@pytest.mark.distributed
def test_pretrain_hybrid_with_sequence_parallelism_equals_cp1(scripts):
    """pretrain_hybrid.py --sequence-parallel at TP 2 x 2D CP 2 (hp 2), pattern 'M*-', logs the lm loss and grad norm
    of TP 2 + SP at CP = 1, both the unpatched script with --spec. HybridStack's final norm is TENorm whatever the
    spec says, and the local specs' torch norms refuse SP, so both runs build Transformer Engine's norms (its
    release's Python over CPU kernels, megatron_2d_dev.sp_norms), entered before the ranks fork."""
    from megatron_2d_dev.sp_norms import te_norms

    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hybrid-layer-pattern", "M*-"]
    spec = ["--spec", "megatron_2d_dev.sp_norms"]
    cp2 = ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1", "--cp-comm-type", "2d"]
    with te_norms():
        reference = training(
            run_pretrain(2, scripts["stock"], BASE + tp_sp + spec + ["megatron_local_hybrid_stack_spec_te_norms"])
        )
        got = training(run_pretrain(4, scripts["stock"], BASE + tp_sp + spec + ["hybrid_stack_spec_2d_te_norms"] + cp2))
    assert reference.losses[ITERATIONS] < reference.losses[1]
    assert_same(got, reference)
