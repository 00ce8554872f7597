"""The "2d" backend inside megatron-core: a tiny GPTModel trains exactly as at CP=1.

The reference is stock megatron-core at CP=1 (its local DotProductAttention). Every 2D layout must give the same
per-token loss and every parameter gradient (fp32, 1e-5 relative), the same pipeline-schedule results, and the
same losses over optimizer steps. All layouts run in ONE fork of 8 ranks (module fixture); each test asserts on
its part. Misconfigurations are tested to stop with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from megatron_2d.megatron import TransformerConfig2D, destroy_2d_groups, get_gpt_layer_spec_2d  # noqa: E402
from megatron_2d.testing.distributed import RankFailure, run_on_ranks
from megatron_2d_dev import tiny_gpt as tg

pytestmark = pytest.mark.megatron

WORLD = 8
RTOL = 1e-5

MODELS = {
    # MHA, RoPE, 2 layers, hidden 64, seq 128
    "mha": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128),
    # GQA with 2 K/V heads: hp=4 (and hp=2 under TP=2, one K/V head per TP rank) exceed the K/V heads -> replication
    "gqa": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=96, seed=77),
}
# name -> (init_parallel kwargs, 2D settings (hp, w, placement))
LAYOUTS = {
    "cp4_2x2_head_first_w2": (dict(context_parallel_size=4), (2, 2, "head_first")),
    "cp4_2x2_context_first_w1": (dict(context_parallel_size=4), (2, 1, "context_first")),
    "cp8_2x4_w2": (dict(context_parallel_size=8), (2, 2, "head_first")),
    "cp8_4x2_w2_context_first": (dict(context_parallel_size=8), (4, 2, "context_first")),
    "tp2_cp4_2x2": (dict(tensor_model_parallel_size=2, context_parallel_size=4), (2, 2, "head_first")),
}
PIPELINE = ("pp2_cp4_2x2", dict(pipeline_model_parallel_size=2, context_parallel_size=4), (2, 2, "head_first"))
TRAINING = ("cp8_2x4_w2", dict(context_parallel_size=8), (2, 2, "context_first"))


def model_config(name, settings=None):
    """TinyGPTConfig of a model; with 2D settings: TransformerConfig2D and cp_comm_type '2d'."""
    cfg = tg.TinyGPTConfig(**MODELS[name])
    if settings is not None:
        hp, w, placement = settings
        cfg.config_class = TransformerConfig2D
        cfg.cp_comm_type = "2d"
        cfg.config_overrides = dict(cp_2d_head_parallel_size=hp, cp_2d_inner_ring_size=w, cp_2d_placement=placement)
    return cfg


SPEC_2D = None


def spec_2d():
    global SPEC_2D
    if SPEC_2D is None:
        SPEC_2D = get_gpt_layer_spec_2d(use_transformer_engine=False)
    return SPEC_2D


def run_all(rank, world):
    out = {}
    for name in MODELS:
        tg.init_parallel()
        ref_cfg = model_config(name)
        out[("ref", name)] = tg.forward_backward(tg.build_tiny_gpt(ref_cfg), tg.synthetic_batch(ref_cfg))
        out[("ref_pipeline", name)] = tg.pipeline_forward_backward(
            tg.build_tiny_gpt(ref_cfg), ref_cfg, tg.synthetic_batch(ref_cfg)
        )
        # the 2d spec at CP=1 is plain attention
        out[("cp1_2d", name)] = tg.forward_backward(tg.build_tiny_gpt(ref_cfg, spec_2d()), tg.synthetic_batch(ref_cfg))
        for layout, (kwargs, settings) in LAYOUTS.items():
            tg.init_parallel(**kwargs)
            cfg = model_config(name, settings)
            out[(layout, name)] = tg.forward_backward(tg.build_tiny_gpt(cfg, spec_2d()), tg.synthetic_batch(cfg))
        layout, kwargs, settings = PIPELINE
        tg.init_parallel(**kwargs)
        cfg = model_config(name, settings)
        out[(layout, name)] = tg.pipeline_forward_backward(
            tg.build_tiny_gpt(cfg, spec_2d()), cfg, tg.synthetic_batch(cfg)
        )
    # softmax_scale from the config is honoured (the reference is Megatron's attention at CP=1 with the same scale)
    scaled = dict(MODELS["mha"], seed=5)
    tg.init_parallel()
    ref_cfg = tg.TinyGPTConfig(**scaled, config_overrides=dict(softmax_scale=0.05))
    out[("ref", "scaled")] = tg.forward_backward(tg.build_tiny_gpt(ref_cfg), tg.synthetic_batch(ref_cfg))
    tg.init_parallel(context_parallel_size=4)
    cfg = tg.TinyGPTConfig(
        **scaled,
        config_class=TransformerConfig2D,
        cp_comm_type="2d",
        config_overrides=dict(softmax_scale=0.05, cp_2d_head_parallel_size=2),
    )
    out[("cp4_2x2", "scaled")] = tg.forward_backward(tg.build_tiny_gpt(cfg, spec_2d()), tg.synthetic_batch(cfg))
    tg.init_parallel()
    ref_cfg = model_config("gqa")
    out[("ref_train", "gqa")] = tg.train_steps(tg.build_tiny_gpt(ref_cfg), ref_cfg, steps=3)
    layout, kwargs, settings = TRAINING
    tg.init_parallel(**kwargs)
    cfg = model_config("gqa", settings)
    out[("train", "gqa")] = tg.train_steps(tg.build_tiny_gpt(cfg, spec_2d()), cfg, steps=3)
    destroy_2d_groups()
    return out if rank == 0 else None


def run_core_attention_alone(rank, world):
    """CoreAttention2D built as Megatron builds it (CP=4 as 2x2, context_first, GQA), for AttnMaskType.no_mask and
    causal, with the config's softmax_scale and kernel: output and dq/dk/dv against the reference on the whole
    sequence."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_2d import shard_sequence
    from megatron_2d.testing.reference import reference_attention, rel_err

    tg.init_parallel(context_parallel_size=4)
    cfg = model_config("gqa", (2, 1, "context_first"))
    cfg.config_overrides["softmax_scale"] = 0.2
    cfg.config_overrides["cp_2d_kernel"] = "torch_math"  # the config's kernel, which every 2d layer runs
    config = tg.make_transformer_config(cfg)
    spec = spec_2d().submodules.self_attention.submodules.core_attention
    cp_rank = tg.parallel_state.get_context_parallel_rank()
    errors = {}
    for mask in (AttnMaskType.no_mask, AttnMaskType.causal):
        attention = spec.module(
            config=config,
            layer_number=1,
            attn_mask_type=mask,
            attention_type="self",
            cp_comm_type="2d",
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp", "cp"]),
            **spec.params,
        )
        assert attention.kernel == "torch_math"
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(64, 1, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (8, 2, 2))
        dout = torch.randn(64, 1, 8, 8, generator=g, dtype=torch.float64)
        expected = reference_attention(q, k, v, causal=mask == AttnMaskType.causal, scale=0.2)
        expected.backward(dout)
        shard = lambda x: shard_sequence(x.detach(), cp_rank, 4)  # noqa: E731
        ql, kl, vl = (shard(x).float().requires_grad_(True) for x in (q, k, v))
        out = attention(ql, kl, vl, None, attn_mask_type=mask)
        assert out.shape == (16, 1, 64)  # [s/CP, b, heads * d]
        out.backward(shard(dout).float().view(16, 1, 64))
        errors[mask.name] = max(
            rel_err(out.view(16, 1, 8, 8), shard(expected)),
            rel_err(ql.grad, shard(q.grad)),
            rel_err(kl.grad, shard(k.grad)),
            rel_err(vl.grad, shard(v.grad)),
        )
    destroy_2d_groups()
    return errors


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, run_all, timeout_s=300)[0]


def assert_matches(actual, expected):
    errors = tg.compare_results(actual, expected)
    assert set(actual["grads"]) == set(expected["grads"]) and len(expected["grads"]) >= 20
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, f"relative errors above {RTOL}: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", MODELS)
def test_2d_spec_at_cp1_matches_megatron_attention(results, name):
    assert_matches(results[("cp1_2d", name)], results[("ref", name)])


@pytest.mark.distributed
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_gradients_match_cp1(results, layout, name):
    actual, expected = results[(layout, name)], results[("ref", name)]
    assert actual["per_token_loss"].shape == expected["per_token_loss"].shape
    assert_matches(actual, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_schedule_matches_cp1(results, name):
    actual, expected = results[(PIPELINE[0], name)], results[("ref_pipeline", name)]
    assert abs(float(actual["loss"]) - float(expected["loss"])) <= RTOL * abs(float(expected["loss"]))
    assert set(actual["grads"]) == set(expected["grads"])
    for key, grad in expected["grads"].items():
        assert tg.max_relative_error(actual["grads"][key], grad) < RTOL, key
    assert abs(actual["grad_norm"] - expected["grad_norm"]) < RTOL * expected["grad_norm"]


@pytest.mark.distributed
def test_optimizer_steps_track_cp1(results):
    actual, expected = results[("train", "gqa")], results[("ref_train", "gqa")]
    assert len(actual.losses) == len(expected.losses) == 3 and expected.losses[0] != expected.losses[-1]  # it moves
    for a, e in zip(actual.losses + actual.grad_norms, expected.losses + expected.grad_norms):
        assert abs(a - e) <= 1e-5 * abs(e), (actual, expected)


# ---- misconfiguration: clear errors ------------------------------------------------------------------------

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    attention_dropout=0.0,
    context_parallel_size=4,
    cp_comm_type="2d",
)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(cp_2d_head_parallel_size=2, cp_2d_context_size=3),
            r"head-parallel size x context size = 2 x 3 = 6 does not equal context_parallel_size 4",
        ),
        (
            dict(num_attention_heads=6, num_query_groups=6, hidden_size=60, cp_2d_head_parallel_size=4),
            r"head-parallel size 4 does not divide the 6 attention heads per tensor-parallel rank .* "
            r"valid head-parallel sizes for context_parallel_size=4: \[1, 2\]",
        ),
        (
            dict(cp_2d_head_parallel_size=2, cp_2d_inner_ring_size=3),
            r"inner ring size 3 does not divide the context size cp = CP/hp = 4/2 = 2; "
            r"valid inner ring sizes: \[1, 2\]",
        ),
        (dict(cp_2d_head_parallel_size=3), r"head-parallel size 3 does not divide the context-parallel size 4"),
        (
            dict(cp_2d_head_parallel_size=2, cp_2d_placement="interleaved"),
            r"cp_2d_placement 'interleaved' is not valid; choose one of \['head_first', 'context_first'\]",
        ),
        (dict(), r"cp_comm_type '2d' needs a head-parallel size .* valid for context_parallel_size=4: \[1, 2, 4\]"),
        (
            dict(cp_2d_head_parallel_size=2, attention_dropout=0.1),
            r"attention_dropout=0.1: attention dropout is not supported",
        ),
        (
            dict(cp_comm_type="p2p", cp_2d_head_parallel_size=2),
            r"2D settings \{'cp_2d_head_parallel_size': 2\} are set but cp_comm_type is \['p2p'\]",
        ),
        (
            dict(cp_2d_head_parallel_size=2, cp_2d_kernel="flash_attn3"),
            r"cp_2d_kernel 'flash_attn3' is not one of \['te_fused', 'torch_cudnn', 'flash_attn2', 'torch_flash', ",
        ),
    ],
)
def test_config_refuses_misconfiguration(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig2D(**{**BASE, **overrides})


def test_config_accepts_per_layer_lists():
    config = TransformerConfig2D(
        **{**BASE, "cp_comm_type": ["2d", "2d"], "cp_2d_head_parallel_size": 4, "cp_2d_placement": "context_first"}
    )
    assert config.cp_2d_head_parallel_size == 4


def run_misconfigured(rank, world, case):
    if case == "indivisible_sequence":
        tg.init_parallel(context_parallel_size=4)
        cfg = model_config("mha", (2, 1, "head_first"))
        cfg.seq_length = 100
        tg.forward_backward(tg.build_tiny_gpt(cfg, spec_2d()), tg.synthetic_batch(cfg))
    elif case == "thd":  # the core attention of a built model, called as SelfAttention calls it with THD input
        from megatron.core.packed_seq_params import PackedSeqParams

        tg.init_parallel(context_parallel_size=4)
        cfg = model_config("mha", (2, 1, "head_first"))
        attention = tg.build_tiny_gpt(cfg, spec_2d()).decoder.layers[0].self_attention.core_attention
        q = torch.zeros(30, 4, 16)  # the batch's split gives 32 tokens per rank
        bounds = torch.tensor([0, 64, 128], dtype=torch.int32)  # two packed documents
        attention(
            q,
            q,
            q,
            None,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds),
        )
    elif case == "2d_spec_without_2d_backend":
        tg.init_parallel(context_parallel_size=4)
        cfg = tg.TinyGPTConfig(**MODELS["mha"], cp_comm_type="p2p")
        tg.build_tiny_gpt(cfg, spec_2d())
    elif case == "mixed_backends_without_te":
        tg.init_parallel(context_parallel_size=4)
        cfg = model_config("mha", (2, 1, "head_first"))
        cfg.cp_comm_type = ["2d", "p2p"]
        tg.build_tiny_gpt(cfg, spec_2d())


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, message",
    [
        ("indivisible_sequence", r"batch\['tokens'\]: sequence length 100 is not divisible by 2\*CP = 8"),
        (
            "thd",
            r"q holds 30 tokens, but the PackedSharding gives this rank t_local = 32 slots \(T = 128 over CP = 4\)",
        ),
        ("2d_spec_without_2d_backend", r"the 2d layer spec is in use but cp_comm_type is 'p2p' for every layer"),
        (
            "mixed_backends_without_te",
            r"layer 2 asks cp_comm_type 'p2p', which megatron-core runs through Transformer "
            r"Engine, not installed here",
        ),
    ],
)
def test_misconfigured_runs_stop_with_clear_errors(case, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(4, run_misconfigured, case, timeout_s=60)


@pytest.mark.distributed
def test_softmax_scale_is_honoured(results):
    assert_matches(results[("cp4_2x2", "scaled")], results[("ref", "scaled")])


@pytest.mark.distributed
def test_core_attention_masks_and_scale_forward_and_backward():
    """no_mask and causal, with the config's softmax_scale, forward and dq/dk/dv, on 4 ranks (its own fork)."""
    errors = run_on_ranks(4, run_core_attention_alone, timeout_s=120)
    bad = [e for per_rank in errors for e in per_rank.values() if not e < RTOL]
    assert not bad and all(set(e) == {"no_mask", "causal"} for e in errors), errors


def test_stock_hierarchical_sizes_give_head_then_context():
    """--hierarchical-context-parallel-sizes HP CP (no cp_2d_* fields): hp = the first size, cp = the second."""
    from types import SimpleNamespace

    from megatron_2d.megatron.settings import settings_from_config

    config = SimpleNamespace(
        context_parallel_size=8,
        num_attention_heads=8,
        num_query_groups=2,
        tensor_model_parallel_size=1,
        attention_dropout=0.0,
        hierarchical_context_parallel_sizes=[2, 4],
    )
    settings = settings_from_config(config)
    # w: one ring by default
    assert (settings.head_parallel_size, settings.context_size, settings.inner_ring_size) == (2, 4, 4)
    config.hierarchical_context_parallel_sizes = [4, 2]
    assert settings_from_config(config).head_parallel_size == 4
    config.hierarchical_context_parallel_sizes = [2, 2, 2]
    with pytest.raises(ValueError, match=r"give two sizes \[hp, cp\]"):
        settings_from_config(config)


def test_layer_spec_carries_the_overrides_and_builds_mla():
    """get_gpt_layer_spec_2d: CoreAttention2D as core attention, keyword settings passed as its params (only the
    ones given), Megatron's local layers without TE; an MLA config gets Megatron's MLA layer (tests/test_megatron_mla.py
    runs it)."""
    from types import SimpleNamespace

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_2d.megatron.core_attention import CoreAttention2D

    spec = get_gpt_layer_spec_2d(
        use_transformer_engine=False, head_parallel_size=2, placement="context_first", kernel="torch_math"
    )
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is CoreAttention2D
    assert core.params == {"head_parallel_size": 2, "placement": "context_first", "kernel": "torch_math"}
    assert (
        get_gpt_layer_spec_2d(use_transformer_engine=False).submodules.self_attention.submodules.core_attention.params
        == {}
    )
    mla = get_gpt_layer_spec_2d(SimpleNamespace(multi_latent_attention=True), use_transformer_engine=False)
    assert mla.submodules.self_attention.module is MLASelfAttention
    assert mla.submodules.self_attention.submodules.core_attention.module is CoreAttention2D


def run_off_by_one_sinks_move(rank, world):
    """CoreAttention2D with softmax_type "off-by-one", built with use_cpu_initialization (as Megatron builds a
    model it then moves with .cuda()): its sinks follow every .to() of the module and stay out of checkpoints."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    tg.init_parallel()
    cfg = model_config("gqa")
    cfg.config_overrides = dict(softmax_type="off-by-one", use_cpu_initialization=True)
    core = spec_2d().submodules.self_attention.submodules.core_attention
    attention = core.module(
        config=tg.make_transformer_config(cfg),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type="2d",
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp", "cp"]),
        **core.params,
    )
    found = {
        "buffer": "softmax_offset" in dict(attention.named_buffers()),
        "in_state_dict": "softmax_offset" in attention.state_dict(),
    }
    attention.to(torch.float64)
    found["dtype_after_to"] = attention.softmax_offset.dtype
    attention.to("meta")
    found["device_after_to"] = attention.softmax_offset.device.type
    destroy_2d_groups()
    return found


@pytest.mark.distributed
def test_off_by_one_sinks_move_with_the_module():
    assert run_on_ranks(1, run_off_by_one_sinks_move) == [
        {"buffer": True, "in_state_dict": False, "dtype_after_to": torch.float64, "device_after_to": "meta"}
    ]
