"""Selective Checkpoint++ (megatron_2d/megatron/checkpoint_plus.py, megatron_2d/kept_forward.py): full-layer
recompute that keeps attention's output and log-sum-exp ("outputs") or also its head-layout inputs
("attention-inputs") from the first pass, under both keep policies.

Op level, generated: the seeded draws of :mod:`megatron_2d_dev.generated_cases` (layouts of up to 4 ranks,
unpacked and every packed mode, windows, sinks, GQA replication, MLA's narrower values, batch 1 and 2, both
kernels and dK/dV dtypes), each through attention_2d and latent_attention_2d inside megatron's own checkpoint:
output and gradients bit for bit those without recompute, no kernel forward and no ring byte in the recompute,
the head all-to-alls of one forward sent again by "outputs" and nothing by "attention-inputs", nothing kept that
shares storage with the inputs.

Model level, generated: megatron-core GPT and MLA models (both rings) over every layout of CP 4 and CP 2, with TP 2
and sequence parallelism, PP 2 under 1F1B and the interleaved schedule, windows, sinks, packed batches (zigzag,
documents, sequence), block recompute: loss and every gradient against the same model without recompute, kernel
forwards, bytes, and, with saved-tensor hooks, that nothing saved or kept shares storage with Megatron's QKV
projection output or the rotated q and k. Under sequence parallelism the layer's checkpointed input is the TP rank's
sequence shard, while what Checkpoint++ keeps is attention's, after the QKV projection gathered the sequence: the
same checks hold there. The SP case builds Transformer Engine's norms over CPU kernels (megatron_2d_dev.sp_norms:
torch's norm refuses SP; the whole fork runs inside its context).

All model cases run in one fork of 4 ranks.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref

import numpy as np
import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import is_checkpointing

import megatron_2d
from megatron_2d.attention import run_attention_2d
from megatron_2d.call.options import AttentionOptions
from megatron_2d.kept_forward import KeptForward
from megatron_2d.latent_attention import LatentDims, run_latent_attention_2d
from megatron_2d.layout.choices import CHECKPOINT_KEEPS, PACKING_MODES
from megatron_2d.layout.topology import every_layout
from megatron_2d.megatron import TransformerConfig2D, checkpoint_plus, get_gpt_layer_spec_2d
from megatron_2d.megatron.core_attention import CoreAttention2D
from megatron_2d.megatron.packed_data import (
    documents_batch_on_this_cp_rank,
    groups_of_model,
    use_document_positions,
)
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev import tiny_gpt as tg
from megatron_2d_dev.generated_cases import cuda_kernels_on_cpu, draw_batch, draw_case
from megatron_2d_dev.kernel_counts import KernelForwards
from megatron_2d_dev.mla import mla_spec_2d, tiny_mla_config
from megatron_2d_dev.sp_norms import te_norms, with_te_norms

RTOL = TOLERANCES[torch.float32].dq  # model gradients against the same model without recompute
HEAD_KINDS = ("all_to_all",)
RING_KINDS = ("inner_ring", "outer_ring", "neighbour")


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
    """Full (unsharded) tensors of ``draw`` in its dtype (bf16 for the flash kernels' draws): (q, k, v) or MLA's (q,
    latent, up weight); dout; sinks or None."""
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
    dtype = draw.torch_dtype
    cast = tuple(x.to(dtype) for x in (q, second, third))
    return cast, dout.to(dtype), None if sinks is None else sinks.to(dtype)


def _op_case(draw, groups, cp_rank: int, cp_size: int, latent: bool, kernels: KernelForwards) -> dict:
    tensors, dout, sinks = _op_inputs(draw, latent)
    packing = None
    if draw.mode is None:
        shard = lambda x: megatron_2d.shard_sequence(x, cp_rank, cp_size)  # noqa: E731
    else:
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(draw.lengths)]))
        packing = megatron_2d.PackedSharding(cu, groups, mode=draw.mode)
        shard = lambda x: packing.shard(x[:, 0])  # noqa: E731
    local = [shard(x) for x in tensors[:2]] + [tensors[2] if latent else shard(tensors[2])]
    options = AttentionOptions(
        causal=draw.causal, sliding_window=draw.window, kernel=draw.kernel, dkv_comm_dtype=draw.dkv_comm_dtype
    )

    def op(a, b, c, s=None, kept=None):  # Selective Checkpoint++'s record of the call goes in the call's options
        if latent:
            dims = LatentDims(nope_dim=draw.d - ROPE_DIM, value_dim=draw.dv)
            return run_latent_attention_2d(a, b, c, groups, dims, options.keeping(kept), s, packing)
        return run_attention_2d(a, b, c, groups, options.keeping(kept), s, packing)

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
        with cuda_kernels_on_cpu(batch, draws):  # the draws' flash_attn2 / torch_flash through their CPU stand-ins
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


@pytest.mark.distributed
def test_op_draws_cover_the_op(op_results):
    """The generated op cases reach every path the keeper must replay (a generator change that loses one fails)."""
    cases = [(b, d, latent) for (_, _, latent), (b, d, _) in op_results.items()]
    assert {d.mode for _, d, _ in cases} == {None, *PACKING_MODES}
    assert {latent for _, _, latent in cases} == {False, True}
    assert {b.hp for b, _, _ in cases} >= {1, 2, 4} and any(b.hp > 1 and b.cp > 1 for b, _, _ in cases)
    assert any(d.window != (-1, -1) for _, d, _ in cases) and any(d.sinks for _, d, _ in cases)
    assert any(d.hkv < b.hp for b, d, latent in cases if not latent)  # K/V replicated
    assert any(d.dv < d.d for _, d, _ in cases) and {d.batch for _, d, _ in cases} == {1, 2}
    assert {d.kernel for _, d, _ in cases} >= {"cpu_flash", "flash_attn2", "torch_flash"}  # CPU and the CUDA ones


# ---- model level: megatron-core models, generated over layouts, parallel sizes and model features ---------------

CKPT = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
PARALLEL = {
    # name -> (init_parallel kwargs, CP size, micro-batches through megatron's schedule (None: plain step),
    #          how many features run at this size (None: every feature))
    "cp4": (dict(context_parallel_size=4), 4, None, None),
    "tp2_sp_cp2": (dict(tensor_model_parallel_size=2, context_parallel_size=2), 2, None, 4),  # with SP
    "pp2_cp2_1f1b": (dict(pipeline_model_parallel_size=2, context_parallel_size=2), 2, 4, 3),
    "pp2_cp2_interleaved": (
        dict(pipeline_model_parallel_size=2, context_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        2,
        4,
        3,
    ),
}
FEATURES = {
    # name -> config fields (GPT: 8 heads, 2 K/V groups; "mla_*": the tiny MLA model with that ring); kinds
    # interleaved, so that the sizes that take some features in turn get each kind
    "gqa": {},
    "mla_latent": {},
    "packed_documents": {},
    "window_learnable_sinks": dict(softmax_type="learnable", window_size=(12, 0), window_attn_skip_freq=2),
    "block_recompute": {},
    "mla_expanded": {},
    "packed_zigzag": {},
    "off_by_one_sinks": dict(softmax_type="off-by-one"),
    "packed_sequence": {},
}
PACKED_LENGTHS = [5, 30, 13, 1, 50, 9, 20]  # documents of one packed stream (128 tokens: 2*CP divides it)
PACKED_PAD = 8  # zigzag: each document padded to a multiple of 2*CP


def sequence_parallel(parallel: str) -> bool:
    return "_sp_" in parallel


def supported(feature: str, parallel: str) -> bool:
    """Packed batches run the plain step (the tiny pipeline harness feeds sbhd micro-batches); the documents layout
    refuses sequence parallelism."""
    if feature == "packed_documents" and sequence_parallel(parallel):
        return False
    return not (feature.startswith("packed") and PARALLEL[parallel][2] is not None)


def model_cases():
    """(feature, parallel, layout): at CP 4 every feature, at the other sizes the next features in turn (one turn
    shared by them, skipping what a size does not run); the layouts of each CP size taken in turn, so that every
    layout of CP 4 and CP 2 runs. Each case runs without recompute and under both keep policies."""
    layouts = {cp: itertools.cycle(every_layout(cp)) for cp in (2, 4)}
    features = itertools.cycle(FEATURES)
    cases = []
    for parallel, (_, cp, _, count) in PARALLEL.items():
        chosen = [f for f in FEATURES if supported(f, parallel)] if count is None else []
        while len(chosen) < (count or 0):
            feature = next(features)
            if supported(feature, parallel):
                chosen.append(feature)
        for feature in chosen:
            layout = next(layouts[cp])
            cases.append((feature, parallel, (layout.head_parallel_size, layout.inner_ring_size, layout.placement)))
    return cases


def model_config(feature: str, parallel: str, settings, recompute: str, check: str = "tolerance"):
    pipeline = PARALLEL[parallel][2] is not None
    layers = 4 if "interleaved" in parallel else 2
    fields = dict(FEATURES[feature])
    if recompute != "none":
        fields.update(BLOCK if feature == "block_recompute" else CKPT)
    if recompute in CHECKPOINT_KEEPS:
        fields.update(selective_checkpoint_plus_plus_keep=recompute, selective_checkpoint_plus_plus_check=check)
        fields["selective_checkpoint_plus_plus"] = True
    if "interleaved" in parallel:
        fields["virtual_pipeline_model_parallel_size"] = 2
    if sequence_parallel(parallel):
        fields["sequence_parallel"] = True
    if feature.startswith("mla"):
        cfg = tiny_mla_config(settings, feature.split("_")[1], **fields)
        cfg.num_layers = layers
    else:
        hp, w, placement = settings
        cfg = tg.TinyGPTConfig(
            num_layers=layers,
            hidden_size=64,
            num_attention_heads=8,
            num_query_groups=2,
            seq_length=256 if feature.startswith("packed") else 64,
            micro_batch_size=4 if pipeline else (1 if feature.startswith("packed") else 2),
            config_class=TransformerConfig2D,
            cp_comm_type="2d",
            seed=31,
        )
        packing = {"packed_documents": "documents", "packed_sequence": "sequence"}.get(feature, "zigzag")
        cfg.config_overrides = dict(
            cp_2d_head_parallel_size=hp,
            cp_2d_inner_ring_size=w,
            cp_2d_placement=placement,
            cp_2d_packing=packing,
            **fields,
        )
    if pipeline:
        cfg.micro_batch_size = 4
    return cfg


def build(feature: str, parallel: str, cfg):
    if feature.startswith("mla"):
        spec = mla_spec_2d(feature.split("_")[1])
    else:  # from the config, as pretrain builds it (the per-sequence split's SelfAttention2D)
        spec = get_gpt_layer_spec_2d(tg.make_transformer_config(cfg), use_transformer_engine=False)
    if sequence_parallel(parallel):
        spec = with_te_norms(spec)
    if "interleaved" in parallel:
        return [tg.build_tiny_gpt(cfg, spec, vp_stage=i) for i in range(2)]
    model = tg.build_tiny_gpt(cfg, spec)
    return [use_document_positions(model) if feature == "packed_documents" else model]


def packed_step(model, feature: str) -> dict:
    """One forward and backward of a packed stream (zigzag: Megatron's THD split of the padded stream; sequence:
    Megatron's per-sequence split of the unpadded one; documents: our data path), loss and full gradients."""
    g = torch.Generator().manual_seed(5)
    pad = PACKED_PAD if feature == "packed_zigzag" else 1
    padded = [-(-n // pad) * pad for n in PACKED_LENGTHS]
    tokens = torch.randint(0, 128, (1, sum(padded)), generator=g)
    labels = torch.randint(0, 128, (1, sum(padded)), generator=g)
    mask = torch.cat([(torch.arange(p) < n).float() for n, p in zip(PACKED_LENGTHS, padded)])[None]
    cu_real = torch.tensor(np.concatenate([[0], np.cumsum(PACKED_LENGTHS)]), dtype=torch.int32)
    cu_padded = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    if feature == "packed_documents":
        local, params = documents_batch_on_this_cp_rank(batch, groups_of_model(model), cu_real)
    elif feature == "packed_sequence":  # the whole stream cut into 2*CP chunks, global cu_seqlens, no padding
        local, params = tg.shard_batch_for_cp(batch), tg.megatron_thd_params(cu_real)
    else:
        local = tg.thd_batch_on_this_cp_rank(batch, cu_real, cu_padded)
        params = tg.megatron_thd_params(cu_real, cu_padded)
    return tg.packed_forward_backward(model, local, params)


class Watch:
    """What one step keeps, and what it sends and computes in each pass.

    Per keeper call: bytes sent and kernel forwards, by pass ("first" inside the checkpointed forward, "recompute").
    Storages: of the core attention's token-layout inputs in every checkpointed first pass (``plain``: in every
    forward without a checkpoint, the negative control) and of Megatron's QKV projection output (``mixed_qkv``,
    of which v is a view), against every tensor autograd saved during the forwards (saved-tensor hooks) and every
    tensor the keepers kept. Everything watched is held until the end, so no address is reused."""

    def __init__(self, chunks, plain: bool) -> None:
        self.plain, self.chunks = plain, chunks
        self.inputs, self.values, self.mixed_qkv, self.saved, self.kept = [], [], [], [], []
        self.calls = {"first": [], "recompute": []}
        self.kernels = KernelForwards()
        self.groups = groups_of_model(chunks[0])
        self._undo = []
        watch = self

        def watched(method):
            def call(module, query, second, *args, **kwargs):
                if self._watched_pass():
                    watch.inputs += [t for t in (query, second, args[0]) if not isinstance(t, torch.nn.Parameter)]
                    watch.values.append(args[0])
                return method(module, query, second, *args, **kwargs)

            return call

        original = CoreAttention2D.forward  # the latent ring too: forward(query, latent, up_weight, ..., latent=dims)
        CoreAttention2D.forward = watched(original)
        self._undo.append((CoreAttention2D, "forward", original))
        original_call = checkpoint_plus.AttentionKeeper.__call__

        def keeper_call(keeper, *args, **kwargs):
            first = not torch.is_grad_enabled()
            before, kernels = self.groups.comm_bytes.as_dict(), self.kernels.count
            out = original_call(keeper, *args, **kwargs)
            record = {"bytes": _difference(self.groups.comm_bytes.as_dict(), before), "kernels": 0}
            record["kernels"] = self.kernels.count - kernels
            if is_checkpointing():
                self.calls["first" if first else "recompute"].append(record)
                if first:
                    self.kept.extend(keeper.kept_tensors())
            return out

        checkpoint_plus.AttentionKeeper.__call__ = keeper_call
        self._undo.append((checkpoint_plus.AttentionKeeper, "__call__", original_call))
        self._hooks = []
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                qkv = getattr(layer.self_attention, "linear_qkv", None)
                if qkv is not None:
                    self._hooks.append(qkv.register_forward_hook(self._qkv_output))
            original_forward = chunk.forward

            def hooked(*a, _forward=original_forward, **k):
                with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                    return _forward(*a, **k)

            chunk.forward = hooked
            self._undo.append((chunk, "forward", None))

    def _watched_pass(self) -> bool:
        return (not is_checkpointing()) if self.plain else (is_checkpointing() and not torch.is_grad_enabled())

    def _qkv_output(self, module, args, output) -> None:
        if self._watched_pass():
            self.mixed_qkv.append(output[0])

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def close(self) -> tuple[dict, list]:
        """(what was watched, weak references to every kept tensor); every patch undone, every tensor let go."""
        for owner, name, original in self._undo:
            if original is None:
                delattr(owner, name)  # the instance attribute: back to the class's method
            else:
                setattr(owner, name, original)
        for hook in self._hooks:
            hook.remove()
        self.kernels.restore()
        ptr = lambda ts: {t.untyped_storage().data_ptr() for t in ts if t.numel()}  # noqa: E731
        watched = ptr(self.inputs) | ptr(self.mixed_qkv)
        result = {
            "watched": len(watched),
            "leaks": len(watched & (ptr(self.saved) | ptr(self.kept))),
            "v_in_mixed_qkv": bool(self.mixed_qkv) and ptr(self.values) <= ptr(self.mixed_qkv),
            "kept": len(self.kept),
            "calls": self.calls,
            "kernels": self.kernels.count,
        }
        kept = [weakref.ref(t) for t in self.kept]
        for held in (self.inputs, self.values, self.mixed_qkv, self.saved, self.kept):
            held.clear()
        return result, kept


def model_step(feature: str, parallel: str, settings, recompute: str, check: str = "tolerance") -> dict:
    cfg = model_config(feature, parallel, settings, recompute, check)
    chunks = build(feature, parallel, cfg)
    groups = groups_of_model(chunks[0])
    watch = Watch(chunks, plain=recompute == "none")
    groups.comm_bytes.reset()
    try:
        if feature.startswith("packed"):
            result = packed_step(chunks[0], feature)
        elif PARALLEL[parallel][2] is not None:
            result = tg.pipeline_forward_backward(chunks, cfg, tg.synthetic_batch(cfg), PARALLEL[parallel][2])
        else:
            result = tg.forward_backward(chunks[0], tg.synthetic_batch(cfg))
    finally:
        watched, kept = watch.close()
    gc.collect()
    keepers = [l.self_attention.core_attention.keeper for c in chunks for l in c.decoder.layers]
    result.update(watched)
    result["bytes"] = groups.comm_bytes.as_dict()
    result["kept_alive"] = sum(r() is not None for r in kept)
    result["self_attention"] = type(chunks[0].decoder.layers[0].self_attention).__name__
    result["fifo_after"] = sum(len(k) for k in keepers if k is not None)
    return result


DIFFERENT = [  # (model, keep, check): each keep policy with each check, and with each model
    (feature, keep, check)
    for feature, (keep, check) in zip(
        itertools.cycle(("gqa", "mla_latent")), itertools.product(CHECKPOINT_KEEPS, ("tolerance", "bitwise"))
    )
]


def different_replay(feature: str, keep: str, check: str) -> str:
    """A recompute that does not reproduce its first pass (its QKV projection, or MLA's latent, nudged in the
    recompute only): the keeper's message, or '' when nothing was raised."""
    cfg = model_config(feature, "cp4", (2, 1, "head_first"), keep, check)
    (model,) = build(feature, "cp4", cfg)
    attention = model.decoder.layers[0].self_attention
    module = attention.linear_kv_down_proj if feature == "mla_latent" else attention.linear_qkv

    def nudge(module, args, output):
        if is_checkpointing() and torch.is_grad_enabled():
            return (output[0] * (1 + 1e-3), *output[1:])
        return None

    module.register_forward_hook(nudge)
    try:
        tg.forward_backward(model, tg.synthetic_batch(cfg))
    except RuntimeError as error:
        return str(error)
    return ""


@contextlib.contextmanager
def unguarded_kept_forward():
    """KeptForward without its storage guard (a recorded view of an input is kept as it is)."""
    original = KeptForward.__init__

    def init(self, keep, inputs):
        original(self, keep, ())

    KeptForward.__init__ = init
    try:
        yield
    finally:
        KeptForward.__init__ = original


def run_models(rank, world):
    out = {"cases": model_cases()}
    checks = itertools.cycle(("tolerance", "bitwise"))
    current = None
    for feature, parallel, settings in out["cases"]:
        if current != parallel:
            tg.init_parallel(**PARALLEL[parallel][0])
            current = parallel
        for recompute in ("none", *CHECKPOINT_KEEPS):
            check = next(checks)
            out[(feature, parallel, recompute)] = model_step(feature, parallel, settings, recompute, check)
            out[(feature, parallel, recompute)]["check"] = check
    tg.init_parallel(context_parallel_size=4)
    # full recompute on the first unpacked CP-4 GPT case with a head all-to-all, for its bytes and kernel forwards
    feature, _, settings = next(
        c for c in out["cases"] if c[1] == "cp4" and c[2][0] > 1 and not c[0].startswith(("mla", "packed"))
    )
    out["full"] = (feature, model_step(feature, "cp4", settings, "full"))
    # the storage check's negative control: the keeper's copy of a recorded view of its inputs switched off, at
    # hp 1 with one sequence (the head layout of q is then a view of the rotated q)
    feature, _, settings = next(c for c in out["cases"] if c[1] == "cp4" and c[2][0] == 1 and c[0].startswith("packed"))
    with unguarded_kept_forward():
        out["unguarded"] = (feature, model_step(feature, "cp4", settings, "attention-inputs"))
    for feature, keep, check in DIFFERENT:
        out[("different", feature, keep, check)] = different_replay(feature, keep, check)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def models():
    with te_norms():
        return run_on_ranks(4, run_models, timeout_s=400)[0]


def _cases(models):
    return [(f, p) for f, p, _ in models["cases"]]


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_model_gradients_equal_no_recompute(models, keep):
    for feature, parallel in _cases(models):
        errors = tg.compare_results(models[(feature, parallel, keep)], models[(feature, parallel, "none")])
        bad = {k: e for k, e in errors.items() if not e < RTOL}
        assert not bad and len(errors) > 10, (feature, parallel, bad)


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_model_recompute_runs_no_kernel_forward_and_sends_what_its_policy_says(models, keep):
    for feature, parallel in _cases(models):
        run, none = models[(feature, parallel, keep)], models[(feature, parallel, "none")]
        first, recompute = run["calls"]["first"], run["calls"]["recompute"]
        assert len(first) == len(recompute) > 0, (feature, parallel)
        assert run["kernels"] == none["kernels"] > 0, (feature, parallel)  # kernels forward once per layer
        assert all(r["kernels"] == 0 and all(r["bytes"][k] == 0 for k in RING_KINDS) for r in recompute)
        head = sorted(f["bytes"]["all_to_all"] if keep == "outputs" else 0 for f in first)
        assert sorted(r["bytes"]["all_to_all"] for r in recompute) == head, (feature, parallel)  # any order
        sent = {k: none["bytes"][k] + sum(r["bytes"][k] for r in recompute) for k in none["bytes"]}
        assert run["bytes"] == sent, (feature, parallel)
    feature, full = models["full"]
    none, outputs = models[(feature, "cp4", "none")], models[(feature, "cp4", "outputs")]
    assert full["kernels"] == 2 * none["kernels"]
    assert outputs["bytes"]["all_to_all"] == full["bytes"]["all_to_all"] > none["bytes"]["all_to_all"]  # as full
    assert all(outputs["bytes"][k] == none["bytes"][k] for k in RING_KINDS)  # no ring
    assert any(full["bytes"][k] > none["bytes"][k] for k in RING_KINDS)


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_nothing_of_mixed_qkv_or_the_rotated_q_k_survives_the_first_pass(models, keep):
    """Saved-tensor hooks and the keepers' kept tensors against the storages of the first pass's core attention
    inputs (rotated q and k; v, a view of Megatron's QKV projection output) and of that output itself. With the
    keeper's copy of recorded input views switched off, the same check finds the rotated q kept (it can fail)."""
    for feature, parallel in _cases(models):
        run = models[(feature, parallel, keep)]
        assert run["watched"] >= 2 and run["kept"] > 0 and run["leaks"] == 0, (feature, parallel, run["leaks"])
        if not feature.startswith("mla"):
            assert run["v_in_mixed_qkv"], (feature, parallel)  # v's storage is the QKV projection output's
    feature, unguarded = models["unguarded"]
    assert unguarded["leaks"] > 0 and models[(feature, "cp4", "attention-inputs")]["leaks"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_kept_tensors_are_released(models):
    for feature, parallel in _cases(models):
        for keep in CHECKPOINT_KEEPS:
            run = models[(feature, parallel, keep)]
            assert run["fifo_after"] == 0 and run["kept_alive"] == 0, (feature, parallel, keep)


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("feature, keep, check", DIFFERENT)
def test_a_different_replay_is_caught(models, feature, keep, check):
    """The recompute of q/k/v (GPT's QKV projection) or of MLA's latent nudged by 1e-3 in the recompute only:
    refused under both policies and both checks ("outputs" keeps no q/k/v, its check samples the recomputed
    ones against a few elements kept from the first pass)."""
    name = "latent" if feature == "mla_latent" else "q"
    assert f"the recomputed {name} differs from the first pass" in models[("different", feature, keep, check)]


@pytest.mark.distributed
@pytest.mark.megatron
def test_model_cases_cover_every_layout_feature_and_schedule(models):
    cases = models["cases"]
    for cp in (2, 4):
        layouts = {(l.head_parallel_size, l.inner_ring_size, l.placement) for l in every_layout(cp)}
        assert {s for _, p, s in cases if PARALLEL[p][1] == cp} == layouts, cp
    assert {f for f, _, _ in cases} == set(FEATURES) and {p for _, p, _ in cases} == set(PARALLEL)
    assert {models[(f, p, k)]["check"] for f, p, _ in cases for k in CHECKPOINT_KEEPS} == {"tolerance", "bitwise"}
    # Megatron's per-sequence split runs through the spec's SelfAttention2D, MLA's latent ring through its own
    assert {models[(f, p, "outputs")]["self_attention"] for f, p, _ in cases if f == "packed_sequence"} == {
        "SelfAttention2D"
    }
    assert {models[(f, p, "outputs")]["self_attention"] for f, p, _ in cases if f == "mla_latent"} == {
        "MLASelfAttention2D"
    }


# ---- the keeper alone (one process): refusal of a recompute that differs, settings ----------------------------


def _attention(q, k, v, kept=None):
    """A stand-in for the op in the keeper's checks (the check runs before the op is called)."""
    from megatron_2d.testing.reference import reference_attention

    return reference_attention(q, k, v, True, 0.25)


@pytest.fixture
def checkpointing(monkeypatch):
    monkeypatch.setattr(checkpoint_plus, "is_checkpointing", lambda: True)


def _first_pass(keeper, q, k, v, attention=_attention):
    """What megatron's checkpointed forward does: the layer under no_grad, inside its checkpoint."""
    with torch.no_grad():
        return keeper(attention, q, k, v)


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_recompute_that_differs_is_refused(checkpointing, keep, which):
    """A recomputed input that is not the first pass's (here: another micro-batch's q, k or v) must raise, not
    silently return the kept output of different inputs."""
    keeper = checkpoint_plus.AttentionKeeper(keep=keep)
    q, k, v = _qkv(1)
    _first_pass(keeper, q, k, v)
    other = dict(zip("qkv", _qkv(2)))
    inputs = {"q": q, "k": k, "v": v, which: other[which]}
    with pytest.raises(RuntimeError, match=f"the recomputed {which} differs from the first pass"):
        keeper(_attention, *(inputs[n].requires_grad_(True) for n in "qkv"))


@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_recompute_differing_in_one_token_is_refused(checkpointing, keep):
    """A recompute that differs in the last token only (e.g. a non-deterministic op near the end)."""
    keeper = checkpoint_plus.AttentionKeeper(keep=keep)
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


def test_recompute_of_another_shape_is_refused(checkpointing):
    keeper = checkpoint_plus.AttentionKeeper()
    q, k, v = _qkv(3)
    _first_pass(keeper, q, k, v)
    shapes = r"the recomputed q has shape \(8, 1, 4, 8\), the first pass \(16, 1, 4, 8\)"
    with pytest.raises(RuntimeError, match=shapes):
        keeper(_attention, q[:8].requires_grad_(True), k, v)


def test_recompute_without_a_first_pass_is_refused(checkpointing):
    keeper = checkpoint_plus.AttentionKeeper()
    with pytest.raises(RuntimeError, match="found no kept attention"):
        keeper(_attention, *(x.requires_grad_(True) for x in _qkv(5)))


def test_a_replay_along_another_path_is_refused():
    """A recompute that reaches a point its first pass did not record (another attention path) raises."""
    kept = KeptForward("attention-inputs", ())
    kept.record("ring", (torch.zeros(1),))
    kept.start_replay()
    assert len(kept.replay("ring")) == 1 and not list(kept.tensors())  # given once, then let go
    for point in ("to_heads", "ring"):  # never recorded; recorded, but replayed already
        with pytest.raises(RuntimeError, match=rf"the recompute reached '{point}', which its first pass did not"):
            kept.replay(point)


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

    def bf16_attention(q, k, v, kept=None):
        return _attention(q.double(), k.double(), v.double()).bfloat16()

    keeper = checkpoint_plus.AttentionKeeper(check)
    q, k, v = _bf16_qkv(7)
    _first_pass(keeper, q, k, v, bf16_attention)
    noisy = [_one_ulp_off(x).requires_grad_(True) for x in (q, k, v)]
    if check == "tolerance":
        keeper(bf16_attention, *noisy)
    else:
        with pytest.raises(
            RuntimeError,
            match=r"the recomputed q differs from the first pass \(max relative difference .* allowed 0\)",
        ):
            keeper(bf16_attention, *noisy)
    _first_pass(keeper, q, k, v, bf16_attention)
    with pytest.raises(RuntimeError, match=r"the recomputed q differs from the first pass"):
        keeper(bf16_attention, *(x.requires_grad_(True) for x in _bf16_qkv(8)))


@pytest.mark.parametrize("keep", CHECKPOINT_KEEPS)
def test_recompute_check_makes_no_host_sync(checkpointing, keep):
    """The keeper's first pass and its check run under the hot-path guards (no scalar read, no torch.equal, no
    tensor from Python data); the check's verdict is read from host memory (on CUDA: a pinned copy, once landed)."""
    from megatron_2d.testing.no_sync import NoHostDataInOp, NoSyncOps

    keeper = checkpoint_plus.AttentionKeeper(keep=keep)
    q, k, v = _qkv(9)
    with NoHostDataInOp(), NoSyncOps():
        _first_pass(keeper, q, k, v)
        keeper(_attention, *(x.clone().requires_grad_(True) for x in (q, k, v)))
    with pytest.raises(AssertionError, match="hot path"), NoSyncOps():
        torch.equal(q, k)  # the guard catches what the old check did


def test_unknown_check_and_keep_are_refused():
    with pytest.raises(ValueError, match=r"check 'exact' is not one of \['tolerance', 'bitwise'\]"):
        checkpoint_plus.AttentionKeeper("exact")
    with pytest.raises(ValueError, match=r"keep 'inputs' is not one of \['outputs', 'attention-inputs'\]"):
        checkpoint_plus.AttentionKeeper(keep="inputs")
    for field, message in (
        ("selective_checkpoint_plus_plus_check", "selective_checkpoint_plus_plus_check 'exact' is not one of"),
        ("selective_checkpoint_plus_plus_keep", "selective_checkpoint_plus_plus_keep 'exact' is not one of"),
    ):
        with pytest.raises(ValueError, match=message):
            TransformerConfig2D(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=8,
                attention_dropout=0.0,
                selective_checkpoint_plus_plus=True,
                **CKPT,
                **{field: "exact"},
            )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(selective_checkpoint_plus_plus=True), r"recompute_granularity is None; set recompute_granularity='full'"),
        (
            dict(selective_checkpoint_plus_plus=True, recompute_granularity="selective"),
            r"recompute_granularity is 'selective'",
        ),
        (
            dict(selective_checkpoint_plus_plus_keep="attention-inputs"),
            r"\{'selective_checkpoint_plus_plus_keep': 'attention-inputs'\} set without selective_checkpoint_plus_plus",
        ),
        (
            dict(selective_checkpoint_plus_plus_check="bitwise", **CKPT),
            r"\{'selective_checkpoint_plus_plus_check': 'bitwise'\} set without selective_checkpoint_plus_plus",
        ),
    ],
)
def test_misuse_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig2D(num_layers=2, hidden_size=64, num_attention_heads=8, attention_dropout=0.0, **overrides)


def test_fp8_recompute_is_refused():
    from types import SimpleNamespace

    why = checkpoint_plus.check_checkpoint_plus_config(SimpleNamespace(recompute_granularity="full", fp8="hybrid"))
    assert why is not None and "not supported with fp8/fp4 recompute" in why
    assert checkpoint_plus.check_checkpoint_plus_config(SimpleNamespace(recompute_granularity="full")) is None
