"""QK-clip (MuonClip) under 2D: Megatron training with qk_clip at TP 2 x 2D CP 4 with the distributed optimizer equals
the CP = 1 reference in loss, grad norm, logged max logit and weights, for GQA with K/V replication, MLA (expanded
and latent rings) and a HybridModel with Mamba layers (fp32: the table's bounds, no perturbed twin; bf16 QK-clip draws
with the distributed optimizer's flat main-param shards train in the generated configurations); megatron-core
0.19.2's own clip_qk fails on each kind of model megatron_2d.megatron.qk_clip reaches, whose clip, flat shards
included, is checked against the formula."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev.config_runs import run_configuration
from megatron_2d_dev.generated_configs import QK_CLIP_THRESHOLD, Draw, Scenario, trains
from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

install_hybrid_cpu_shims()


def _scenario(seed: int, model: str, layers: str, heads: int, groups: int, dtype: str, tp: int | None) -> Scenario:
    return Scenario(
        seed=seed,
        model=model,
        layers=layers,
        heads=heads,
        query_groups=groups,
        moe=False,
        ssm_heads=8,
        normalization="LayerNorm",  # megatron-core's default, as before the generator drew it
        window="none",
        window_size=1,
        softmax_type="vanilla",
        softmax_scale=None,
        qk_layernorm=False,
        position="rope",
        data="sbhd",
        seq_length=64,
        lengths=(),
        end_padding=0,
        dtype=dtype,
        tp=tp,
        qk_clip=True,
    )


def _draw(scenario: Scenario, mla_ring: str = "expanded") -> Draw:
    """TP 2 x CP 4 (hp 2 x cp 2, a double ring of 2) with the distributed optimizer over the 4 CP ranks."""
    return Draw(
        scenario=scenario,
        index=0,
        tp=2,
        sequence_parallel=False,
        pp=1,
        vpp=None,
        splits=(0,) if scenario.model == "hybrid" else (),
        hp=2,
        cp=2,
        inner_ring_size=2,
        placement="head_first",
        order="tp-cp-ep-dp-pp",
        dp=1,
        state="distributed_optimizer",
        shard_size=None,
        zero_states=None,
        wider_optimizer_shard=False,
        recompute="none",
        checkpoint_plus_plus_keep=None,
        mla_ring=mla_ring,
    )


GQA = _scenario(4201, "gpt", "**", heads=8, groups=2, dtype="fp32", tp=None)  # 1 K/V head per TP rank < hp 2
DRAWS = {
    "gqa_kv_replication": _draw(GQA),
    "mla_expanded": _draw(_scenario(4203, "mla", "**", heads=8, groups=8, dtype="fp32", tp=2)),
    "mla_latent": _draw(_scenario(4203, "mla", "**", heads=8, groups=8, dtype="fp32", tp=2), mla_ring="latent"),
    "hybrid_mamba": _draw(_scenario(4204, "hybrid", "M*-", heads=4, groups=2, dtype="fp32", tp=None)),
}


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize("name", DRAWS)
def test_training_with_qk_clip_equals_cp1(name, references):
    """Three Adam steps, each followed by the training loop's QK-clip at a threshold the first step's max logit
    exceeds (compare() fails a reference that never clips): loss, grad norm and logged max logit of every
    iteration, the iteration-1 gradients and every weight after the last clip equal the CP = 1 reference's."""
    draw = DRAWS[name]
    assert trains(draw)
    outcome = run_configuration(draw, references, with_twin=False)
    print(outcome.line(), {k: f"{v:.1e}" for k, v in outcome.errors.items()})
    assert outcome.status == "pass", outcome.line()
    assert "max_logit" in outcome.errors and "weights" in outcome.errors


@pytest.mark.megatron
@pytest.mark.distributed
def test_megatron_cores_own_clip_step_works_unchanged_where_it_runs(references, monkeypatch):
    """Where megatron-core 0.19.2's own clip step runs (bf16 through Float16Module, DDP, TP 1, no Mamba), it reads
    CoreAttention2D's current_max_attn_logits as it reads TEDotProductAttention's: the training loop's step is
    megatron.core.optimizer.qk_clip.clip_qk itself here, and 2D CP 4 (hp 2 x cp 2) equals CP = 1."""
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk

    from megatron_2d.megatron import qk_clip

    monkeypatch.setattr(qk_clip, "clip_qk", megatron_clip_qk)  # config_runs' clip step, in the forked ranks too
    scenario = _scenario(4205, "gpt", "**", heads=8, groups=2, dtype="bf16", tp=None)
    draw = replace(_draw(scenario), tp=1, state="ddp")
    outcome = run_configuration(draw, references, with_twin=False)
    print(outcome.line(), {k: f"{v:.1e}" for k, v in outcome.errors.items()})
    assert outcome.status == "pass", outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
def test_qk_clip_under_hybrid_cp_equals_cp1(references):
    """QK-clip under hybrid (dynamic) CP, DP 2 x CP 2 with the distributed optimizer: documents of 5 to 30 tokens on
    groups of 1, 2 and 4 (``--max-seqlen-per-dp-cp-rank 8``; group 4 at hp 2 x cp 2), each micro-batch's max logit
    reduced over its own group, the clip step's over DP x CP. All but the 16-token documents need padding to a
    multiple of 2 x their group size (hybrid_sample_batch pads each at its end; 7 -> 8 and 5 -> 6 on one rank,
    11 -> 12 on 2, 25 and 30 -> 32 on 4), which the bridge tells core attention of
    (dynamic_data.params_with_real_length), so that its rows stay out of the max logit; loss, grad norm, logged max
    logit and weights equal CP = 1's. Without it the max logit counts the padding rows (measured on this seed:
    errors 1.7e-1 in the max logit, 1.4e-2 in the weights, 1.1e-4 in the loss; seeds 4207-4210 are all off, 4206
    and 4211 not, their padding rows' logits staying below the real ones; draw 180:0: 5.19 against CP = 1's 4.81); a
    one-sequence micro-batch once handed the op's (out, max_logit) pair on unread."""
    from megatron_2d.layout.dynamic import megatron_cp_size
    from megatron_2d.megatron.dynamic_data import padded_length
    from megatron_2d_dev import generated_configs

    lengths = ((7, 25), (16, 16), (30,), (5, 11, 16))
    scenario = replace(_scenario(4210, "gpt", "**", heads=8, groups=2, dtype="fp32", tp=None), data="zigzag")
    scenario = replace(scenario, seq_length=32, lengths=lengths)
    draw = replace(
        _draw(scenario), tp=1, hp=1, cp=2, inner_ring_size=2, dp=2, max_seqlen_per_rank=8,
        dynamic_layouts="4=2x2/2@head_first",
    )  # fmt: skip
    assert generated_configs.dynamic_group_sizes(draw) == {1, 2, 4}
    padded = {n for sequence in lengths for n in sequence if padded_length(n, megatron_cp_size(n, 8)) > n}
    assert padded == {5, 7, 11, 25, 30}  # every group size pads some document, 16 on 2 ranks runs unpadded
    assert not generated_configs.expected_refusals(draw) and generated_configs.skip_reason(draw) is None
    outcome = run_configuration(draw, references, with_twin=False)
    print(outcome.line(), {k: f"{v:.1e}" for k, v in outcome.errors.items()})
    assert outcome.status == "pass", outcome.line()
    assert "max_logit" in outcome.errors and "weights" in outcome.errors


# ---- megatron-core's own clip_qk, and the clip's formula ---------------------------------------------------------
HEADS, GROUPS, HIDDEN = 8, 2, 64
THRESHOLD, ETA = QK_CLIP_THRESHOLD, 0.5  # every head's max logit at THRESHOLD / ETA: eta = 0.5


def _tiny_gpt(tp: int, bf16: bool, distributed_optimizer: bool):
    """(wrapped model, optimizer): a 2-layer GQA GPT on this rank, wrapped as Megatron-LM wraps it (Float16Module in
    bf16, DDP, the distributed optimizer or not; learning rate 0), with every layer's max logit set."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from megatron_2d.megatron.hybrid_zero import HybridZeRO, distributed_data_parallel_config, optimizer_config
    from megatron_2d_dev import ddp_harness as mcpu
    from megatron_2d_dev import tiny_gpt as tg

    mcpu.init_parallel(tensor_model_parallel_size=tp)
    dtype = torch.bfloat16 if bf16 else torch.float32
    overrides = dict(qk_clip=True, qk_clip_threshold=THRESHOLD, bf16=bf16, params_dtype=dtype)
    cfg = tg.TinyGPTConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=32,
        config_overrides=overrides,
    )  # fmt: skip
    model = tg.build_tiny_gpt(cfg, get_gpt_layer_local_spec())
    model = Float16Module(model.config, model) if bf16 else model
    hz = HybridZeRO("optimizer" if distributed_optimizer else "none")
    dp = dist.get_world_size() // tp
    extra = dict(mcpu.CPU_DDP_CONFIG_OVERRIDES, bucket_size=3000, grad_reduce_in_fp32=bf16)
    wrapped = mcpu.wrap_model(model, distributed_data_parallel_config(hz, dp, 1, **extra))
    optimizer = mcpu.build_optimizer(wrapped, optimizer_config(hz, dp, 1, lr=0.0, bf16=bf16, params_dtype=dtype))
    for layer in mcpu.unwrapped(wrapped).decoder.layers:
        layer.self_attention.core_attention.current_max_attn_logits = torch.full(
            (HEADS // tp,), QK_CLIP_THRESHOLD / ETA
        )
    return wrapped, optimizer


def _qkv_factor() -> torch.Tensor:
    """[rows of the full linear_qkv weight]: eta^alpha on W_q's rows, eta^(1 - alpha) on W_k's, 1 on W_v's
    (Megatron's layout: per query group its query heads, then its key, then its value; alpha 0.5)."""
    head_dim = HIDDEN // HEADS
    per_group = (HEADS // GROUPS + 2) * head_dim
    row = torch.arange(GROUPS * per_group) % per_group
    factor = torch.ones(row.shape)
    factor[row < per_group - head_dim] = ETA**0.5  # query rows (alpha) and the key rows (1 - alpha): both 0.5 here
    return factor


def _clip_cases(rank, world):
    """Each case: the error type megatron-core's clip_qk raises, and ours: its logged max, whether it reset the max,
    and how far the weights are from the formula right after it and after a learning-rate-0 optimizer step (which
    copies the fp32 main params back into the weights: a main param the clip missed would undo it)."""
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk

    from megatron_2d.megatron.qk_clip import clip_qk
    from megatron_2d_dev import ddp_harness as mcpu

    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    mcpu.install_megatron_ddp_cpu_shims()
    results = {}
    for name, (tp, bf16, dist_opt) in CLIP_CASES.items():
        wrapped, _ = _tiny_gpt(tp, bf16, dist_opt)
        try:
            megatron_clip_qk([wrapped])
            theirs = None
        except (AttributeError, RuntimeError) as err:
            theirs = type(err).__name__
        wrapped, optimizer = _tiny_gpt(tp, bf16, dist_opt)  # afresh: theirs may have scaled some weights
        before = mcpu.full_weights([wrapped])
        logged = clip_qk([wrapped])
        cleared = all(
            layer.self_attention.core_attention.current_max_attn_logits is None
            for layer in mcpu.unwrapped(wrapped).decoder.layers
        )
        errors = []
        for _ in range(2):  # right after the clip, then after the step
            after = mcpu.full_weights([wrapped])
            for n, w in before.items():
                want = w * _qkv_factor()[:, None] if n.endswith("linear_qkv.weight") else w
                errors.append((after[n] - want).abs().max().item() / want.abs().max().item())
            with mcpu.megatron_ddp_on_cpu():
                wrapped.zero_grad_buffer()
                optimizer.zero_grad()
                optimizer.step()
        # --log-max-attention-logit alone: the max logged and reset, no weight touched
        for layer in mcpu.unwrapped(wrapped).decoder.layers:
            layer.self_attention.core_attention.current_max_attn_logits = torch.full((HEADS // tp,), 7.0)
        weights = mcpu.full_weights([wrapped])
        log_only = clip_qk([wrapped], log_max_only=True)
        untouched = all(torch.equal(w, mcpu.full_weights([wrapped])[n]) for n, w in weights.items())
        log_cleared = all(
            layer.self_attention.core_attention.current_max_attn_logits is None
            for layer in mcpu.unwrapped(wrapped).decoder.layers
        )
        logging_alone = (log_only, untouched, log_cleared)
        results[name] = dict(theirs=theirs, logged=logged, cleared=cleared, error=max(errors), log_only=logging_alone)
    return results


CLIP_CASES = {  # name: (tp, bf16, distributed optimizer)
    "fp32": (1, False, False),
    "tp2": (2, True, False),
    "bf16_distributed_optimizer": (1, True, True),
    "tp2_bf16_distributed_optimizer": (2, True, True),
}


@pytest.mark.megatron
@pytest.mark.distributed
def test_megatron_clip_qk_fails_where_ours_clips_by_the_formula():
    """On 2 ranks: megatron-core 0.19.2's clip_qk raises on an fp32 model (no Float16Module: AttributeError), on GQA
    at TP 2 (its view of linear_qkv: RuntimeError) and under the distributed optimizer in bf16 (a flat main-param
    shard, RuntimeError, or None, AttributeError, by rank); ours clips each as the formula says (eta 0.5, alpha 0.5)
    in the weights and in the fp32 main params (a learning-rate-0 step copies them back), logs the max and resets
    it; logging alone (--log-max-attention-logit) logs and resets, touching no weight."""
    ranks = run_on_ranks(2, _clip_cases, timeout_s=120)
    for rank, results in enumerate(ranks):
        assert results["fp32"]["theirs"] == "AttributeError" and results["tp2"]["theirs"] == "RuntimeError", results
        for name, r in results.items():
            assert r["theirs"] in ("AttributeError", "RuntimeError"), (rank, name, r)
            assert r["logged"] == pytest.approx(THRESHOLD / ETA) and r["cleared"], (rank, name, r)
            assert r["error"] < (1e-6 if name == "fp32" else 4e-3), (rank, name, r)  # bf16 weights: one rounding
            assert r["log_only"] == (7.0, True, True), (rank, name, r)


# ---- CoreAttention2D's current_max_attn_logits ------------------------------------------------------------------
def _bare_core_attention(delegate=None):
    """A CoreAttention2D with only what its max-logit bookkeeping reads (no groups, no model)."""
    from megatron_2d.megatron.core_attention import CoreAttention2D

    core = CoreAttention2D.__new__(CoreAttention2D)
    torch.nn.Module.__init__(core)
    core.delegate, core.max_logits = delegate, True
    core.current_max_attn_logits = None
    return core


def test_core_attention_keeps_the_running_max_as_te_dot_product_attention():
    """Per call the op's (out, max_logit): out passes through; the max joins the running max detached, in the
    output's dtype (TE's max has O's dtype), until Megatron's clip sets it back to None."""
    core = _bare_core_attention()
    out = torch.randn(3)
    first = torch.tensor([1.0, 5.0], requires_grad=True) * 1.0  # part of a graph, as no max the op returns is
    assert core._keep_max_logit((out, first), torch.bfloat16) is out
    kept = core.current_max_attn_logits
    assert kept.dtype == torch.bfloat16 and not kept.requires_grad and kept.grad_fn is None
    core._keep_max_logit((out, torch.tensor([3.0, 2.0])), torch.bfloat16)
    assert core.current_max_attn_logits.tolist() == [3.0, 5.0]  # the running max over micro-batches
    core.current_max_attn_logits = None  # what megatron-core's clip_qk does after clipping
    core._keep_max_logit((out, torch.tensor([0.5, 0.25])), torch.float32)
    assert core.current_max_attn_logits.tolist() == [0.5, 0.25]


def test_a_layer_on_transformer_engines_cp_keeps_tes_max():
    """A layer whose cp_comm_type delegates to TEDotProductAttention reads and resets the delegate's attribute, so
    that megatron-core's clip_qk, which reads self_attention.core_attention, sees TE's max."""
    from types import SimpleNamespace

    delegate = SimpleNamespace()
    core = _bare_core_attention(delegate)
    delegate.current_max_attn_logits = tes = torch.tensor([2.0])  # what TEDotProductAttention's forward keeps
    assert core.current_max_attn_logits is tes
    core.current_max_attn_logits = None
    assert delegate.current_max_attn_logits is None and core.current_max_attn_logits is None
