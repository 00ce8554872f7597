"""Selective Checkpoint++ (megatron_2d/megatron/checkpoint_plus.py, megatron_2d/kept_forward.py): full-layer
recompute that keeps attention's output and log-sum-exp ("outputs") or also its head-layout inputs
("attention-inputs") from the first pass, under both keep policies.

Op level, generated: the seeded draws of :mod:`megatron_2d.testing.generated_cases` (layouts of up to 4 ranks,
unpacked and every packed mode, windows, sinks, GQA replication, MLA's narrower values, batch 1 and 2, both
kernels and dK/dV dtypes), each through attention_2d and latent_attention_2d inside megatron's own checkpoint:
output and gradients bit for bit those without recompute, no kernel forward and no ring byte in the recompute,
the head all-to-alls of one forward sent again by "outputs" and nothing by "attention-inputs", nothing kept that
shares storage with the inputs.

Model level, generated: megatron-core GPT and MLA models (both rings) over every layout of CP 4 and CP 2, with TP 2,
PP 2 under 1F1B and the interleaved schedule, windows, sinks, packed batches (zigzag, documents), block recompute:
loss and every gradient against the same model without recompute, kernel forwards, bytes, and, with saved-tensor
hooks, that nothing saved or kept shares storage with Megatron's QKV projection output or the rotated q and k.
Sequence parallelism cannot run on CPU ranks (megatron-core's torch LayerNorm asserts "sequence parallel not
supported by torch LayerNorm" without apex), so TP runs without it; the core attention's inputs have the same
shapes either way.

All model cases run in one fork of 4 ranks.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import numpy as np
import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import is_checkpointing

import megatron_2d
from megatron_2d.choices import CHECKPOINT_KEEPS, PACKING_MODES
from megatron_2d.kernels.base import BlockKernel
from megatron_2d.megatron import TransformerConfig2D, checkpoint_plus, get_gpt_layer_spec_2d
from megatron_2d.megatron.core_attention import CoreAttention2D
from megatron_2d.megatron.packed_data import (
    documents_batch_on_this_cp_rank,
    get_thd_batch_on_this_cp_rank_2d,
    groups_of_model,
    use_document_positions,
)
from megatron_2d.testing import tiny_gpt as tg
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.generated_cases import draw_batch, draw_case
from megatron_2d.testing.mla import mla_spec_2d, tiny_mla_config
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d.topology import every_layout

RTOL = TOLERANCES[torch.float32].dq  # model gradients against the same model without recompute
HEAD_KINDS = ("all_to_all",)
RING_KINDS = ("inner_ring", "outer_ring", "neighbour")


class KernelForwards:
    """Counts calls of every block kernel's forward (the attention's O(S^2) work), while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._originals = []
        todo = [BlockKernel]
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if "forward" in cls.__dict__ and not getattr(cls.__dict__["forward"], "__isabstractmethod__", False):
                self._wrap(cls)

    def _wrap(self, cls) -> None:
        original = cls.__dict__["forward"]

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        self._originals.append((cls, original))
        cls.forward = counted

    def restore(self) -> None:
        for cls, original in self._originals:
            cls.forward = original


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit equal, or both None (a rank whose keys no query sees gets no weight gradient)."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _difference(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# ---- op level: generated draws through megatron's checkpoint ----------------------------------------------------

OP_BATCHES = range(8)
OP_DRAWS = 4
ROPE_DIM, LATENT_RANK = 4, 12  # the latent op: q/k head dim = nope + rope, latent = rank + rope


def op_draws():
    return [(draw_batch(seed, max_world=4), seed) for seed in OP_BATCHES]


def _op_inputs(draw, latent: bool):
    """Full (unsharded) fp32 tensors of ``draw``: (q, k, v) or MLA's (q, latent, up weight); dout; sinks or None."""
    g = torch.Generator().manual_seed(draw.batch_seed * 100_003 + draw.index)
    total, b = sum(draw.lengths), draw.batch
    q = torch.randn(total, b, draw.hq, draw.d, generator=g)
    if latent:
        second = torch.randn(total, b, LATENT_RANK + ROPE_DIM, generator=g)
        third = torch.randn(draw.hq * (draw.d - ROPE_DIM + draw.dv), LATENT_RANK, generator=g) * 0.3
    else:
        second = torch.randn(total, b, draw.hkv, draw.d, generator=g)
        third = torch.randn(total, b, draw.hkv, draw.dv, generator=g)
    dout = torch.randn(total, b, draw.hq, draw.dv, generator=g)
    sinks = torch.randn(draw.hq, generator=g) if draw.sinks else None
    return (q, second, third), dout, sinks


def _op_case(draw, groups, cp_rank: int, cp_size: int, latent: bool, kernels: KernelForwards) -> dict:
    tensors, dout, sinks = _op_inputs(draw, latent)
    packing = None
    if draw.mode is None:
        shard = lambda x: megatron_2d.shard_sequence(x, cp_rank, cp_size)  # noqa: E731
    else:
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(draw.lengths)]))
        packing = megatron_2d.PackedLayout(cu, groups, mode=draw.mode)
        shard = lambda x: packing.shard(x[:, 0])  # noqa: E731
    local = [shard(x) for x in tensors[:2]] + [tensors[2] if latent else shard(tensors[2])]
    settings = dict(
        causal=draw.causal,
        sliding_window=draw.window,
        kernel=draw.kernel,
        dkv_comm_dtype=draw.dkv_comm_dtype,
        packing=packing,
    )

    def op(a, b, c, s=None, kept=None):
        if latent:
            dims = dict(nope_dim=draw.d - ROPE_DIM, value_dim=draw.dv)
            return megatron_2d.latent_attention_2d(a, b, c, groups, sinks=s, kept=kept, **dims, **settings)
        return megatron_2d.attention_2d(a, b, c, groups, sinks=s, kept=kept, **settings)

    def leaves():
        return [x.clone().requires_grad_(True) for x in local], (
            None if sinks is None else sinks.clone().requires_grad_(True)
        )

    # without recompute
    xs, s = leaves()
    groups.comm_bytes.reset()
    before = kernels.count
    out = op(*xs, s)
    forward = {"bytes": groups.comm_bytes.as_dict(), "kernels": kernels.count - before}
    out.backward(shard(dout))
    expected = [out.detach(), *(x.grad for x in xs), *(() if s is None else (s.grad,))]
    result = {"plain": {"forward": forward, "bytes": groups.comm_bytes.as_dict()}}
    for keep in CHECKPOINT_KEEPS:
        keeper = checkpoint_plus.AttentionKeeper(keep=keep)
        passes, held = [], []

        def measured(*args, **kwargs):
            before_bytes, before_kernels = groups.comm_bytes.as_dict(), kernels.count
            y = op(*args, **kwargs)
            passes.append(
                {
                    "bytes": _difference(groups.comm_bytes.as_dict(), before_bytes),
                    "kernels": kernels.count - before_kernels,
                }
            )
            return y

        xs, s = leaves()

        def layer(a, b, c):
            y = keeper(measured, a, b, c, s)
            if not torch.is_grad_enabled():
                held.extend(keeper.kept_tensors())
            return y

        groups.comm_bytes.reset()
        out = tensor_parallel.checkpoint(layer, False, *xs)  # megatron's full-layer checkpoint
        inputs = {x.untyped_storage().data_ptr() for x in xs}
        kept = {t.untyped_storage().data_ptr() for t in held if t.numel()}
        out.backward(shard(dout))
        got = [out.detach(), *(x.grad for x in xs), *(() if s is None else (s.grad,))]
        result[keep] = {
            "equal": [_same(a, e) for a, e in zip(got, expected)],
            "passes": passes,
            "bytes": groups.comm_bytes.as_dict(),
            "shares_input_storage": bool(kept & inputs),
            "kept": len(held),
            "left": len(keeper),
        }
    return result


def run_op_batch(rank, world, batch, draws):
    tg.init_parallel()  # megatron's RNG tracker, which its checkpoint forks
    groups = megatron_2d.build_2d_groups(batch.hp, batch.w, batch.placement, cp_rank_lists=[batch.rank_order])
    cp_rank = batch.rank_order.index(rank)
    kernels = KernelForwards()
    try:
        return {
            (draw.index, latent): _op_case(draw, groups, cp_rank, world, latent, kernels)
            for draw in draws
            for latent in (False, True)
        }
    finally:
        kernels.restore()


@pytest.fixture(scope="module")
def op_results():
    out = {}
    for batch, seed in op_draws():
        draws = [draw_case(batch, i, PACKING_MODES) for i in range(OP_DRAWS)]
        for (index, latent), result in run_on_ranks(batch.world, run_op_batch, batch, draws, timeout_s=180)[0].items():
            out[(seed, index, latent)] = (batch, draws[index], result)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_op_gradients_bit_for_bit_without_recompute(op_results, keep):
    bad = [(k, r[keep]["equal"]) for k, (_, _, r) in op_results.items() if not all(r[keep]["equal"])]
    assert not bad, bad
    assert all(len(r[keep]["equal"]) >= 4 for _, _, r in op_results.values())


@pytest.mark.distributed
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_op_recompute_runs_no_kernel_forward_and_sends_what_its_policy_says(op_results, keep):
    for key, (_, _, r) in op_results.items():
        first, recompute = r[keep]["passes"]
        plain = r["plain"]
        assert first == plain["forward"], key  # the first pass is a plain forward
        assert recompute["kernels"] == 0 < first["kernels"], key
        assert all(recompute["bytes"][k] == 0 for k in RING_KINDS), key
        head = {k: first["bytes"][k] if keep == "outputs" else 0 for k in HEAD_KINDS}
        assert {k: recompute["bytes"][k] for k in HEAD_KINDS} == head, key
        assert r[keep]["bytes"] == {k: plain["bytes"][k] + recompute["bytes"][k] for k in plain["bytes"]}, key
    assert any(r[keep]["passes"][0]["bytes"]["all_to_all"] > 0 for _, _, r in op_results.values())


@pytest.mark.distributed
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_op_keeps_nothing_of_its_inputs_and_releases_what_it_kept(op_results, keep):
    for key, (_, _, r) in op_results.items():
        assert not r[keep]["shares_input_storage"], key
        assert r[keep]["kept"] >= (2 if keep == "outputs" else 5) and r[keep]["left"] == 0, key


def test_op_draws_cover_the_op(op_results):
    """The generated op cases reach every path the keeper must replay (a generator change that loses one fails)."""
    cases = [(b, d, latent) for (_, _, latent), (b, d, _) in op_results.items()]
    assert {d.mode for _, d, _ in cases} == {None, *PACKING_MODES}
    assert {latent for _, _, latent in cases} == {False, True}
    assert {b.hp for b, _, _ in cases} >= {1, 2, 4} and any(b.hp > 1 and b.cp > 1 for b, _, _ in cases)
    assert any(d.window != (-1, -1) for _, d, _ in cases) and any(d.sinks for _, d, _ in cases)
    assert any(d.hkv < b.hp for b, d, latent in cases if not latent)  # K/V replicated
    assert any(d.dv < d.d for _, d, _ in cases) and {d.batch for _, d, _ in cases} == {1, 2}
    assert {d.kernel for _, d, _ in cases} == {"cpu_flash", "torch_math"}
