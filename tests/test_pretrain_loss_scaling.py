"""Which launches train differently at 2D CP = 2 than at CP = 1 without --calculate-per-token-loss, measured through
Megatron-LM's pretrain_gpt.py on forked CPU ranks, and the launch check that refuses exactly those.

Without --calculate-per-token-loss Megatron's schedule divides each CP rank's loss sum by that rank's own count of
loss tokens, and the gradient reduction averages the ranks: the gradient is the mean over tokens only when every
CP rank holds as many loss tokens. Each route below runs at CP = 1 and at 2D CP = 2 (hp 1 x cp 2) and compares the
per-iteration loss and the optimizer's grad norm (full precision; fp32 tolerance):

* routes whose loss masks zero tokens here and there (--sft, --eod-mask-loss) differ from the first step, and
  agree with --calculate-per-token-loss: the launch check refuses them without it (measured here with the check
  switched off in the ranks) and every rank stops with the message;
* plain pretraining, --dataloader-inter-document-masking alone (every loss mask all ones) and the documents layout
  (whose loss weighs every token itself) agree without the flag, so the check lets them through (run with it on).

Runs: 2 layers, hidden 64, GQA 8/2 heads, RoPE, seq 128, micro-batch 1, global batch 2 (two micro-batches),
4 iterations (tools/pretrain_gpt_cpu.sh's flags).
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_2d.megatron import launch_checks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.megatron_lm import copy_scripts
from megatron_2d_dev.pretrain_runs import (
    assert_same_training,
    run_pretrain,
    run_pretrain_outcomes,
    trained,
    write_document_dataset,
)
from megatron_2d_dev.sft_data import PROMPT_FORMAT

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

REPO = pathlib.Path(__file__).resolve().parents[1]
ITERATIONS = 4
RTOL = TOLERANCES[torch.float32].end_to_end
PER_TOKEN = ["--calculate-per-token-loss"]
CP2_2D = ["--context-parallel-size", "2", "--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1"]
SPEC_2D = ["--spec", "megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
EXAMPLE = REPO / "examples" / "pretrain_gpt_2d.py"


def cpu_flags():
    """tools/pretrain_gpt_cpu.sh's CP=1 flags for pretrain_gpt.py (what `make pretrain-cpu` trains)."""
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "pretrain_gpt_cpu.sh"), "--print-flags"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={"CP": "1", "PATH": "/usr/bin:/bin"},
    )
    return out.stdout.split("\n")[:-1]


BASE = cpu_flags()
DOCUMENT_LENGTHS = [1, 40, 7, 1, 23, 31, 2, 40, 12, 1, 5, 38, 17, 9, 29, 3] * 8
"""Packed documents of 1 to 40 tokens, each ending with the end-of-document token (--eod-mask-loss masks it)."""
SFT = [
    "--sft",
    "--tokenizer-type",
    "SFTTokenizer",
    "--sft-tokenizer-prompt-format",
    PROMPT_FORMAT,
    "--split",
    "100,0,0",
    "--no-create-attention-mask-in-dataloader",
]
INTER_DOCUMENT = ["--dataloader-inter-document-masking", "--no-rope-fusion"]

# name: (data, flags, entry of the 2D run, whether the 2D run trains differently without --calculate-per-token-loss)
ROUTES = {
    "unpacked": ("mock", [], "patched", False),
    "unpacked --eod-mask-loss": ("mock", ["--eod-mask-loss"], "patched", True),
    "--dataloader-inter-document-masking": ("documents", INTER_DOCUMENT, "patched", False),
    "--dataloader-inter-document-masking --eod-mask-loss": (
        "documents",
        INTER_DOCUMENT + ["--eod-mask-loss"],
        "patched",
        True,
    ),
    "--cp-2d-packing documents --eod-mask-loss": (
        "documents",
        INTER_DOCUMENT + ["--eod-mask-loss"],
        "example, documents layout",
        False,
    ),
    "--sft": ("sft", SFT, "patched", True),
}
CP_DEPENDENT = [name for name, route in ROUTES.items() if route[3]]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory, monkeypatch_module):
    """The stock and patched pretrain_gpt.py (copies), the stock one imported here once for the forked ranks; the
    example entry finds the stock scripts through MEGATRON_LM_DIR."""
    root = tmp_path_factory.mktemp("megatron_lm")
    paths = {"stock": copy_scripts(root / "stock"), "patched": copy_scripts(root / "patched", patched=True)}
    folder = str(paths["stock"].parent)
    sys.path.insert(0, folder)
    importlib.import_module("pretrain_gpt")
    monkeypatch_module.setenv("MEGATRON_LM_DIR", folder)
    yield paths
    sys.path.remove(folder)
    for name in ("pretrain_gpt", "gpt_builders", "model_provider"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def data(tmp_path_factory, sft_corpus):
    """Each route's data flags: Megatron's mock data, the packed documents above, or the SFT corpus."""
    prefix = write_document_dataset(
        tmp_path_factory.mktemp("documents") / "docs", DOCUMENT_LENGTHS, vocab=128, append_eod=True
    )
    at = BASE.index("--mock-data")
    sft_base = list(BASE)  # mock data and NullTokenizer out
    for flag, values in (("--tokenizer-type", 1), ("--vocab-size", 1), ("--mock-data", 0)):
        i = sft_base.index(flag)
        sft_base = sft_base[:i] + sft_base[i + 1 + values :]
    return {
        "mock": BASE,
        "documents": BASE[:at] + ["--data-path", prefix, "--split", "100,0,0"] + BASE[at + 1 :],
        "sft": sft_base + sft_corpus,
    }


def runs(name, scripts, data, extra=()):
    """(the CP=1 run, the 2D CP=2 run) of route ``name`` with ``extra`` flags, as Trained. CP=1: the stock script
    (with our attention for packed batches, which Megatron's local attention refuses), or the example entry for the
    documents layout."""
    kind, flags, entry, _ = ROUTES[name]
    base = data[kind] + flags + list(extra)
    if entry == "example, documents layout":
        cp1 = run_pretrain(1, EXAMPLE, base + ["--cp-comm-type", "2d", "--cp-2d-head-parallel-size", "1"])
        cp2 = run_pretrain(2, EXAMPLE, base + CP2_2D + ["--cp-2d-packing", "documents"])
    else:
        cp1 = run_pretrain(1, scripts["stock"], base + (SPEC_2D if kind != "mock" else []))
        cp2 = run_pretrain(2, scripts[entry], base + CP2_2D)
    found = trained(cp1[-1]), trained(cp2[-1])
    for run in found:
        assert sorted(run.losses) == list(range(1, ITERATIONS + 1)), run
    return found


def largest_relative_difference(got, expected):
    return max(
        abs(a[it] - e[it]) / abs(e[it])
        for a, e in ((got.losses, expected.losses), (got.grad_norms, expected.grad_norms))
        for it in e
    )


@pytest.mark.parametrize("name", list(ROUTES))
def test_which_launches_train_differently_at_cp2_without_per_token_loss(scripts, data, monkeypatch, name):
    """CP-dependent routes (launch check off in the ranks): the 2D CP=2 run's grad norm leaves CP=1's from the
    first step, and --calculate-per-token-loss brings it back. The others: the same training without the flag,
    with the launch check on (it lets them through)."""
    if not ROUTES[name][3]:
        cp1, cp2 = runs(name, scripts, data)
        assert_same_training(cp2, cp1, RTOL)
        return
    with monkeypatch.context() as unchecked:
        unchecked.setattr(launch_checks, "loss_scaling_problem", lambda args: None)  # inherited by the forks
        cp1, cp2 = runs(name, scripts, data)
    assert cp1.losses[1] == pytest.approx(cp2.losses[1], rel=RTOL)  # the same batch: the logged loss is global
    assert abs(cp2.grad_norms[1] - cp1.grad_norms[1]) > RTOL * cp1.grad_norms[1], (cp1, cp2)
    assert largest_relative_difference(cp2, cp1) > 10 * RTOL
    cp1, cp2 = runs(name, scripts, data, PER_TOKEN)
    assert_same_training(cp2, cp1, RTOL)


@pytest.mark.parametrize("route", ["patched", "--spec"])
@pytest.mark.parametrize("name", CP_DEPENDENT)
def test_cp_dependent_launches_stop_every_rank_naming_the_flag(scripts, data, name, route):
    """The refusal, on every rank before any collective of the library: at config time on the patched route, in
    the spec function (which every rank calls) on the --spec route."""
    kind, flags, _, _ = ROUTES[name]
    if route == "patched":
        script, cp = scripts["patched"], CP2_2D
    else:
        cp = ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "1", "2"]
        script, cp = scripts["stock"], SPEC_2D + cp + ["--cp-comm-type", "2d"]
    uneven = " and ".join(f for f in ("--sft", "--eod-mask-loss") if f in flags)
    message = (
        f"{uneven} at --context-parallel-size 2 (cp_comm_type ['2d']) needs --calculate-per-token-loss: without it "
        f"Megatron divides each CP rank's loss by that rank's own count of loss tokens"
    )
    for rank, outcome in enumerate(run_pretrain_outcomes(2, script, data[kind] + flags + cp, timeout_s=90)):
        assert outcome.exit_status != 0 and message in (outcome.error or ""), f"rank {rank}: {outcome.error}"
