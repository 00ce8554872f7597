"""The CPU megatron-core harness (megatron_2d_dev.tiny_gpt) reproduces CP=1 exactly under CP, TP and PP.

The core attention here is a deliberately simple reference: every CP rank all-gathers K and V over the CP
group, restores full sequence order (undoing the zigzag split), and attends with a causal mask built from
global positions. If the harness is right, a tiny GPTModel with it gives the same per-token loss and every
parameter gradient at CP=2, CP=4 and TP2xCP2 as at CP=1, and the same training losses; a pipeline run
(PP=2, PP2xCP2) gives the PP=1 loss and gradients. A broken attention (local tokens only) must NOT pass.

All layouts run in ONE fork of 4 ranks (module fixture); each test asserts on its part of the results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev import tiny_gpt as tg

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

WORLD = 4
RTOL = 1e-5  # fp32; relative to each tensor's max magnitude

# (case name, model/batch config): MHA and GQA, RoPE, 2 layers, hidden 64
CASES = {
    "mha": tg.TinyGPTConfig(num_attention_heads=4, num_query_groups=None, seq_length=64),
    # a per-layer cp_comm_type list: any strings reach each layer's core_attention constructor
    "gqa": tg.TinyGPTConfig(
        num_attention_heads=8, num_query_groups=2, seq_length=96, seed=77, cp_comm_type=["ref-layer1", "ref-layer2"]
    ),
}
# (layout name, init_parallel kwargs) compared with CP=1
LAYOUTS = {
    "cp2": dict(context_parallel_size=2),
    "cp4": dict(context_parallel_size=4),
    "cp4_hier2x2": dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]),
    "tp2_cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
}
PIPELINE_LAYOUTS = {
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2_cp2": dict(pipeline_model_parallel_size=2, context_parallel_size=2),
}


# ------------------------------------------------------------------------------------------------
# Reference core attention (test-only): all-gather K/V over CP, causal attention on global positions
# ------------------------------------------------------------------------------------------------
class _AllGatherSeq(torch.autograd.Function):
    """[s/cp, ...] local (zigzag) shard -> [s, ...] full sequence; backward: sum over ranks, own shard."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        return tg.unshard_cp(parts, seq_dim=0)

    @staticmethod
    def backward(ctx, grad_full):
        grad_full = grad_full.contiguous()
        dist.all_reduce(grad_full, group=ctx.group)  # gloo has no reduce_scatter
        cp, rank = ctx.group.size(), ctx.group.rank()
        chunks = grad_full.chunk(2 * cp, dim=0)
        first, second = tg.zigzag_chunk_ids(rank, cp)
        return torch.cat([chunks[first], chunks[second]], dim=0), None


class ReferenceCoreAttention(torch.nn.Module):
    """Satisfies megatron's CoreAttentionBuilder/Interface; q,k,v ``[s/cp, b, heads, d]`` -> ``[s/cp, b, hq*d]``."""

    seen = []  # (layer_number, cp_comm_type, cp size, hcp sizes) per construction, for the tests

    def __init__(
        self,
        *,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
        local_only=False,
    ):
        super().__init__()
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale
        self.local_only = local_only
        hcp = pg_collection.hcp
        ReferenceCoreAttention.seen.append(
            (layer_number, cp_comm_type, self.cp_group.size(), [g.size() for g in hcp] if hcp else None)
        )

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        s_local, b, hq, d = query.shape
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        chunk = s_local // 2
        q_pos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in tg.zigzag_chunk_ids(rank, cp)])
        if cp > 1 and not self.local_only:
            key = _AllGatherSeq.apply(key, self.cp_group)  # [s, b, hk, d]
            value = _AllGatherSeq.apply(value, self.cp_group)
            k_pos = torch.arange(key.shape[0])
        else:
            k_pos = q_pos
        groups = hq // key.shape[2]
        key = key.repeat_interleave(groups, dim=2)  # [s_k, b, hq, d]
        value = value.repeat_interleave(groups, dim=2)
        scale = self.softmax_scale if self.softmax_scale is not None else d**-0.5
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), value)
        return out.reshape(s_local, b, hq * d)


class LocalOnlyCoreAttention(ReferenceCoreAttention):
    """Deliberately wrong under CP: attends only to this rank's own tokens."""

    def __init__(self, **kwargs):
        super().__init__(local_only=True, **kwargs)


# ------------------------------------------------------------------------------------------------
# One 4-rank run computing every layout
# ------------------------------------------------------------------------------------------------
def _all_layouts(rank, world_size):
    ref_spec = tg.local_spec_with_core_attention(ReferenceCoreAttention)
    out = {}
    for name, cfg in CASES.items():
        batch = tg.synthetic_batch(cfg)
        tg.init_parallel()
        out[(name, "cp1")] = tg.forward_backward(tg.build_tiny_gpt(cfg, ref_spec), batch)
        # Megatron's own local DotProductAttention at CP=1 validates the reference attention itself.
        out[(name, "cp1_megatron_local")] = tg.forward_backward(tg.build_tiny_gpt(cfg), batch)
        out[(name, "train_cp1")] = tg.train_steps(tg.build_tiny_gpt(cfg, ref_spec), cfg, steps=3)
        for layout, kwargs in LAYOUTS.items():
            tg.init_parallel(**kwargs)
            ReferenceCoreAttention.seen.clear()
            model = tg.build_tiny_gpt(cfg, ref_spec)
            out[(name, layout, "seen")] = list(ReferenceCoreAttention.seen)
            out[(name, layout)] = tg.forward_backward(model, batch)
        tg.init_parallel(context_parallel_size=2)
        out[(name, "train_cp2")] = tg.train_steps(tg.build_tiny_gpt(cfg, ref_spec), cfg, steps=3)
        out[(name, "cp2_local_only")] = tg.forward_backward(
            tg.build_tiny_gpt(cfg, tg.local_spec_with_core_attention(LocalOnlyCoreAttention)), batch
        )
        tg.init_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        out[(name, "train_tp2_cp2")] = tg.train_steps(tg.build_tiny_gpt(cfg, ref_spec), cfg, steps=3)

    cfg = CASES["gqa"]
    batch = tg.synthetic_batch(cfg)
    tg.init_parallel()
    out[("pipeline", "pp1")] = tg.pipeline_forward_backward(tg.build_tiny_gpt(cfg, ref_spec), cfg, batch)
    for layout, kwargs in PIPELINE_LAYOUTS.items():
        tg.init_parallel(**kwargs)
        out[("pipeline", layout)] = tg.pipeline_forward_backward(tg.build_tiny_gpt(cfg, ref_spec), cfg, batch)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, _all_layouts, timeout_s=120)[0]


def _assert_close(actual, expected, rtol=RTOL):
    errors = tg.compare_results(actual, expected)
    bad = {k: v for k, v in errors.items() if not v <= rtol}
    assert not bad, f"relative errors above {rtol}: {bad}"
    return errors


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_attention_matches_megatron_local_attention_at_cp1(results, case):
    _assert_close(results[(case, "cp1")], results[(case, "cp1_megatron_local")])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_cp1_loss_and_every_gradient(results, case, layout):
    actual, expected = results[(case, layout)], results[(case, "cp1")]
    errors = _assert_close(actual, expected)
    num_params = len(expected["grads"])
    assert num_params == 28 and sum(k.startswith("grad:") for k in errors) == num_params
    assert actual["per_token_loss"].shape == (CASES[case].micro_batch_size, CASES[case].seq_length)
    assert all(g.abs().max() > 0 for g in expected["grads"].values()), "a parameter got no gradient"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_core_attention_receives_cp_group_and_comm_type(results, layout):
    seen = results[("gqa", layout, "seen")]
    kwargs = LAYOUTS[layout]
    assert [s[0] for s in seen] == [1, 2]  # one core attention per layer, global layer numbers
    assert [s[1] for s in seen] == ["ref-layer1", "ref-layer2"]
    assert all(s[2] == kwargs["context_parallel_size"] for s in seen)
    assert all(s[3] == kwargs.get("hierarchical_context_parallel_sizes") for s in seen)


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_attention_is_detected(results, case):
    errors = tg.compare_results(results[(case, "cp2_local_only")], results[(case, "cp1")])
    assert max(errors.values()) > 1e-2, errors


@pytest.mark.parametrize("layout", ["train_cp2", "train_tp2_cp2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_three_adam_steps_track_cp1(results, case, layout):
    expected, actual = results[(case, "train_cp1")], results[(case, layout)]
    assert len(actual.losses) == len(expected.losses) == len(actual.grad_norms) == 3
    assert expected.losses[2] < expected.losses[0], f"training does not reduce the loss: {expected}"
    for step, (a, e) in enumerate(zip(actual.losses + actual.grad_norms, expected.losses + expected.grad_norms)):
        assert abs(a - e) <= RTOL * abs(e), f"{'loss' if step < 3 else 'grad norm'} {step % 3}: {a} vs {e}"


@pytest.mark.parametrize("layout", sorted(PIPELINE_LAYOUTS))
def test_pipeline_schedule_matches_pp1(results, layout):
    expected, actual = results[("pipeline", "pp1")], results[("pipeline", layout)]
    _assert_close(actual, expected)
    assert len(expected["grads"]) == 28
    # The pipeline loss (mean of 2 microbatch means) is a different reduction from the full-batch loss,
    # but the same model and data: it must be close to it.
    full = results[("gqa", "cp1")]["loss"]
    assert abs(float(expected["loss"]) - float(full)) < 0.05 * float(full)
