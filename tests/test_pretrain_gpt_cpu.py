"""Megatron's own training loop end to end: stock pretrain_gpt.py (Megatron-LM core_v0.19.0) runs ``pretrain()`` on
forked CPU ranks with the 2d backend, and the ``lm loss`` Megatron logs per iteration equals the CP=1 run.

Routes: the patched pretrain_gpt.py (``--cp-comm-type 2d --cp-2d-*``), the unpatched one with ``--spec``, and
examples/pretrain_gpt_2d.py. The scripts come from ``<repo>/../shared/megatron-lm/core_v0.19.0`` (copied to a
temporary folder; see megatron_2d_dev.megatron_lm). Every CP=1 reference is the unpatched stock script.
Without Transformer Engine, Megatron's local attention refuses CP > 1, so a CP > 1 run trains only through the 2d
core attention. Runs: 2 layers, hidden 64, GQA 8/2 heads, RoPE, seq 128, micro-batch 1, global batch 2, 4 iterations.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import sys

import pytest
import torch

from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.megatron_lm import copy_scripts  # noqa: E402
from megatron_2d_dev.pretrain_cpu import CudaAvailableError, install_pretrain_cpu_shims
from megatron_2d_dev.pretrain_runs import (  # noqa: E402
    assert_same_training,
    run_pretrain,
    run_pretrain_outcomes,
    trained,
    write_document_dataset,
)

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[1]
ITERATIONS = 4
RTOL = TOLERANCES[torch.float32].end_to_end

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
    "--position-embedding-type",
    "rope",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",
]  # padded vocab 128 at TP=1 and TP=2: the same weights
TRAIN = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--train-iters",
    str(ITERATIONS),
    "--mock-data",
    "--seed",
    "1234",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--distributed-timeout-minutes",
    "10",
]
BASE = MODEL + TRAIN
CP4_2D = [
    "--context-parallel-size",
    "4",
    "--cp-comm-type",
    "2d",
    "--cp-2d-head-parallel-size",
    "2",
    "--cp-2d-inner-ring-size",
    "2",
]
SPEC_2D = ["--spec", "megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
RECOMPUTE = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--selective-checkpoint-plus-plus",
]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Temporary copies of the stock scripts: ``stock`` unchanged, ``patched`` with the project's patch. The stock
    module is imported here once, so forked ranks find megatron.training and its imports loaded."""
    root = tmp_path_factory.mktemp("megatron_lm")
    paths = {"stock": copy_scripts(root / "stock"), "patched": copy_scripts(root / "patched", patched=True)}
    folder = str(paths["stock"].parent)
    sys.path.insert(0, folder)
    importlib.import_module("pretrain_gpt")
    yield paths
    sys.path.remove(folder)
    for name in ("pretrain_gpt", "gpt_builders", "model_provider"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def reference(scripts):
    """The CP=1 run: the unpatched stock script on one rank, {iteration: lm loss}."""
    return training(run_pretrain(1, scripts["stock"], BASE))


@pytest.fixture
def layers_2d(monkeypatch):
    """Every CoreAttention2D a forked rank builds prints its settings, so tests see the flags reach the model."""
    from megatron_2d.megatron.core_attention import CoreAttention2D

    original = CoreAttention2D.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        print(f"[test] 2d layer {self.layer_number}: {self.settings} keeps attention: {self.keeper is not None}")

    monkeypatch.setattr(CoreAttention2D, "__init__", init)

    def line(layer, hp, cp_size=4, inner_ring_size=None, placement="head_first", keeps=False):
        w = cp_size // hp if inner_ring_size is None else inner_ring_size  # default: one ring of all cp ranks
        return (
            f"[test] 2d layer {layer}: Settings2D(context_parallel_size={cp_size}, head_parallel_size={hp}, "
            f"inner_ring_size={w}, placement='{placement}') keeps attention: {keeps}"
        )

    return line


def training(logs):
    """The lm loss and grad norm per iteration from the last rank's log (Megatron logs there), checked complete."""
    found = trained(logs[-1])
    assert sorted(found.losses) == list(range(1, ITERATIONS + 1)), f"missing iterations:\n{logs[-1][-3000:]}"
    return found


def assert_same(got, expected, iterations=range(1, ITERATIONS + 1), rtol=RTOL, grad_norm_rtol=None):
    """The same lm loss and grad norm at each iteration (see assert_same_training)."""
    assert_same_training(got, expected, rtol, iterations, grad_norm_rtol)


@pytest.mark.distributed
def test_reference_trains(reference):
    assert reference.losses[ITERATIONS] < reference.losses[1]  # the stock loop learns: the comparisons are not vacuous


@pytest.mark.distributed
@pytest.mark.parametrize("placement", ["head_first", "context_first"])
def test_patched_pretrain_gpt_2d_equals_cp1(scripts, reference, layers_2d, placement):
    logs = run_pretrain(4, scripts["patched"], BASE + CP4_2D + ["--cp-2d-placement", placement])
    assert all(
        layers_2d(layer, hp=2, inner_ring_size=2, placement=placement) in log for log in logs for layer in (1, 2)
    )
    assert_same(training(logs), reference)


@pytest.mark.distributed
def test_unpatched_pretrain_gpt_with_spec_equals_cp1(scripts, reference, layers_2d):
    flags = SPEC_2D + [
        "--context-parallel-size",
        "4",
        "--hierarchical-context-parallel-sizes",
        "2",
        "2",
        "--cp-comm-type",
        "2d",
    ]
    logs = run_pretrain(4, scripts["stock"], BASE + flags)
    assert layers_2d(2, hp=2) in logs[0]
    assert_same(training(logs), reference)


@pytest.mark.distributed
def test_example_entry_equals_cp1(scripts, reference, layers_2d, monkeypatch):
    monkeypatch.setenv("MEGATRON_LM_DIR", str(scripts["stock"].parent))
    logs = run_pretrain(4, REPO / "examples" / "pretrain_gpt_2d.py", BASE + CP4_2D)
    assert layers_2d(2, hp=2, inner_ring_size=2) in logs[0]
    assert_same(training(logs), reference)


@pytest.mark.distributed
def test_tp2_cp4_distributed_optimizer_recompute_equals_cp1(scripts, reference, layers_2d):
    """TP=2 x CP=2x2 (8 ranks): weights from --use-cpu-initialization do not depend on TP, so CP=1 at TP=1 is the
    reference."""
    flags = ["--tensor-model-parallel-size", "2", *CP4_2D, "--use-distributed-optimizer", *RECOMPUTE]
    logs = run_pretrain(8, scripts["patched"], BASE + flags)
    assert layers_2d(1, hp=2, inner_ring_size=2, keeps=True) in logs[0]
    assert re.search(r"use_distributed_optimizer \.+ True", logs[0])  # megatron's argument dump
    assert_same(training(logs), reference)


@pytest.mark.distributed
def test_pp2_cp4_distributed_optimizer_equals_cp1(scripts, layers_2d):
    """PP=2 x CP=4 (8 ranks) against PP=2 x CP=1: megatron seeds each pipeline stage differently (seed + 100 x stage),
    so the reference keeps PP=2."""
    pp = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    expected = training(run_pretrain(2, scripts["stock"], BASE + pp))
    logs = run_pretrain(8, scripts["patched"], BASE + pp + CP4_2D + RECOMPUTE)
    assert (
        layers_2d(1, hp=2, inner_ring_size=2, keeps=True) in logs[0]
        and layers_2d(2, hp=2, inner_ring_size=2, keeps=True) in logs[-1]
    )
    assert_same(training(logs), expected)


PIPELINE_LAYOUT = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|L"]
PIPELINE_2D_ROUTES = {
    "patched, hp 2 x cp 1": (
        "patched",
        ["--context-parallel-size", "2", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "2"],
        2,
    ),
    "--spec, hp 1 x cp 2": (
        "stock",
        SPEC_2D
        + ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "1", "2", "--cp-comm-type", "2d"],
        1,
    ),
}


@pytest.fixture(scope="module")
def pipeline_reference(scripts):
    """PP=2 at CP=1 with the pipeline layout (the unpatched script), shared by both routes below."""
    return training(run_pretrain(2, scripts["stock"], BASE + PIPELINE_LAYOUT))


@pytest.mark.distributed
@pytest.mark.parametrize("route", list(PIPELINE_2D_ROUTES))
def test_pipeline_stage_without_decoder_layers_at_2d_cp2_equals_cp1(scripts, pipeline_reference, layers_2d, route):
    """--pipeline-model-parallel-layout 'Ett|L' (PP=2): the second stage holds the loss and no decoder layer (the
    one way a GPT stage holds none; Megatron refuses --decoder-first/last-pipeline-num-layers 0), yet joins the
    collectives that build the 2D groups, at the model's construction on every rank: loss and grad norm per
    iteration equal PP=2 at CP=1 with the same layout. (When the first 2d layer built the groups, the first stage
    waited for the second until the 60 s timeout.)"""
    script, flags, hp = PIPELINE_2D_ROUTES[route]
    logs = run_pretrain(4, scripts[script], BASE + PIPELINE_LAYOUT + flags, timeout_s=60)
    assert all(layers_2d(layer, hp=hp, cp_size=2) in logs[0] for layer in (1, 2))
    assert "[test] 2d layer" not in logs[-1]  # the last stage built no attention layer
    assert_same(training(logs), pipeline_reference)


@pytest.mark.distributed
def test_checkpoint_saved_at_cp4_resumes_at_other_2d_layouts(scripts, reference, layers_2d, tmp_path):
    """Save at iteration 2 with CP=4 as hp x cp = 2x2, resume with 4x1 and with CP=2 as 1x2: iterations 3-4 equal the
    uninterrupted run. Megatron's default checkpoint format (torch_dist, a torch.distributed.checkpoint folder with
    metadata.json) is used. Megatron logs the second iteration of every run averaged with the first (see
    per_iteration_losses), so the runs are compared iteration by iteration after undoing that."""
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
    assert sorted(first.losses) == [1, 2]
    assert_same(first, reference, iterations=[1, 2])
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for world_size, hp in ((4, 4), (2, 1)):
        flags = [
            "--context-parallel-size",
            str(world_size),
            "--cp-comm-type",
            "2d",
            "--cp-2d-head-parallel-size",
            str(hp),
            "--load",
            str(ckpt),
        ]
        logs = run_pretrain(world_size, scripts["patched"], BASE + flags)
        assert f"loading distributed checkpoint from {ckpt} at iteration 2" in logs[0]
        assert layers_2d(1, hp=hp, cp_size=world_size) in logs[0]
        resumed = trained(logs[-1])
        assert sorted(resumed.losses) == [3, 4], f"CP={world_size} hp={hp}: {resumed}"
        assert_same(resumed.per_iteration(), reference.per_iteration(), iterations=[3, 4])


MISCONFIGURED = {
    "hp does not divide CP": (
        "patched",
        CP4_2D[:4] + ["--cp-2d-head-parallel-size", "3"],
        "head-parallel size 3 does not divide the context-parallel size 4; valid head-parallel "
        "sizes for CP=4: [1, 2, 4]",
    ),
    "2D flags without --cp-comm-type 2d": (
        "patched",
        ["--context-parallel-size", "4", "--cp-2d-head-parallel-size", "2"],
        "are set but cp_comm_type is ['p2p']",
    ),
    "THD (patched)": (
        "patched",
        CP4_2D + ["--reset-attention-mask"],
        "--reset-attention-mask gives document masks the 2d backend",
    ),
    "ready spec under a pipeline layout with an empty stage": (
        "patched",
        ["--context-parallel-size", "2", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "2"]
        + PIPELINE_LAYOUT
        + ["--spec", "megatron_2d.megatron.spec", "GPT_LAYER_SPEC_2D"],
        "--pipeline-model-parallel-layout 'Ett|L' gives pipeline stages [1] no decoder layer, and --spec "
        "megatron_2d.megatron.spec GPT_LAYER_SPEC_2D is a ready spec that Megatron does not call",
    ),
    "--eod-mask-loss without --calculate-per-token-loss": (
        "patched",
        CP4_2D + ["--eod-mask-loss"],
        "--eod-mask-loss at --context-parallel-size 4 (cp_comm_type ['2d']) needs --calculate-per-token-loss",
    ),
    "--spec without --cp-comm-type 2d": (
        "stock",
        SPEC_2D + ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
        "the 2d layer spec is in use but cp_comm_type is 'p2p'",
    ),
    "THD (--spec)": (
        "stock",
        SPEC_2D
        + [
            "--context-parallel-size",
            "4",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
            "--cp-comm-type",
            "2d",
            "--reset-attention-mask",
        ],
        "--reset-attention-mask gives document masks the 2d backend",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(MISCONFIGURED))
def test_misconfigured_command_line_stops_every_rank_with_our_message(scripts, case):
    script, flags, message = MISCONFIGURED[case]
    outcomes = run_pretrain_outcomes(4, scripts[script], BASE + flags, timeout_s=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome.exit_status != 0, f"rank {rank} did not fail"
        assert message in outcome.error, f"rank {rank}: {outcome.error}"


@pytest.mark.distributed
def test_bf16_2d_close_to_cp1(scripts):
    """--bf16 (megatron's Float16Module, fp32 main params; the CPU runs bf16 matmuls): CP=4 2D within bf16 rounding of
    CP=1, the loss within 2e-4 and the grad norm (of bf16 gradients) within the bf16 tolerance of the table."""
    expected = training(run_pretrain(1, scripts["stock"], BASE + ["--bf16"]))
    got = training(run_pretrain(4, scripts["patched"], BASE + ["--bf16"] + CP4_2D))
    assert_same(got, expected, rtol=2e-4, grad_norm_rtol=TOLERANCES[torch.bfloat16].end_to_end)


def test_make_target_runs_the_command_of_the_2d_parity_test():
    """`make pretrain-cpu` (tools/pretrain_gpt_cpu.sh, shown in the README) launches the flags tested above."""
    import subprocess

    out = subprocess.run(
        ["bash", str(REPO / "tools" / "pretrain_gpt_cpu.sh"), "--print-flags"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.split("\n")[:-1] == BASE + CP4_2D + ["--cp-2d-placement", "head_first"]


def test_cpu_launch_refuses_to_act_where_cuda_is_available(scripts, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(CudaAvailableError, match="CUDA is available here, so run pretrain_gpt.py unchanged"):
        install_pretrain_cpu_shims()
    with pytest.raises(CudaAvailableError):
        run_pretrain(1, scripts["stock"], BASE)


DOCUMENTS = ["--dataloader-inter-document-masking", "--no-rope-fusion"]
# packed documents of 1 to 40 tokens (a 128-token sample cuts through several; Megatron's mock documents run to 4096)
DOCUMENT_LENGTHS = [1, 40, 7, 1, 23, 31, 2, 40, 12, 1, 5, 38, 17, 9, 29, 3] * 8


@pytest.fixture(scope="module")
def document_data(tmp_path_factory):
    """BASE with --mock-data replaced by an indexed dataset of short documents."""
    prefix = write_document_dataset(tmp_path_factory.mktemp("documents") / "docs", DOCUMENT_LENGTHS, vocab=128)
    at = BASE.index("--mock-data")
    return BASE[:at] + ["--data-path", prefix, "--split", "100,0,0"] + BASE[at + 1 :]


@pytest.fixture(scope="module")
def documents_cp4(scripts, document_data):
    """--cp-2d-packing documents through the example's own data path (RoPE at document positions) at 2D CP=4,
    {iteration: lm loss}."""
    import os

    os.environ["MEGATRON_LM_DIR"] = str(scripts["stock"].parent)
    example = REPO / "examples" / "pretrain_gpt_2d.py"
    return training(run_pretrain(4, example, document_data + CP4_2D + DOCUMENTS + ["--cp-2d-packing", "documents"]))


@pytest.mark.distributed
def test_example_documents_layout_equals_cp1(scripts, document_data, documents_cp4, monkeypatch):
    """The documents layout against the example at CP=1 on the same packed batches (there the batch is one
    rank's, whole)."""
    monkeypatch.setenv("MEGATRON_LM_DIR", str(scripts["stock"].parent))
    example = REPO / "examples" / "pretrain_gpt_2d.py"
    ref = training(
        run_pretrain(
            1, example, document_data + DOCUMENTS + ["--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1"]
        )
    )
    assert ref.losses[ITERATIONS] < ref.losses[1]
    assert_same(documents_cp4, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("route", ["patched", "spec"])
def test_stock_inter_document_masking_equals_documents_layout(scripts, document_data, documents_cp4, layers_2d, route):
    """Stock pretrain_gpt.py with --dataloader-inter-document-masking and no other change (Megatron splits each
    packed batch per sequence; the 2d backend runs it as the "sequence" layout, RoPE at document positions)
    trains exactly as the documents layout does on the same data."""
    flags = (
        CP4_2D
        if route == "patched"
        else SPEC_2D
        + ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2", "--cp-comm-type", "2d"]
    )
    logs = run_pretrain(
        4,
        scripts[route if route == "patched" else "stock"],
        document_data + flags + ["--dataloader-inter-document-masking"],
    )
    assert layers_2d(1, hp=2, inner_ring_size=2)  # patched: the flag; spec: the default, cp in logs[0]
    assert_same(training(logs), documents_cp4)


@pytest.mark.distributed
def test_patched_pretrain_gpt_trains_with_qk_clip(scripts, reference):
    """--qk-clip through Megatron's own training loop and the patched script, without Transformer Engine (whose
    version Megatron's validate_args asks for): the 2D max logit reaches the clip step after every optimizer step
    (megatron_2d.megatron.qk_clip.clip_qk: this fp32 model is one megatron-core's own cannot reach). Iteration 1 is
    the reference's (the clip acts after it); at a threshold of 1e-6, far below this model's max logits (small with
    Megatron's initialisation, std 0.02), it scales W_q and W_k down after each step. Small logits leave attention
    almost uniform either way, so the losses move little, but beyond the run-to-run agreement of the 2d
    run without the clip (RTOL; measured: 6.6e-5 and 7.3e-5 relative at iterations 3 and 4). Parity with CP = 1
    under QK-clip: tests/test_qk_clip.py."""
    flags = ["--qk-clip", "--qk-clip-threshold", "1e-6", "--log-max-attention-logit"]
    got = training(run_pretrain(4, scripts["patched"], BASE + CP4_2D + flags))
    assert_same(got, reference, iterations=[1])
    moved = [abs(got.losses[i] / reference.losses[i] - 1) for i in (3, 4)]
    assert min(moved) > 3 * RTOL, (moved, got.losses, reference.losses)


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.mark.distributed
def test_pretrain_gpt_with_sequence_parallelism_equals_cp1(scripts, layers_2d):
    """pretrain_gpt.py --sequence-parallel at TP 2 x 2D CP 2 (hp 2: K/V replicated) logs the lm loss and grad norm
    of TP 2 + SP at CP = 1 (the unpatched script). The local spec's LayerNorm with SP is megatron-core's
    FusedLayerNorm over apex's function stood in (megatron_2d_dev.sp_norms; torch's norm refuses SP), entered
    before the ranks fork."""
    from megatron_2d_dev.sp_norms import apex_layer_norm

    cp2 = ["--context-parallel-size", "2", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "2"]
    with apex_layer_norm():
        reference = training(run_pretrain(2, scripts["stock"], BASE + TP2_SP))
        logs = run_pretrain(4, scripts["patched"], BASE + TP2_SP + cp2)
    assert all(layers_2d(layer, hp=2, cp_size=2) in log for log in logs for layer in (1, 2))
    assert reference.losses[ITERATIONS] < reference.losses[1]
    assert_same(training(logs), reference, grad_norm_rtol=RTOL)
