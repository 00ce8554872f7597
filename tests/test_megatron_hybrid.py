"""The "2d" backend inside megatron-core's HybridModel: 2D attention layers beside Megatron's own Mamba and GDN
layers (with their own all-to-all context parallelism over the whole CP group) train exactly as at CP=1.

The reference is stock megatron-core at CP=1: Megatron's local hybrid stack spec with its DotProductAttention. Every
layout (CP=4 as hp 2 x cp 2; CP=8 as hp 2 x cp 4, Double-Ring inner ring size 2) must give the same per-token loss and
every parameter gradient (fp32, 1e-5 relative). Mamba/GDN kernels are the CPU stand-ins of megatron_2d_dev.ssm_cpu
(tests/test_ssm_cpu.py checks them). All cases run in ONE fork of 8 ranks.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev import tiny_gpt as tg
from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

pytestmark = pytest.mark.megatron

install_hybrid_cpu_shims()

from megatron_2d.megatron import destroy_2d_groups  # noqa: E402
from megatron_2d.megatron.core_attention import CoreAttention2D  # noqa: E402
from megatron_2d.megatron.hybrid_spec import check_hybrid_layers, get_hybrid_stack_spec_2d, hybrid_stack_spec_2d_local  # noqa: E402
from megatron_2d_dev import tiny_hybrid as th  # noqa: E402

WORLD = 8
RTOL = 1e-5
PATTERNS = ["*-*-", "M*-M*-", "G*-"]
LAYOUTS = {"cp4 = hp 2 x cp 2": (4, (2, 1, "head_first")), "cp8 = hp 2 x cp 4, w 2": (8, (2, 2, "context_first"))}
WINDOW = dict(window_size=(8, 0))
CASES = {  # name -> (pattern, TinyGPTConfig fields of both runs, config fields of the 2D run only)
    # one entry per hybrid layer, as megatron-core 0.19 indexes them: attention layers are layers 1 and 3
    "window list [1, 0, 0, 0]": ("*-*-", dict(config_overrides=dict(WINDOW, window_attn_skip_freq=[1, 0, 0, 0])), {}),
    "window skip frequency 2": ("*-*-", dict(config_overrides=dict(WINDOW, window_attn_skip_freq=2)), {}),
    "cp_comm_type per hybrid layer": ("*-*-", {}, dict(cp_comm_type=["2d", "p2p", "2d", "p2p"])),
    "Mamba without the memory-efficient path": (
        "M*-M*-",
        dict(config_overrides=dict(use_mamba_mem_eff_path=False)),
        {},
    ),
}


def windows_of(model):
    return {m.layer_number: m.sliding_window for m in model.modules() if isinstance(m, CoreAttention2D)}


def run_all(rank, world):
    out = {}
    for pattern in PATTERNS:
        tg.init_parallel()
        cfg = th.tiny_hybrid_config(pattern)
        out[("ref", pattern)] = tg.forward_backward(
            th.build_tiny_hybrid(cfg, pattern, th.megatron_local_stack_spec()), tg.synthetic_batch(cfg)
        )
        for layout, (cp, settings) in LAYOUTS.items():
            tg.init_parallel(context_parallel_size=cp)
            cfg = th.tiny_hybrid_config(pattern, settings)
            model = th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local)
            out[(layout, pattern)] = tg.forward_backward(model, tg.synthetic_batch(cfg))
    for name, (pattern, fields, fields_2d) in CASES.items():
        tg.init_parallel()
        cfg = th.tiny_hybrid_config(pattern, **fields)
        out[("ref", name)] = tg.forward_backward(
            th.build_tiny_hybrid(cfg, pattern, th.megatron_local_stack_spec()), tg.synthetic_batch(cfg)
        )
        tg.init_parallel(context_parallel_size=4)
        cfg = th.tiny_hybrid_config(pattern, (2, 1, "head_first"), **fields)
        cfg.cp_comm_type = fields_2d.get("cp_comm_type", cfg.cp_comm_type)
        model = th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local)
        out[("windows", name)] = windows_of(model)
        out[("cp4", name)] = tg.forward_backward(model, tg.synthetic_batch(cfg))
    # a few Adam steps of the Mamba hybrid at CP=8 against CP=1
    pattern = "M*-M*-"
    tg.init_parallel()
    cfg = th.tiny_hybrid_config(pattern)
    out["ref_train"] = tg.train_steps(th.build_tiny_hybrid(cfg, pattern, th.megatron_local_stack_spec()), cfg, steps=3)
    tg.init_parallel(context_parallel_size=8)
    cfg = th.tiny_hybrid_config(pattern, (2, 2, "head_first"))
    out["train"] = tg.train_steps(th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local), cfg, steps=3)
    # HybridStack2D checks the Mamba heads against the CP group before Megatron's own assertion
    cfg = th.tiny_hybrid_config(pattern, (2, 2, "head_first"), config_overrides=dict(mamba_num_heads=4))
    try:
        th.build_tiny_hybrid(cfg, pattern, hybrid_stack_spec_2d_local)
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    destroy_2d_groups()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, run_all, timeout_s=400)[0]


GRAD_RTOL = TOLERANCES[torch.float32].training.grad  # a parameter's gradient, as the generated configurations


def assert_matches(actual, expected):
    """Loss and gradient norm within RTOL; each parameter's gradient within the table's fp32 training bound (Mamba's
    conv1d weight gradient sums many rounded terms: 1.16e-5 on one machine, under 1e-5 on another)."""
    errors = tg.compare_results(actual, expected)
    bad = {k: e for k, e in errors.items() if not e < (GRAD_RTOL if k.startswith("grad:") else RTOL)}
    assert not bad, f"relative errors above {RTOL} (loss, grad norm) or {GRAD_RTOL} (gradients): {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_model_matches_cp1(results, layout, pattern):
    actual, expected = results[(layout, pattern)], results[("ref", pattern)]
    assert actual["per_token_loss"].shape == expected["per_token_loss"].shape
    families = {"M": "mixer.", "G": "self_attention.in_proj", "*": "self_attention.linear_qkv"}
    assert all(any(families[s] in name for name in expected["grads"]) for s in set(pattern) - {"-"})
    assert_matches(actual, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_per_layer_settings_follow_megatron_hybrid_numbering(results, name):
    assert_matches(results[("cp4", name)], results[("ref", name)])
    windows = results[("windows", name)]
    assert set(windows) == {1, 3} if CASES[name][0] == "*-*-" else {2, 5}
    if name == "window list [1, 0, 0, 0]":
        assert windows[1] is not None and windows[3] is None
    if name == "window skip frequency 2":  # 1 % 2 and 3 % 2 are not 0: both attention layers are windowed
        assert windows[1] is not None and windows[3] is not None


@pytest.mark.distributed
def test_mamba_hybrid_trains_like_cp1(results):
    """Three Adam steps (lr 1e-2) at CP=8 against CP=1: the losses within RTOL, the gradient norms within the table's
    training bounds (iteration 1's, then the later ones': Adam turns the rounding-level differences of gradient
    elements near zero into whole updates, so the later norms move further; docs/testing.md)."""
    actual, expected = results["train"], results["ref_train"]
    tol = TOLERANCES[torch.float32].training
    assert expected.losses[0] != expected.losses[-1]
    for a, e in zip(actual.losses, expected.losses):
        assert abs(a - e) <= RTOL * abs(e), (actual, expected)
    norm_errors = [abs(a - e) / e for a, e in zip(actual.grad_norms, expected.grad_norms)]
    assert len(norm_errors) == 3 and norm_errors[0] <= tol.grad_norm, norm_errors
    assert max(norm_errors[1:]) <= tol.later_grad_norm, norm_errors


@pytest.mark.distributed
def test_mamba_heads_that_do_not_divide_over_the_cp_group_are_refused_at_construction(results):
    assert results["refusal"].startswith(
        "Mamba layers split their heads over the whole CP group: 4 Mamba heads / TP 1 = 4 per TP rank do not "
        "divide by context_parallel_size 8 (hp x cp); CP sizes Mamba can run: [1, 2, 4]"
    )


def hybrid_config(**fields):
    base = dict(
        tensor_model_parallel_size=1,
        context_parallel_size=8,
        hidden_size=64,
        mamba_head_dim=16,
        mamba_num_heads=None,
        mamba_num_groups=2,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        cp_2d_packing="zigzag",
    )
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, layers, message",
    [
        (
            dict(mamba_num_groups=3, mamba_num_heads=24),
            "M*",
            r"mamba_num_groups 3 / TP 1 = 3 per TP rank and context_parallel_size 8 divide neither way",
        ),
        (
            dict(tensor_model_parallel_size=2),
            "M*",
            r"8 Mamba heads / TP 2 = 4 per TP rank do not divide by "
            r"context_parallel_size 8 .* \[1, 2, 4\]",
        ),
        (dict(linear_num_key_heads=4), "G*", r"4 key / 16 value heads / TP 1 = 4 / 16 per TP rank do not both divide"),
        (
            dict(cp_2d_packing="documents"),
            "M*G-",
            r"cp_2d_packing='documents' cannot run a model with GDN \(G\) and "
            r"Mamba \(M\) layers",
        ),
    ],
)
def test_hybrid_layer_checks_name_the_values(fields, layers, message):
    with pytest.raises(ValueError, match=message):
        check_hybrid_layers(hybrid_config(**fields), layers)


def test_attention_only_patterns_pass_any_check():
    check_hybrid_layers(hybrid_config(cp_2d_packing="documents", mamba_num_groups=3), "*-*-")


def test_specs_are_megatrons_with_the_2d_core_attention():
    from megatron.core.models.hybrid import hybrid_layer_specs

    from megatron_2d.megatron import hybrid_spec

    stock = hybrid_layer_specs.hybrid_stack_spec
    te = hybrid_spec.hybrid_stack_spec_2d_te
    core = te.submodules.attention_layer.submodules.self_attention.submodules.core_attention
    assert core.module is CoreAttention2D
    assert stock.submodules.attention_layer.submodules.self_attention.submodules.core_attention is not core
    assert te.submodules.mamba_layer.submodules.mixer.module is stock.submodules.mamba_layer.submodules.mixer.module
    assert (
        te.submodules.gdn_layer.submodules.self_attention.module
        is stock.submodules.gdn_layer.submodules.self_attention.module
    )
    assert get_hybrid_stack_spec_2d(
        False, head_parallel_size=2
    ).submodules.attention_layer.submodules.self_attention.submodules.core_attention.params == {"head_parallel_size": 2}
