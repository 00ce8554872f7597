"""``pretrain_gpt.py --hybrid-context-parallel`` with the 2d flags: Megatron's own training loop (Megatron-LM
core_v0.19.0, patched) on forked CPU ranks, dynamic (hybrid) CP with a 2D layout per group size, logs the CP = 1
lm loss and grad norm.

Data: Megatron's --sft route (SFTTokenizer, SFTDataset's packed conversations, prompts masked; the tiny corpus of
megatron_2d_dev.sft_data): Megatron's hybrid wrapper unpacks every sample into its conversations and gives each
its own CP group; the last conversation of a pack takes the pack's end padding, so at --max-seqlen-per-dp-cp-rank
32 on DP x CP = 4 ranks the conversations run on 1 rank and the padded ones on 2 or 4. The CP = 1 reference is the
stock script with the 2d spec on one rank (Megatron's local attention refuses packed batches). Runs: 2 layers,
hidden 64, 8 heads / 2 K/V heads, RoPE, seq 128, global batch 4, 3 iterations; with --qk-clip, against the patched
script on one rank (the stock one asserts Transformer Engine >= 2.9 for it).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.megatron_lm import copy_scripts
from megatron_2d_dev.pretrain_runs import assert_same_training, run_pretrain, run_pretrain_outcomes, trained
from megatron_2d_dev.sft_data import PROMPT_FORMAT

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

ITERATIONS = 3
BASE = [
    *("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2").split(),
    *("--position-embedding-type rope --seq-length 128 --max-position-embeddings 128").split(),
    *("--make-vocab-size-divisible-by 64 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3").split(),
    *(f"--train-iters {ITERATIONS} --seed 1234 --attention-dropout 0 --hidden-dropout 0 --log-interval 1").split(),
    *("--eval-iters 0 --eval-interval 1000 --distributed-timeout-minutes 10").split(),
    *(f"--sft --tokenizer-type SFTTokenizer --sft-tokenizer-prompt-format {PROMPT_FORMAT} --split 100,0,0").split(),
    *("--no-create-attention-mask-in-dataloader --calculate-per-token-loss").split(),
]
SPEC_2D = ["--spec", "megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
HYBRID = [
    *("--hybrid-context-parallel --max-seqlen-per-dp-cp-rank 32 --rerun-mode disabled --cp-comm-type 2d").split(),
    *("--context-parallel-size 2 --cp-2d-dynamic-layouts 2=2x1,4=4x1").split(),  # DP 2 x CP 2; K/V replicated at 4
]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
HYBRID_TP2_SP = [  # with TP2_SP on 4 ranks: DP 1 x CP 2, 128 tokens on the 2 DP x CP ranks; K/V replicated at 2
    *("--hybrid-context-parallel --max-seqlen-per-dp-cp-rank 64 --rerun-mode disabled --cp-comm-type 2d").split(),
    *("--context-parallel-size 2 --cp-2d-dynamic-layouts 2=2x1").split(),
]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    paths = {"stock": copy_scripts(root / "stock"), "patched": copy_scripts(root / "patched", patched=True)}
    folder = str(paths["stock"].parent)
    sys.path.insert(0, folder)
    importlib.import_module("pretrain_gpt")  # forked ranks find its imports loaded
    yield paths
    sys.path.remove(folder)
    for name in ("pretrain_gpt", "gpt_builders", "model_provider"):
        sys.modules.pop(name, None)


@pytest.fixture
def group_sizes(monkeypatch):
    """Every hybrid micro-batch a forked rank runs prints its CP group size (the layers ask per call)."""
    from megatron_2d.megatron.dynamic import DynamicGroups

    original = DynamicGroups.for_batch

    def for_batch(self, local_cp_size, cp_group):
        print(f"[test] hybrid micro-batch on a CP group of {int(local_cp_size)}")
        return original(self, local_cp_size, cp_group)

    monkeypatch.setattr(DynamicGroups, "for_batch", for_batch)


def training(logs):
    found = trained(logs[-1])
    assert sorted(found.losses) == list(range(1, ITERATIONS + 1)), f"missing iterations:\n{logs[-1][-3000:]}"
    return found


def test_patched_pretrain_gpt_hybrid_cp_equals_cp1(scripts, sft_corpus, group_sizes):
    reference = training(run_pretrain(1, scripts["stock"], BASE + sft_corpus + SPEC_2D))
    assert reference.losses[ITERATIONS] < reference.losses[1]
    logs = run_pretrain(4, scripts["patched"], BASE + sft_corpus + HYBRID)
    assert "--cp-2d-dynamic-layouts '2=2x1,4=4x1' (all given by --cp-2d-dynamic-layouts)" in logs[0]
    sizes = {int(line.split()[-1]) for log in logs for line in log.splitlines() if "hybrid micro-batch" in line}
    assert sizes == {1, 2, 4}
    assert_same_training(training(logs), reference, TOLERANCES[torch.float32].end_to_end)


def test_patched_pretrain_gpt_hybrid_cp_with_sequence_parallelism_equals_cp1(scripts, sft_corpus, group_sizes):
    """--tensor-model-parallel-size 2 --sequence-parallel with --hybrid-context-parallel (TP 2 x DP 1 x CP 2, K/V
    replicated at hp 2) logs the lm loss and grad norm of TP 2 + SP at CP = 1: the forward step pads each sequence
    for its TP split, the 2d self attention reads the gathered sequence. LayerNorm with SP: megatron-core's
    FusedLayerNorm over apex's function stood in (megatron_2d_dev.sp_norms), entered before the ranks fork."""
    from megatron_2d_dev.sp_norms import apex_layer_norm

    with apex_layer_norm():
        reference = training(run_pretrain(2, scripts["stock"], BASE + sft_corpus + SPEC_2D + TP2_SP))
        logs = run_pretrain(4, scripts["patched"], BASE + sft_corpus + HYBRID_TP2_SP + TP2_SP)
    sizes = {int(line.split()[-1]) for log in logs for line in log.splitlines() if "hybrid micro-batch" in line}
    assert sizes == {1, 2}
    assert reference.losses[ITERATIONS] < reference.losses[1]
    assert_same_training(training(logs), reference, TOLERANCES[torch.float32].end_to_end)


def test_unpatched_route_is_refused_on_every_rank(scripts, sft_corpus):
    """The --spec route has no bridge for megatron-core 0.19.2's hybrid sub-samples (it would stop with an
    IndexError in get_batch): every rank stops at the launch check with the reason."""
    flags = BASE + sft_corpus + SPEC_2D + ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "32"]
    flags += ["--rerun-mode", "disabled", "--cp-comm-type", "2d"]
    message = "--hybrid-context-parallel through pretrain_gpt.py without the 2d flags (the --spec route)"
    for rank, outcome in enumerate(run_pretrain_outcomes(4, scripts["stock"], flags, timeout_s=90)):
        assert outcome.exit_status != 0 and message in (outcome.error or ""), f"rank {rank}: {outcome.error}"


QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "1.0", "--log-max-attention-logit"]


@pytest.fixture
def told_lengths(monkeypatch):
    """Every hybrid micro-batch whose real length the forward step tells the model prints it and its padded one."""
    from megatron_2d.megatron import dynamic_data

    original = dynamic_data.params_with_real_length

    def params_with_real_length(params, real_length):
        told = original(params, real_length)
        if told is not params:
            print(f"[test] told {real_length} of {int(params.cu_seqlens_q[-1])}")
        return told

    monkeypatch.setattr(dynamic_data, "params_with_real_length", params_with_real_length)


def test_patched_pretrain_gpt_hybrid_cp_with_qk_clip_equals_cp1(scripts, sft_corpus, group_sizes, told_lengths):
    """--qk-clip (threshold 1, clipping every step) and --log-max-attention-logit under --hybrid-context-parallel
    through the patched script: its forward step (forward_step_2d, reading the flags) tells the model where the
    bridge's end padding starts (dynamic_data.params_with_real_length: here 116 of 120, 92 of 96, 76 of 80, 12 of
    16 tokens, each iteration), and the loss and grad norm after each clip are those of the patched script's one-rank
    run. This corpus's padding rows happen not to raise the max logit (without the fix it passes too); that the
    padding is kept out of the max is tests/test_qk_clip.py's hybrid test."""
    one_rank = ["--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1"]
    reference = training(run_pretrain(1, scripts["patched"], BASE + sft_corpus + one_rank + QK_CLIP))
    logs = run_pretrain(4, scripts["patched"], BASE + sft_corpus + HYBRID + QK_CLIP)
    sizes = {int(line.split()[-1]) for log in logs for line in log.splitlines() if "hybrid micro-batch" in line}
    assert sizes == {1, 2, 4}
    told = [line.split()[-3:] for log in logs for line in log.splitlines() if "[test] told" in line]
    assert len(told) >= ITERATIONS and all(int(real) < int(padded) for real, _, padded in told), told
    assert_same_training(training(logs), reference, TOLERANCES[torch.float32].end_to_end)
