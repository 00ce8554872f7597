"""Megatron's sliding windows (window_size + window_attn_skip_freq) and attention sinks (softmax_type) under 2D.

The reference is stock megatron-core at CP=1 with the same config (its local DotProductAttention applies the
window mask and SoftmaxOne). Every 2D layout must give the same per-token loss and every gradient, the sink
parameter's included (fp32, 1e-5 relative). The CP=1 references run on a world of one rank, every 2D layout in one
fork of 8 ranks.
"""

from __future__ import annotations

import pytest

from megatron_2d.megatron import TransformerConfig2D, destroy_2d_groups, get_gpt_layer_spec_2d
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev import tiny_gpt as tg

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

RTOL = 1e-5
BASE = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=256)
MODELS = {
    # layers 1 and 3 windowed (12 tokens back: shorter than a zigzag chunk at CP=8), layers 2 and 4 full
    "sliding_window": dict(num_layers=4, seed=21, overrides=dict(window_size=(12, 0), window_attn_skip_freq=2)),
    # a window over several chunks on every layer (list form of window_attn_skip_freq)
    "wide_window": dict(num_layers=2, seed=22, overrides=dict(window_size=(70, 0), window_attn_skip_freq=[1, 1])),
    # gpt-oss style: learnable sinks, windowed and full layers alternating
    "learnable_sinks": dict(
        num_layers=2, seed=23, overrides=dict(softmax_type="learnable", window_size=(40, 0), window_attn_skip_freq=2)
    ),
    "off_by_one": dict(num_layers=2, seed=24, overrides=dict(softmax_type="off-by-one")),
    # honoured settings with no effect on the math: query-key layer scaling, and Megatron's selective recompute of
    # core attention (it re-runs CoreAttention2D under its checkpoint)
    "qk_layer_scaling_selective_recompute": dict(
        num_layers=2,
        seed=25,
        overrides=dict(
            apply_query_key_layer_scaling=True,
            window_size=(12, 0),
            recompute_granularity="selective",
            recompute_modules=["core_attn"],
        ),
    ),
}
# name -> (CP size, (hp, Double-Ring inner ring size, placement))
LAYOUTS = {
    "cp4_2x2_w2_head_first": (4, (2, 2, "head_first")),
    "cp8_1x8_w2": (8, (1, 2, "head_first")),
    "cp8_4x2_context_first": (8, (4, 1, "context_first")),
}


def config_of(name, layout=None):
    model = MODELS[name]
    cfg = tg.TinyGPTConfig(
        **BASE, num_layers=model["num_layers"], seed=model["seed"], config_overrides=dict(model["overrides"])
    )
    if layout is not None:
        hp, w, placement = LAYOUTS[layout][1]
        cfg.config_class, cfg.cp_comm_type = TransformerConfig2D, "2d"
        cfg.config_overrides.update(cp_2d_head_parallel_size=hp, cp_2d_inner_ring_size=w, cp_2d_placement=placement)
    return cfg


def run_references(rank, world):
    """The CP = 1 references, on a world of one rank: at CP = 1 every rank of a larger world computed the same."""
    tg.init_parallel()
    out = {}
    for name in MODELS:
        ref = config_of(name)
        out[("ref", name)] = tg.forward_backward(tg.build_tiny_gpt(ref), tg.synthetic_batch(ref))
    off = config_of("sliding_window")
    off.config_overrides = {}
    out["window_off"] = tg.forward_backward(tg.build_tiny_gpt(off), tg.synthetic_batch(off))
    return out


def run_all(rank, world):
    spec = get_gpt_layer_spec_2d(use_transformer_engine=False)
    out = {}
    for name in MODELS:
        for layout, (cp, _) in LAYOUTS.items():
            tg.init_parallel(context_parallel_size=cp)
            cfg = config_of(name, layout)
            out[(layout, name)] = tg.forward_backward(tg.build_tiny_gpt(cfg, spec), tg.synthetic_batch(cfg))
    # Selective Checkpoint++ (full recompute that skips attention) keeps the sinks' gradient
    tg.init_parallel(context_parallel_size=4)
    cfg = config_of("learnable_sinks", "cp4_2x2_w2_head_first")
    cfg.config_overrides.update(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        selective_checkpoint_plus_plus=True,
    )
    out["ckpt++"] = tg.forward_backward(tg.build_tiny_gpt(cfg, spec), tg.synthetic_batch(cfg))
    destroy_2d_groups()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(1, run_references, timeout_s=400)[0] | run_on_ranks(8, run_all, timeout_s=400)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_matches_megatron_at_cp1(results, name, layout):
    actual, expected = results[(layout, name)], results[("ref", name)]
    assert set(actual["grads"]) == set(expected["grads"])
    sinks = [g for g in expected["grads"] if g.endswith("softmax_offset")]
    assert len(sinks) == (2 if name == "learnable_sinks" else 0)  # the sink parameter, one per layer
    errors = tg.compare_results(actual, expected)
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, f"relative errors above {RTOL}: {bad}"


def test_checkpoint_plus_plus_keeps_the_sink_gradient(results):
    errors = tg.compare_results(results["ckpt++"], results[("ref", "learnable_sinks")])
    sink_errors = {k: e for k, e in errors.items() if "softmax_offset" in k}
    assert len(sink_errors) == 2, errors
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, bad


def test_the_window_changes_the_answer(results):
    """The same model without its window gives different gradients, so the parity above is not vacuous."""
    errors = tg.compare_results(results["window_off"], results[("ref", "sliding_window")])
    assert max(errors.values()) > 1e-3, errors
