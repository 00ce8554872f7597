"""Sequence parallelism (SP) under 2D on CPU ranks: the norm routes of megatron_2d_dev.sp_norms (scoped, exact),
and MLA's SP-only branches for both rings against the CP=1 model at the same TP and SP.

The generated configurations draw SP at TP > 1 (megatron_2d_dev.generated_configs: Checkpoint++, packed
documents, windows, sinks, HybridModel and MoE with SP among them, the axis ``sequence_parallel_with``); the entry
routes are in test_pretrain_gpt_cpu.py and test_pretrain_hybrid_cpu.py.
"""

from __future__ import annotations

import inspect
import sys
import traceback

import pytest
import torch

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev import sp_norms
from megatron_2d_dev import tiny_gpt as tg

pytestmark = pytest.mark.megatron


def _bindings_now(bindings):
    import importlib

    return {(m, n): vars(importlib.import_module(m)).get(n, "<missing>") for m, n, _ in bindings}


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=2)
    return TransformerConfig(**base, **{"sequence_parallel": True, "use_cpu_initialization": True, **fields})


def _against_torch(norm, reference: torch.nn.Module, dtype=torch.float32) -> float:
    """Largest relative difference of output, input gradient and weight gradient between ``norm`` and
    ``reference`` (same weights) on a random [s, b, h] input."""
    with torch.no_grad():
        norm.weight.normal_()
        reference.weight.copy_(norm.weight + (1 if getattr(norm, "zero_centered_gamma", False) else 0))
        if getattr(reference, "bias", None) is not None:
            norm.bias.normal_()
            reference.bias.copy_(norm.bias)
    x = torch.randn(6, 2, 16, dtype=dtype)
    g = torch.randn(6, 2, 16, dtype=dtype)
    results = []
    for module in (norm, reference):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(g)
        results.append((out.detach(), xi.grad, module.weight.grad))
    return max(tg.max_relative_error(a, e) for a, e in zip(*results))


def test_apex_stand_in_runs_megatrons_fused_layer_norm_and_leaves_nothing_patched():
    """Inside the context megatron-core builds its FusedLayerNorm (local specs' LNImpl, TransformerBlock's final norm)
    over the stand-in, which keeps the ``memory_efficient`` argument Megatron inspects, marks the weights
    sequence_parallel and equals torch's LayerNorm forward and backward; after it every binding and apex's modules are
    as before, also when the block raises."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs

    bindings = sp_norms.apex_bindings()
    before = _bindings_now(bindings)
    assert "apex" not in sys.modules and gpt_layer_specs.LNImpl is not FusedLayerNorm
    with sp_norms.apex_layer_norm():
        from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction

        assert gpt_layer_specs.LNImpl is FusedLayerNorm
        assert "memory_efficient" in inspect.getfullargspec(FusedLayerNormAffineFunction.forward).args
        norm = FusedLayerNorm(config=_config(), hidden_size=16)
        assert norm.weight.sequence_parallel and norm.bias.sequence_parallel
        assert _against_torch(norm, torch.nn.LayerNorm(16)) < 2e-6
    assert _bindings_now(bindings) == before and "apex" not in sys.modules
    with pytest.raises(RuntimeError, match="inside"), sp_norms.apex_layer_norm():
        raise RuntimeError("inside")
    assert _bindings_now(bindings) == before and "apex" not in sys.modules


def test_te_norms_run_tes_own_norms_over_cpu_kernels_and_leave_nothing_patched():
    """megatron-core's TENorm builds Transformer Engine's own RMSNorm / LayerNorm (the release's Python, its op
    calling the CPU kernels), marked sequence_parallel, equal to torch's norm forward and backward in fp32 (with and
    without zero-centred gamma); after the context TE is gone from sys.modules and megatron-core sees no TE (TENorm
    raises as without TE)."""
    from megatron.core.extensions import transformer_engine as te_ext

    from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

    install_hybrid_cpu_shims()  # te_norms installs them (their final-norm binding stays): compare after that
    bindings = [(m, n, v) for m, n, v in sp_norms.te_bindings(None) if m.startswith("megatron")]
    before = _bindings_now(bindings)
    cases = [(n, z) for n in ("RMSNorm", "LayerNorm") for z in (False, True)]
    with sp_norms.te_norms() as tex:
        for normalization, zero_centered_gamma in cases:
            config = _config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered_gamma)
            norm = te_ext.TENorm(config=config, hidden_size=16)
            assert type(norm).__module__.startswith("transformer_engine.pytorch")
            assert type(norm).__name__ == normalization and norm.weight.sequence_parallel
            reference = (torch.nn.RMSNorm if normalization == "RMSNorm" else torch.nn.LayerNorm)(16, eps=1e-5)
            assert _against_torch(norm, reference) < 2e-6, (normalization, zero_centered_gamma)
        assert dict(tex.calls) == {f"{k}_{d}": 2 for k in ("rmsnorm", "layernorm") for d in ("fwd", "bwd")}
    assert not [m for m in sys.modules if m.startswith("transformer_engine")]
    assert _bindings_now(bindings) == before and not te_ext.HAVE_TE
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        te_ext.TENorm(config=_config(), hidden_size=16)


# ---- MLA's SP-only branches, both rings ------------------------------------------------------------------------------
MLA_RTOL = 1e-5
MLA_CASES = [(ring, down) for ring in ("expanded", "latent") for down in ("column_parallel", "duplicated")]
"""Megatron's local MLA spec projects down with column-parallel linears (under SP: the latent gathered over TP and
scattered back to the sequence-parallel region); ModelOpt's spec (and the TE spec's TELinear) with duplicated ones
(under SP: the rope key ``k_pos_emb`` gathered from the sequence-parallel region). mla.py repeats both for the
latent ring; the expanded ring is Megatron's own code."""


def _mla_spec(spec, down: str):
    from megatron.core.post_training.modelopt.layers import Linear

    spec = sp_norms.with_te_norms(spec)  # MLA's RMSNorm with SP: TE's norms
    if down == "duplicated":
        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
    return spec


def _op_with_and_without_sp(rank, world):
    """GPT at TP 2 x 2D CP 2 (hp 2), with SP and without (TE's norms both times): what each CoreAttention2D takes
    and returns in the forward, the op's bytes, and the training results."""
    from megatron_2d.megatron import TransformerConfig2D, get_gpt_layer_spec_2d

    tg.init_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    out = {}
    for sp in (False, True):
        cfg = tg.TinyGPTConfig(
            num_attention_heads=8, num_query_groups=2, config_class=TransformerConfig2D, cp_comm_type="2d"
        )
        cfg.config_overrides = dict(cp_2d_head_parallel_size=2, sequence_parallel=sp)
        spec = get_gpt_layer_spec_2d(use_transformer_engine=False)
        model = tg.build_tiny_gpt(cfg, sp_norms.with_te_norms(spec))  # the same norm kernels either way
        seen = []
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(
                lambda module, args, output: seen.append([t.detach().clone() for t in (*args[:3], output)])
            )
        groups = model.decoder.layers[0].self_attention.core_attention.groups
        groups.comm_bytes.reset()
        result = tg.forward_backward(model, tg.synthetic_batch(cfg))
        out[sp] = dict(seen=seen, comm=groups.comm_bytes.as_dict(), result=result)
    return out


def _mla_sequence_parallel(rank, world):
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_2d_dev.mla import mla_spec_2d, reference_mla_spec, tiny_mla_config

    try:
        fields = dict(sequence_parallel=True)
        out = {}
        for down in ("column_parallel", "duplicated"):
            tg.init_parallel(tensor_model_parallel_size=2)  # CP = 1 (DP 2: each DP rank the whole batch)
            cfg = tiny_mla_config(**fields)
            ref = tg.forward_backward(
                tg.build_tiny_gpt(cfg, _mla_spec(reference_mla_spec(), down)), tg.synthetic_batch(cfg)
            )
            tg.init_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
            for ring in ("expanded", "latent"):
                cfg = tiny_mla_config((2, 1, "head_first"), ring, **fields)
                model = tg.build_tiny_gpt(cfg, _mla_spec(mla_spec_2d(ring), down))
                attention = model.decoder.layers[0].self_attention
                kind = {Linear: "duplicated", ColumnParallelLinear: "column_parallel"}[
                    type(attention.linear_kv_down_proj)
                ]
                assert (
                    kind == down
                    and model.config.sequence_parallel
                    and type(attention).__name__ == ("MLASelfAttention2D" if ring == "latent" else "MLASelfAttention")
                )
                got = tg.forward_backward(model, tg.synthetic_batch(cfg))
                out[(ring, down)] = tg.compare_results(got, ref)
        out["op"] = _op_with_and_without_sp(rank, world)
        return out
    except Exception:
        return traceback.format_exc()


@pytest.fixture(scope="module")
def mla_errors():
    """Every MLA case in one fork of 4 ranks (TP 2 x 2D CP 2 as hp 2, against TP 2 + SP at CP = 1)."""
    with sp_norms.te_norms():
        results = run_on_ranks(4, _mla_sequence_parallel, timeout_s=300)
    for r in results:
        assert not isinstance(r, str), r
    return results[0]


@pytest.mark.distributed
@pytest.mark.parametrize("ring, down", MLA_CASES, ids=[f"{r}-{d}" for r, d in MLA_CASES])
def test_mla_with_sequence_parallelism_trains_as_at_cp1(mla_errors, ring, down):
    """The loss, the gradient norm and every gradient of MLA (RMSNorm through TE's norms, TP 2 + SP)
    at 2D CP 2 equal the same model at CP = 1, for both rings and both down projections."""
    errors = mla_errors[(ring, down)]
    bad = {k: v for k, v in errors.items() if not v <= MLA_RTOL}
    assert not bad, bad


@pytest.mark.distributed
def test_sequence_parallelism_changes_nothing_inside_the_2d_op(mla_errors):
    """SP changes nothing the 2d op sees: at TP 2 x 2D CP 2 each CoreAttention2D gets the same q, k, v (Megatron's
    column-parallel QKV projection all-gathers the SP shard first) and returns the same output, bit for bit, and the
    op sends the same bytes (head all-to-all and ring); the whole training step agrees to rounding (the norms and
    the TP reductions outside it run on SP shards, reduce-scatter instead of all-reduce)."""
    without, with_sp = mla_errors["op"][False], mla_errors["op"][True]
    assert len(without["seen"]) == len(with_sp["seen"]) == 2  # two layers, one call each
    for a, b in zip(without["seen"], with_sp["seen"]):
        assert all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    assert with_sp["comm"] == without["comm"] and sum(without["comm"].values()) > 0
    errors = tg.compare_results(with_sp["result"], without["result"])
    assert max(errors.values()) < MLA_RTOL, errors
