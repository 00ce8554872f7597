"""Stock Megatron context parallelism through megatron-core and pretrain_gpt.py on CPU ranks, and the user's
migration from it to 2D.

Stock CP here is megatron-core's own ``TEDotProductAttention`` over Transformer Engine's ``context_parallel.py``
(megatron_2d_dev.te_context_parallel; the release loaded once in the parent, the forked ranks inherit it), with
megatron-core's local linears and norms (megatron_2d_dev.stock_cp_spec). TE's fused attention takes bf16, so
the runs are bf16 and compared with the table's bf16 training bounds (``TOLERANCES[bf16].training``):
  * the tiny GPT (megatron_2d_dev.tiny_gpt) at CP 2 and 4, every comm type (p2p, a2a, a2a+p2p [2, 2],
    all_gather), equals CP = 1 in loss, grad norm and every gradient (TE 2.12.0 and 2.20.2);
  * Megatron-LM's unpatched pretrain_gpt.py with the stock CP flags of ``make pretrain-stock-cpu`` (CP 4, a2a+p2p
    [2, 2]) logs the losses and grad norms of CP = 1;
  * its checkpoint at iteration 2 resumes under 2D (the same flags with ``--spec ... gpt_layer_spec_2d
    --cp-comm-type 2d``, outside TE's context) and iterations 3-4 log what the stock run logged.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev import tiny_gpt as tg
from megatron_2d_dev.megatron_lm import copy_scripts
from megatron_2d_dev.pretrain_runs import assert_same_training, run_pretrain, trained
from megatron_2d_dev.stock_cp_spec import gpt_layer_spec_stock_cp
from megatron_2d_dev.te_context_parallel import te_context_parallel_on_cpu

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[1]
BF16 = TOLERANCES[torch.bfloat16].training
NEWEST = "2.20.2"

LAYOUTS = [  # (CP, cp_comm_type, hierarchical sizes, K/V heads of the 4 query heads: a2a needs CP to divide them)
    (2, "p2p", None, 2),
    (4, "p2p", None, 2),
    (2, "a2a", None, 2),
    (4, "a2a", None, 4),
    (4, "a2a+p2p", [2, 2], 2),
    (4, "all_gather", None, 2),
]


def tiny_run(rank, world, version, cp, comm, hierarchical, groups, qk_clip=False):
    """One forward and backward of the tiny GPT; with ``qk_clip`` each layer's current_max_attn_logits too (what
    TEDotProductAttention keeps from TE's return_max_logit)."""
    with te_context_parallel_on_cpu(version, megatron=True) as te:
        tg.init_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical)
        cfg = tg.TinyGPTConfig(
            num_query_groups=groups,
            cp_comm_type=comm,
            config_overrides={"bf16": True, "params_dtype": torch.bfloat16, **({"qk_clip": True} if qk_clip else {})},
        )
        spec = tg.local_spec_with_core_attention(te.megatron_extension.TEDotProductAttention)
        model = tg.build_tiny_gpt(cfg, spec)
        te.extension.calls.clear()
        result = tg.forward_backward(model, tg.synthetic_batch(cfg))
        result["calls"] = dict(te.extension.calls)
        if qk_clip:
            result["max_logits"] = [
                layer.self_attention.core_attention.current_max_attn_logits.float() for layer in model.decoder.layers
            ]
        return result


@pytest.mark.distributed
@pytest.mark.parametrize("version, layouts", [("2.12.0", [LAYOUTS[1], LAYOUTS[4]]), (NEWEST, LAYOUTS)])
def test_tiny_gpt_stock_cp_equals_cp1(version, layouts):
    """megatron-core's TEDotProductAttention with stock CP: loss, grad norm and every gradient of CP = 1 (every
    layout on the newest release, p2p and a2a+p2p at CP 4 on 2.12.0)."""
    with te_context_parallel_on_cpu(version, megatron=True):
        references = {g: run_on_ranks(1, tiny_run, version, 1, None, None, g)[0] for _, _, _, g in layouts}
        outcomes = [
            run_on_ranks(cp, tiny_run, version, cp, comm, hier, groups, timeout_s=120)[0]
            for cp, comm, hier, groups in layouts
        ]
    bad = {}
    for (cp, comm, _, groups), got in zip(layouts, outcomes):
        errors = tg.compare_results(got, references[groups])
        grads = max(v for k, v in errors.items() if k.startswith("grad:"))
        if not (errors["loss"] < BF16.loss and errors["grad_norm"] < BF16.grad_norm and grads < BF16.grad):
            bad[(cp, comm)] = (errors["loss"], errors["grad_norm"], grads)
        assert got["calls"]["fused_attn_fwd"] > 0 and got["calls"]["fused_attn_bwd"] > 0, (cp, comm, got["calls"])
    assert not bad, bad


@pytest.mark.distributed
def test_tiny_gpt_stock_cp_keeps_the_max_logit_of_cp1():
    """qk_clip with stock CP (TE 2.20.2's return_max_logit through megatron-core's TEDotProductAttention, the CPU
    extension emitting cuDNN's Max statistic): every rank's current_max_attn_logits of every layer equals CP = 1's
    within one bf16 rounding of each (2^-7 relative), at CP 4 with p2p, a2a and a2a+p2p [2, 2]."""
    layouts = [LAYOUTS[1], LAYOUTS[3], LAYOUTS[4]]
    with te_context_parallel_on_cpu(NEWEST, megatron=True):
        references = {g: run_on_ranks(1, tiny_run, NEWEST, 1, None, None, g, True)[0] for *_, g in layouts}
        outcomes = {
            (cp, comm): (groups, run_on_ranks(cp, tiny_run, NEWEST, cp, comm, hier, groups, True, timeout_s=120))
            for cp, comm, hier, groups in layouts
        }
    bad = {}
    for key, (groups, ranks) in outcomes.items():
        expected = references[groups]["max_logits"]
        assert len(expected) == 2 and all(m.shape == (4,) for m in expected)
        errors = [
            ((got - want).abs().max() / want.abs().max()).item()
            for result in ranks
            for got, want in zip(result["max_logits"], expected)
        ]
        if not max(errors) <= 2**-7:
            bad[key] = errors
    assert not bad, bad


def test_stock_spec_refuses_fp32_and_a_missing_te():
    config = SimpleNamespace(params_dtype=torch.float32, bf16=False, fp16=False)
    with pytest.raises(ValueError, match="add --bf16 or --fp16"):
        gpt_layer_spec_stock_cp(config)
    with pytest.raises(RuntimeError, match="te_context_parallel_on_cpu"):  # no TE in this process
        gpt_layer_spec_stock_cp(SimpleNamespace(params_dtype=torch.bfloat16, bf16=True, fp16=False))


# ---- pretrain_gpt.py ----------------------------------------------------------------------------------------------


def make_flags(**env) -> list[str]:
    """The flags of tools/pretrain_gpt_cpu.sh (what ``make pretrain-stock-cpu`` trains with STOCK_CP=a2a+p2p)."""
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "pretrain_gpt_cpu.sh"), "--print-flags"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    return out.stdout.split("\n")[:-1]


@pytest.fixture(scope="module")
def stock_script(tmp_path_factory):
    """A temporary copy of the unpatched pretrain_gpt.py, imported once so that forked ranks find it loaded."""
    path = copy_scripts(tmp_path_factory.mktemp("megatron_lm") / "stock")
    sys.path.insert(0, str(path.parent))
    importlib.import_module("pretrain_gpt")
    yield path
    sys.path.remove(str(path.parent))
    for name in ("pretrain_gpt", "gpt_builders", "model_provider"):
        sys.modules.pop(name, None)


def assert_close(got, expected, iterations) -> None:
    """bf16 bounds: the loss every iteration, the grad norm at iteration 1 and after updates."""
    assert_same_training(got, expected, BF16.loss, [i for i in iterations if i == 1], BF16.grad_norm)
    assert_same_training(got, expected, BF16.loss, [i for i in iterations if i > 1], BF16.later_grad_norm)


@pytest.mark.distributed
def test_pretrain_gpt_stock_cp_equals_cp1_and_resumes_under_2d(stock_script, tmp_path, monkeypatch):
    from megatron_2d.megatron.core_attention import CoreAttention2D

    original = CoreAttention2D.__init__

    def init(self, *args, **kwargs):  # each 2d layer a forked rank builds says so in its log
        original(self, *args, **kwargs)
        print(f"[test] 2d layer {self.layer_number}: {self.settings}")

    monkeypatch.setattr(CoreAttention2D, "__init__", init)
    stock = make_flags(STOCK_CP="a2a+p2p")
    assert stock[stock.index("--cp-comm-type") + 1] == "a2a+p2p" and "--hierarchical-context-parallel-sizes" in stock
    ckpt = tmp_path / "ckpt"
    with te_context_parallel_on_cpu(NEWEST, megatron=True):
        reference = trained(run_pretrain(1, stock_script, make_flags(STOCK_CP="a2a+p2p", CP="1"))[-1])
        first = trained(run_pretrain(4, stock_script, stock + ["--save", str(ckpt), "--save-interval", "2"])[-1])
    assert reference.losses[4] < reference.losses[1]  # it learns: the comparisons are not vacuous
    assert_close(first, reference, range(1, 5))
    # the migration: the same model and flags, the 2D spec and cp_comm_type instead of TE's, from iteration 2
    flags = list(stock)
    flags[flags.index("--spec") + 1 : flags.index("--spec") + 3] = ["megatron_2d.megatron.spec", "gpt_layer_spec_2d"]
    flags[flags.index("--cp-comm-type") + 1] = "2d"
    logs = run_pretrain(4, stock_script, flags + ["--load", str(ckpt), "--ckpt-step", "2"])
    assert f"loading distributed checkpoint from {ckpt} at iteration 2" in logs[0]
    assert "[test] 2d layer 2: Settings2D(context_parallel_size=4, head_parallel_size=2" in logs[0]
    resumed = trained(logs[-1])
    assert sorted(resumed.losses) == [3, 4]
    assert_close(resumed.per_iteration(), first.per_iteration(), [3, 4])
