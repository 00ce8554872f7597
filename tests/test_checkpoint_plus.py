"""Selective Checkpoint++: full-layer recompute that keeps attention from the forward pass.

Against the same model without recompute: equal gradients (fp32, 1e-6), the attention forward (the ring Function)
run once per layer per micro-batch, no extra all-to-all or ring bytes (so none in the recompute pass), kept
tensors released after backward with no growth over steps; with megatron's uniform and block recompute, under
the pipeline schedule with several micro-batches in flight. All cases run in one fork of 4 ranks.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megatron_2d import ring_attention  # noqa: E402
from megatron_2d.megatron import (  # noqa: E402
    TransformerConfig2D,
    checkpoint_plus,  # noqa: E402
    get_gpt_layer_spec_2d,
)
from megatron_2d.testing import tiny_gpt as tg
from megatron_2d.testing.distributed import run_on_ranks

RTOL = 1e-6
LAYERS = 2
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "ckpt++_uniform": dict(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        selective_checkpoint_plus_plus=True,
    ),
    # block: only the first layer of each stage is checkpointed; the other runs plain attention
    "ckpt++_block": dict(
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
        selective_checkpoint_plus_plus=True,
    ),
}


def model_config(recompute, hp, micro_batch_size=2, **kwargs):
    cfg = tg.TinyGPTConfig(
        num_layers=LAYERS,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        seq_length=64,
        micro_batch_size=micro_batch_size,
        config_class=TransformerConfig2D,
        cp_comm_type="2d",
        **kwargs,
    )
    cfg.config_overrides = dict(cp_2d_head_parallel_size=hp, cp_2d_ring_window=1, **RECOMPUTE[recompute])
    return cfg


class Counters:
    """Counts ring-attention forwards (the attention forward: its kernels and ring traffic)."""

    def __init__(self):
        self.forwards = 0
        original_forward = ring_attention.RingAttention.forward

        def counting_forward(ctx, *args):
            self.forwards += 1
            return original_forward(ctx, *args)

        ring_attention.RingAttention.forward = staticmethod(counting_forward)
        self._original_forward = original_forward

    def restore(self):
        ring_attention.RingAttention.forward = staticmethod(self._original_forward)


def keepers(model):
    return [layer.self_attention.core_attention.keeper for layer in model.decoder.layers]


def watch_kept(model, refs):
    """Weak references to every kept output, collected after each forward."""
    for keeper in keepers(model):
        if keeper is not None:
            refs.extend(weakref.ref(entry.output) for entry in keeper._fifo)


def run_case(recompute, counters, pipeline=False):
    cfg = model_config(recompute, hp=2, micro_batch_size=4 if pipeline else 2)
    model = tg.build_tiny_gpt(cfg, get_gpt_layer_spec_2d(use_transformer_engine=False))
    groups = model.decoder.layers[0].self_attention.core_attention.groups
    groups.comm_bytes.reset()
    counters.forwards = 0
    if pipeline:
        result = tg.pipeline_forward_backward(model, cfg, tg.synthetic_batch(cfg), num_microbatches=4)
    else:
        result = tg.forward_backward(model, tg.synthetic_batch(cfg))
    result["forwards"] = counters.forwards
    result["bytes"] = groups.comm_bytes.as_dict()
    result["kept_after"] = [len(k) for k in keepers(model) if k is not None]
    return result, model, cfg


def run_all(rank, world):
    counters = Counters()
    out = {}
    tg.init_parallel(context_parallel_size=4)
    for recompute in RECOMPUTE:
        out[recompute] = run_case(recompute, counters)[0]
    # several steps: every kept tensor is released after its backward, nothing accumulates
    _, model, cfg = run_case("ckpt++_uniform", counters)
    refs, lengths = [], []
    original_call = checkpoint_plus.AttentionKeeper.__call__

    def watching_call(self, *args):
        result = original_call(self, *args)
        watch_kept(model, refs)
        return result

    checkpoint_plus.AttentionKeeper.__call__ = watching_call
    for step in range(3):
        tg.forward_backward(model, tg.synthetic_batch(cfg, step))
        gc.collect()
        lengths.append([len(k) for k in keepers(model)])
    checkpoint_plus.AttentionKeeper.__call__ = original_call
    out["steps"] = {"lengths": lengths, "watched": len(refs), "alive": sum(r() is not None for r in refs)}
    # pipeline schedule: PP=2 x CP=2 (2 x 1), 4 micro-batches in flight through 1F1B
    tg.init_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)
    for recompute in ("none", "ckpt++_uniform"):
        out[("pp", recompute)] = run_case(recompute, counters, pipeline=True)[0]
    counters.restore()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(4, run_all, timeout_s=240)[0]


def assert_same_gradients(actual, expected):
    assert set(actual["grads"]) == set(expected["grads"]) and len(expected["grads"]) >= 20
    for name, grad in expected["grads"].items():
        assert tg.max_relative_error(actual["grads"][name], grad) < RTOL, name


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", ["full", "ckpt++_uniform", "ckpt++_block"])
def test_gradients_equal_no_recompute(results, recompute):
    assert_same_gradients(results[recompute], results["none"])
    assert abs(float(results[recompute]["loss"]) - float(results["none"]["loss"])) <= RTOL * float(
        results["none"]["loss"]
    )


@pytest.mark.distributed
def test_attention_forward_runs_once_per_layer(results):
    assert results["none"]["forwards"] == LAYERS
    assert results["full"]["forwards"] == 2 * LAYERS  # plain full recompute runs attention twice
    assert results["ckpt++_uniform"]["forwards"] == LAYERS
    assert results["ckpt++_block"]["forwards"] == LAYERS


@pytest.mark.distributed
def test_no_communication_in_the_recompute_pass(results):
    none, full = results["none"]["bytes"], results["full"]["bytes"]
    assert none["all_to_all"] > 0 and none["outer_ring"] > 0
    assert full["all_to_all"] > none["all_to_all"] and full["outer_ring"] > none["outer_ring"]
    for recompute in ("ckpt++_uniform", "ckpt++_block"):
        assert results[recompute]["bytes"] == none, recompute


@pytest.mark.distributed
def test_kept_tensors_are_released(results):
    for recompute in ("ckpt++_uniform", "ckpt++_block"):
        assert results[recompute]["kept_after"] == [0] * LAYERS
    steps = results["steps"]
    assert steps["lengths"] == [[0] * LAYERS] * 3
    assert steps["watched"] >= 3 and steps["alive"] == 0


@pytest.mark.distributed
def test_pipeline_schedule_with_micro_batches_in_flight(results):
    ckpt, none = results[("pp", "ckpt++_uniform")], results[("pp", "none")]
    assert_same_gradients(ckpt, none)
    assert ckpt["forwards"] == none["forwards"] == 4 * LAYERS // 2  # 4 micro-batches x this stage's layer
    assert ckpt["bytes"] == none["bytes"] and ckpt["kept_after"] == [0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(), r"recompute_granularity is None; set recompute_granularity='full'"),
        (dict(recompute_granularity="selective"), r"recompute_granularity is 'selective'"),
    ],
)
def test_misuse_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig2D(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=8,
            attention_dropout=0.0,
            selective_checkpoint_plus_plus=True,
            **overrides,
        )


# ---- the keeper alone (one process): replay, and refusal of a recompute that differs --------------------------


def _attention(q, k, v):
    from megatron_2d.testing.reference import reference_attention

    return reference_attention(q, k, v, True, 0.25)


def _first_pass(keeper, q, k, v):
    """What megatron's checkpointed forward does: the layer under no_grad, inside its checkpoint."""
    with torch.no_grad():
        return keeper(_attention, q, k, v)


@pytest.fixture
def checkpointing(monkeypatch):
    monkeypatch.setattr(checkpoint_plus, "is_checkpointing", lambda: True)


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_keeper_replays_the_first_pass(checkpointing):
    keeper = checkpoint_plus.AttentionKeeper()
    q, k, v = _qkv(0)
    first = _first_pass(keeper, q, k, v)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = keeper(_attention, *leaves)  # the recompute pass: grad enabled
    dout = torch.randn_like(out)
    out.backward(dout)
    plain = [x.clone().requires_grad_(True) for x in (q, k, v)]
    _attention(*plain).backward(dout)
    assert torch.equal(out, first) and len(keeper) == 0
    for got, want in zip(leaves, plain):
        assert torch.allclose(got.grad, want.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_recompute_that_differs_is_refused(checkpointing, which):
    """A recomputed input that is not the first pass's (here: another micro-batch's q, k or v) must raise, not
    silently return the kept output of different inputs."""
    keeper = checkpoint_plus.AttentionKeeper()
    q, k, v = _qkv(1)
    _first_pass(keeper, q, k, v)
    other = dict(zip("qkv", _qkv(2)))
    inputs = {"q": q, "k": k, "v": v, which: other[which]}
    with pytest.raises(RuntimeError, match=f"the recomputed {which} differs from the first pass"):
        keeper(_attention, *(inputs[n].requires_grad_(True) for n in "qkv"))


def test_recompute_differing_in_one_token_is_refused(checkpointing):
    """A recompute that differs in the last token only (e.g. a non-deterministic op near the end)."""
    keeper = checkpoint_plus.AttentionKeeper()
    q, k, v = _qkv(6)
    _first_pass(keeper, q, k, v)
    k2 = k.clone()
    k2[-1] += 1.0
    with pytest.raises(RuntimeError, match="the recomputed k differs from the first pass"):
        keeper(_attention, *(x.requires_grad_(True) for x in (q, k2, v)))


def test_recompute_out_of_order_is_refused(checkpointing):
    keeper = checkpoint_plus.AttentionKeeper()
    first, second = _qkv(3), _qkv(4)
    _first_pass(keeper, *first)
    _first_pass(keeper, *second)
    with pytest.raises(RuntimeError, match="differs from the first pass"):
        keeper(_attention, *(x.requires_grad_(True) for x in second))  # micro-batch 2 replayed first


def test_recompute_without_a_first_pass_is_refused(checkpointing):
    keeper = checkpoint_plus.AttentionKeeper()
    with pytest.raises(RuntimeError, match="found no kept attention"):
        keeper(_attention, *(x.requires_grad_(True) for x in _qkv(5)))


def _bf16_qkv(seed):
    return [x.bfloat16() for x in _qkv(seed)]


def _one_ulp_off(x):
    """x with every element moved by one bf16 ulp: what a recompute whose sums ran in another order gives."""
    return (x.view(torch.int16) + 1).view(torch.bfloat16)


@pytest.mark.parametrize("check", ["tolerance", "bitwise"])
def test_rounding_noise_passes_the_tolerance_check_only(checkpointing, check):
    """GPUs recompute MoE permutations with atomics, so a recompute may differ in the last bits: "tolerance"
    (default) accepts that, "bitwise" (the debug mode) refuses it; a replay of another micro-batch is refused by
    both."""

    def bf16_attention(q, k, v):
        return _attention(q.double(), k.double(), v.double()).bfloat16()

    keeper = checkpoint_plus.AttentionKeeper(check)
    q, k, v = _bf16_qkv(7)
    with torch.no_grad():
        keeper(bf16_attention, q, k, v)
    noisy = [_one_ulp_off(x).requires_grad_(True) for x in (q, k, v)]
    if check == "tolerance":
        keeper(bf16_attention, *noisy)
    else:
        with pytest.raises(
            RuntimeError,
            match=r"the recomputed q differs from the first pass \(max relative "
            r"difference .* allowed 0\)",
        ):
            keeper(bf16_attention, *noisy)
    with torch.no_grad():
        keeper(bf16_attention, q, k, v)
    with pytest.raises(RuntimeError, match=r"the recomputed q differs from the first pass"):
        keeper(bf16_attention, *(x.requires_grad_(True) for x in _bf16_qkv(8)))


def test_recompute_check_makes_no_host_sync(checkpointing):
    """The check runs under the hot-path guards (no scalar read, no torch.equal, no tensor from Python data); its
    verdict is read from host memory (on CUDA: a pinned copy, once landed)."""
    from megatron_2d.testing.no_sync import NoHostDataInOp, NoSyncOps

    keeper = checkpoint_plus.AttentionKeeper()
    q, k, v = _qkv(9)
    _first_pass(keeper, q, k, v)
    with NoHostDataInOp(), NoSyncOps():
        keeper(_attention, *(x.clone().requires_grad_(True) for x in (q, k, v)))
    with pytest.raises(AssertionError, match="hot path"), NoSyncOps():
        torch.equal(q, k)  # the guard catches what the old check did


def test_unknown_check_is_refused():
    with pytest.raises(ValueError, match=r"check 'exact' is not one of \['tolerance', 'bitwise'\]"):
        checkpoint_plus.AttentionKeeper("exact")
    with pytest.raises(ValueError, match=r"selective_checkpoint_plus_plus_check 'exact' is not one of"):
        TransformerConfig2D(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=8,
            attention_dropout=0.0,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            selective_checkpoint_plus_plus=True,
            selective_checkpoint_plus_plus_check="exact",
        )


def test_fp8_recompute_is_refused():
    from types import SimpleNamespace

    why = checkpoint_plus.check_checkpoint_plus_config(SimpleNamespace(recompute_granularity="full", fp8="hybrid"))
    assert why is not None and "not supported with fp8/fp4 recompute" in why
    assert checkpoint_plus.check_checkpoint_plus_config(SimpleNamespace(recompute_granularity="full")) is None
