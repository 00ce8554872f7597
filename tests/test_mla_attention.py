"""MLA's attention on forked ranks: a value head dim narrower than the query/key head dim (192 / 128), and the
latent ring.

attention_2d (stage 1): K and V travel side by side, unpadded; kernels that need equal head dims (torch's CPU flash
kernel, flash-attn 2) get V padded as Transformer Engine pads it. latent_attention_2d (stage 2): the ring carries
the latent and the rope key, each rank up-projects every block for its heads. Every case compares out and every
gradient (the up-projection weight's, summed over the CP group, included) with a single-process fp64 reference on
the same layout helper's shards; Transformer Engine's four MLA CP configs run in bf16 with TE's tolerances; the
ring bytes of both stages follow their closed forms, at DeepSeek-V3's dims.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_2d
import megatron_2d.attention  # noqa: F401  imported once here, not in every forked rank (PEP 562 exports)
import megatron_2d.latent_attention  # noqa: F401
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.base import PaddedValueKernel
from megatron_2d.testing.distributed import GROUP_TIMEOUT, RankFailure, run_on_ranks
from megatron_2d.testing.reference import (
    TOLERANCES,
    packed_reference_attention,
    reference_attention,
    reference_on_rank,
    rel_err,
    rounded,
)
from megatron_2d_dev.shared_worlds import run_each_on_ranks, selected_params

TIMEOUT = GROUP_TIMEOUT
DK, DV = 24, 16  # query/key and value head dims of the small cases (192 / 128 scaled down)

# (world, hp, w, placement): head-only, ring-only (inner and outer), 2D with Double-Ring, context_first
LAYOUTS = [
    (4, 1, 4, "head_first"),
    (4, 2, 1, "context_first"),
    (4, 4, 1, "head_first"),
    (8, 2, 2, "head_first"),
    (8, 1, 2, "head_first"),
    (8, 8, 1, "head_first"),
]
# (causal, sliding window, batch, kernel, K/V heads): full and causal, a window narrow enough for the neighbour
# exchange and one the Double-Ring carries, a window open on both sides, batch 1,
# torch_math (native unequal head dims) besides cpu_flash (V padded), and one GQA case
CASES = [
    (True, (-1, -1), 2, None, 8),
    (False, (-1, -1), 2, None, 8),
    (True, (3, 0), 2, None, 8),
    (True, (40, 0), 1, None, 8),
    (False, (5, 7), 2, None, 8),
    (True, (-1, -1), 1, "torch_math", 8),
    (False, (9, 2), 2, "torch_math", 8),
    (True, (-1, -1), 2, None, 2),
]


def _inputs(S, b, hq, hkv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(S, b, h, d, generator=g, dtype=torch.float64) for h, d in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv))
    ]  # q, k, v, dout


@functools.cache
def mla_reference(world, i):
    """Case ``i`` of CASES at ``world`` ranks (i = len(CASES): the packed documents): its inputs (q, k, v, dout) and
    fp64 reference (out, dq, dk, dv), computed once in the test process (:func:`mla_references`) for the forked
    ranks, which inherit the cache, instead of on every rank."""
    if i == len(CASES):
        q, k, v, dout = (x[:, 0] for x in _inputs(int(PACKED_CU[-1]), 1, 8, 8, DK, DV, seed=11))
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        expected = packed_reference_attention(*leaves, PACKED_CU, True, DK**-0.5, window=(20, 0))
    else:
        causal, window, batch, _, hkv = CASES[i]
        q, k, v, dout = _inputs(16 * world, batch, 8, hkv, DK, DV, seed=i)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        expected = reference_attention(*leaves, causal, 0.3, window=window)
    expected.backward(dout)
    return (q, k, v, dout), (expected.detach(), *(x.grad for x in leaves))


def mla_references(world):
    for i in range(len(CASES) + 1):
        mla_reference(world, i)
    for i, (case, packed) in enumerate(latent_runs(2)):
        latent_reference(int(PACKED_CU[-1]) if packed else 16 * world, i, *case, packed)


PACKED_CU = torch.tensor(np.cumsum([0, 3, 40, 9, 70, 6]), dtype=torch.int32)


def mla_cases(rank, world, hp, w, placement):
    groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
    shard = lambda x: megatron_2d.shard_sequence(x, rank, world)  # noqa: E731
    errors = {}
    for i, (causal, window, batch, kernel, hkv) in enumerate(CASES):
        (q, k, v, dout), (expected, dq, dk, dv) = mla_reference(world, i)
        ql, kl, vl = (shard(x).float().requires_grad_(True) for x in (q, k, v))
        out = megatron_2d.attention_2d(
            ql, kl, vl, groups, causal=causal, softmax_scale=0.3, kernel=kernel, sliding_window=window
        )
        assert out.shape == (16, batch, 8, DV) and out.is_contiguous()
        out.backward(shard(dout).float())
        errors[(causal, window, batch, kernel, hkv)] = max(
            rel_err(a, shard(e)) for a, e in ((out, expected), (ql.grad, dq), (kl.grad, dk), (vl.grad, dv))
        )
    # packed documents (THD), both modes, with a window
    cu = PACKED_CU
    for mode in ("zigzag", "documents"):
        layout = megatron_2d.PackedSharding(cu, groups, mode=mode)
        (q, k, v, dout), (expected, dq, dk, dv) = mla_reference(world, len(CASES))
        ql, kl, vl = (layout.shard(x).float().requires_grad_(True) for x in (q, k, v))
        out = megatron_2d.attention_2d(ql, kl, vl, groups, sliding_window=(20, 0), packing=layout)
        out.backward(layout.shard(dout).float())
        errors[("packed", mode)] = max(
            ((a.double() - layout.shard(e)).abs().max() / e.abs().max()).item()
            for a, e in ((out, expected), (ql.grad, dq), (kl.grad, dk), (vl.grad, dv))
        )
    packings = [(cu, megatron_2d.PackedSharding(cu, groups, mode=mode)) for mode in ("zigzag", "documents")]
    errors.update(latent_cases(groups, rank, world, shard, packings))
    return errors


NOPE, ROPE, VALUE, RANK = 6, 4, 5, 7  # qk_head_dim, qk_pos_emb_head_dim, v_head_dim, kv_lora_rank (small)
# (causal, sliding window, batch, sinks): the latent ring on the Double-Ring, the neighbour exchange, batch 1
LATENT_CASES = [
    (True, (-1, -1), 2, False),
    (False, (-1, -1), 1, False),
    (True, (3, 0), 2, False),
    (True, (40, 0), 1, True),
    (False, (5, 7), 2, False),
]


def _latent_inputs(T, batch, hq, seed):
    """q [T, b, hq, dn + dr], latent [T, b, r + dr], the up-projection weight [hq * (dn + dv), r] and dout, fp64."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((T, batch, hq, NOPE + ROPE), (T, batch, RANK + ROPE), (hq * (NOPE + VALUE), RANK), (T, batch, hq, VALUE))
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _expand(latent, weight, hq, nope=NOPE, value=VALUE, rank=RANK):
    """Per-head (k, v) of MLA from latent [..., r + dr] and weight [hq * (dn + dv), r] (the reference's own)."""
    kv = torch.einsum("...r,hdr->...hd", latent[..., :rank], weight.view(hq, nope + value, rank))
    k_rope = latent[..., rank:].unsqueeze(-2).expand(*kv.shape[:-1], latent.shape[-1] - rank)
    return torch.cat([kv[..., :nope], k_rope], dim=-1), kv[..., nope:]


def latent_runs(packings: int):
    """((causal, window, batch, sinks), packed) of LATENT_CASES (sbhd), then of ``packings`` packed layouts."""
    return [(case, False) for case in LATENT_CASES] + [((True, (20, 0), 1, False), True)] * packings


@functools.cache
def latent_reference(T, i, causal, window, batch, with_sinks, packed):
    """Run ``i`` of :func:`latent_runs`: its inputs (q, latent, weight, dout, sinks) and fp64 reference (out, dq,
    d latent, d weight, d sinks), computed once in the test process for the forked ranks (:func:`mla_reference`)."""
    q, latent, weight, dout = _latent_inputs(T, batch, 8, seed=20 + i)
    sinks = torch.linspace(-1, 1, 8, dtype=torch.float64) if with_sinks else None
    if packed:
        q, latent, dout = q[:, 0], latent[:, 0], dout[:, 0]
    leaves = [x.clone().requires_grad_(True) for x in (q, latent, weight) + ((sinks,) if with_sinks else ())]
    k, v = _expand(leaves[1], leaves[2], 8)
    if packed:
        expected = packed_reference_attention(leaves[0], k, v, PACKED_CU, causal, 0.3, window=window)
    else:
        expected = reference_attention(
            leaves[0], k, v, causal, 0.3, window=window, sinks=leaves[3] if with_sinks else None
        )
    expected.backward(dout)
    return (q, latent, weight, dout, sinks), (expected.detach(), *(x.grad for x in leaves))


def latent_cases(groups, rank, world, shard, packings=()):
    """Errors of latent_attention_2d against the fp64 reference for LATENT_CASES (sbhd) and ``packings``."""
    errors = {}
    for i, ((causal, window, batch, with_sinks), packed) in enumerate(latent_runs(len(packings))):
        packing = packings[i - len(LATENT_CASES)] if packed else None
        T = int(PACKED_CU[-1]) if packed else 16 * world
        (q, latent, weight, dout, sinks), (expected, *grads) = latent_reference(
            T, i, causal, window, batch, with_sinks, packed
        )
        if packing:
            assert torch.equal(packing[0], PACKED_CU)
            shard = packing[1].shard
        ql, ll = (shard(x).float().requires_grad_(True) for x in (q, latent))
        wl = weight.float().requires_grad_(True)
        sl = sinks.float().requires_grad_(True) if with_sinks else None
        out = megatron_2d.latent_attention_2d(
            ql,
            ll,
            wl,
            groups,
            nope_dim=NOPE,
            value_dim=VALUE,
            causal=causal,
            softmax_scale=0.3,
            sliding_window=window,
            sinks=sl,
            packing=packing[1] if packing else None,
        )
        out.backward(shard(dout).float())
        replicated = [wl.grad] + ([sl.grad] if with_sinks else [])  # CP ranks hold shares: summed over CP
        for grad in replicated:
            dist.all_reduce(grad)
        pairs = [(out, expected), (ql.grad, grads[0]), (ll.grad, grads[1])]
        errs = [(a.double() - shard(e)).abs().max().item() / e.abs().max().item() for a, e in pairs]
        errs += [rel_err(g, e) for g, e in zip(replicated, grads[2:])]
        errors[("latent", causal, window, batch, with_sinks, packing[1].mode if packing else None)] = max(errs)
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world, hp, w, placement", LAYOUTS, ids=[f"N{n}-hp{h}-w{w}-{p}" for n, h, w, p in LAYOUTS])
def test_mla_attention_is_exact(world, hp, w, placement):
    """Stage 1 (attention_2d with dk != dv) and stage 2 (latent_attention_2d) on one layout, one fork."""
    mla_references(world)  # computed here once for the forked ranks
    for errors in run_on_ranks(world, mla_cases, hp, w, placement, timeout_s=300):
        bad = {case: err for case, err in errors.items() if not err < TOLERANCES[torch.float32].end_to_end}
        assert not bad, bad
        assert len(errors) == len(CASES) + 2 + len(LATENT_CASES) + 2


# Transformer Engine's MLA context-parallel configs (tests/pytorch/attention/test_attention_with_cp.py,
# model_configs_flash_attn): b 2, s 4096, heads 128 (cp_3_0) or 12, qk head dim 192, v head dim 128. Only the
# sequence is shortened, to what two CPU cores run in seconds (cp_3_0's 128 heads most); batch, heads, head dims and
# masks are TE's, and the windows stay 512 tokens, so that each still cuts the sequence (2048 tokens: 4 windows).
TE_MLA_CONFIGS = {
    #          heads, causal, window,      seq (TE: 4096)
    "cp_3_0": (128, True, (-1, -1), 256),
    "cp_3_1": (12, False, (-1, -1), 1024),
    "cp_3_2": (12, True, (512, 0), 2048),
    "cp_3_3": (12, False, (512, 512), 2048),
}
TE_TOLERANCES = {torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}  # run_attention_with_cp.py's, bf16
# TE's absolute bound is loose for outputs of a few hundredths (full attention averages many values), so each
# tensor must also stay within our bf16 end-to-end bound relative to its largest value


@functools.cache
def te_mla_inputs(name):
    """q, k, v, dout of a config (bf16 numbers, in fp32): made once in the test process for its forked ranks (the
    fp64 draws and their rounding were a third of each rank's time)."""
    heads, _, _, seq = TE_MLA_CONFIGS[name]
    return tuple(rounded(x, torch.bfloat16).float() for x in _inputs(seq, 2, heads, heads, 192, 128, seed=3))


def te_mla_config(rank, world, name, inputs):
    heads, causal, window, seq = TE_MLA_CONFIGS[name]
    groups = megatron_2d.build_2d_groups(2, 2, "head_first", timeout=TIMEOUT)
    q, k, v, dout = inputs
    shard = lambda x: megatron_2d.shard_sequence(x, rank, world)  # noqa: E731
    expected = reference_on_rank(q, k, v, dout, rank, world, causal=causal, window=window, dtype=torch.float32)
    ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, causal=causal, sliding_window=window)
    out.backward(shard(dout).to(torch.bfloat16))
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), expected):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, **TE_TOLERANCES[torch.bfloat16])
        assert rel_err(got, want) < TOLERANCES[torch.bfloat16].end_to_end
    return groups.comm_bytes.as_dict()


@pytest.fixture(scope="module")
def te_mla_results(request):
    """The selected configs, in one forked world of 4 ranks (megatron_2d_dev.shared_worlds)."""
    names = selected_params(request, "test_transformer_engine_mla_cp_configs", "name")
    calls = [(te_mla_config, (name, te_mla_inputs(name))) for name in names]
    return dict(zip(names, run_each_on_ranks(4, calls, timeout_s=300)))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TE_MLA_CONFIGS))
def test_transformer_engine_mla_cp_configs(te_mla_results, name):
    for sent in te_mla_results[name]:
        assert sent["all_to_all"] > 0  # hp 2 x cp 2: the head all-to-all and the ring both ran
        assert sent["inner_ring"] + sent["neighbour"] > 0


def test_padded_value_kernel_matches_native_unequal_dims():
    """cpu_flash needs equal head dims: for dv < dk it runs through PaddedValueKernel, which must equal torch_math
    (native unequal dims) call by call, banded calls (tiled) included."""
    from megatron_2d.layout.band import Band
    from megatron_2d.layout.block_calls import BlockCall

    flash = select_kernel(torch.device("cpu"), torch.float64, "cpu_flash")
    math_kernel = select_kernel(torch.device("cpu"), torch.float64, "torch_math")
    assert flash.for_head_dims(32, 32) is flash and math_kernel.for_head_dims(32, 16) is math_kernel
    padded = flash.for_head_dims(32, 16)
    assert isinstance(padded, PaddedValueKernel) and padded.name == "cpu_flash"
    with pytest.raises(ValueError, match="value head dim 40 exceeds the query/key head dim 32"):
        flash.for_head_dims(32, 40)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 160, 4, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 150, 2, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 150, 2, 16, generator=g, dtype=torch.float64)
    calls = (
        BlockCall(0, 160, 0, 150, None),
        BlockCall(0, 150, 0, 150, Band(None, 0)),
        BlockCall(10, 160, 0, 150, Band(-20, 0)),
    )  # full, causal, narrow band (tiled)
    for call in calls:
        rows, keys = slice(call.q_start, call.q_end), slice(call.k_start, call.k_end)
        ((_, out, lse),) = padded.forward_calls(q, k, v, (call,), 0, 0.2)
        ((_, out_ref, lse_ref),) = math_kernel.forward_calls(q, k, v, (call,), 0, 0.2)
        assert out.shape[-1] == 16 and rel_err(out, out_ref) < 1e-12 and rel_err(lse, lse_ref) < 1e-12
        full_out = torch.zeros(2, 160, 4, 16, dtype=torch.float64)
        full_lse = torch.zeros(2, 4, 160, dtype=torch.float64)
        full_out[:, rows], full_lse[:, :, rows] = out_ref, lse_ref
        dout = torch.randn(2, 160, 4, 16, generator=g, dtype=torch.float64)
        kernel_dout, kernel_out = padded.backward_inputs(dout, full_out)  # padded once per backward
        ((_, *grads),) = padded.backward_calls(kernel_dout, q, k, v, kernel_out, full_lse, (call,), 0, 0.2)
        ((_, *grads_ref),) = math_kernel.backward_calls(dout, q, k, v, full_out, full_lse, (call,), 0, 0.2)
        assert grads[2].shape[-1] == 16
        assert all(rel_err(a, e) < 1e-12 for a, e in zip(grads, grads_ref)), (call, keys)


def wider_value(rank, world):
    groups = megatron_2d.build_2d_groups(1, 1, timeout=TIMEOUT)
    q, k, v = (torch.zeros(8, 1, 2, d) for d in (16, 16, 24))
    megatron_2d.attention_2d(q, k, v, groups)


@pytest.mark.distributed
def test_value_wider_than_key_is_refused_by_name():
    with pytest.raises(RankFailure, match="value head dim 24 exceeds the query/key head dim 16: the cpu_flash"):
        run_on_ranks(1, wider_value)


# DeepSeek-V3's attention at TP = 8: 128 / 8 = 16 heads per TP rank, qk 128 + rope 64, v 128, kv_lora_rank 512
DSV3_TP8 = dict(heads=16, nope=128, rope=64, value=128, rank=512)


def ring_bytes_per_token(values_per_token: int, cp: int, elem: int = 2, rider_elem: int = 4) -> int:
    """Closed form: bytes one rank sends round the ring per token of its block, forward + backward. Blocks of
    ``values_per_token`` values in the input dtype make cp - 1 hops forward and again in backward; their gradient
    riders (fp32, the default dkv_comm_dtype) cp - 1 hops."""
    return (cp - 1) * values_per_token * (2 * elem + rider_elem)


def ring_bytes(rank, world, hp):
    """Per-token ring bytes of one fwd+bwd of each stage at DeepSeek-V3's dims (bf16, 8 tokens per rank)."""
    d = DSV3_TP8
    groups = megatron_2d.build_2d_groups(hp, world // hp, timeout=TIMEOUT)
    g = torch.Generator().manual_seed(0)
    s_local, heads, dk = 8, d["heads"], d["nope"] + d["rope"]
    rand = lambda *shape: (0.1 * torch.randn(*shape, generator=g)).to(torch.bfloat16).requires_grad_(True)  # noqa
    q, latent = rand(s_local, 1, heads, dk), rand(s_local, 1, d["rank"] + d["rope"])
    weight = rand(heads * (d["nope"] + d["value"]), d["rank"])
    k, v = (
        x.to(torch.bfloat16).contiguous().requires_grad_(True)
        for x in _expand(latent.detach().float(), weight.detach().float(), heads, d["nope"], d["value"], d["rank"])
    )
    sent = {}
    for stage, run in (
        ("expanded", lambda: megatron_2d.attention_2d(q, k, v, groups)),
        (
            "latent",
            lambda: megatron_2d.latent_attention_2d(
                q, latent, weight, groups, nope_dim=d["nope"], value_dim=d["value"]
            ),
        ),
    ):
        groups.comm_bytes.reset()
        run().float().sum().backward()
        counted = groups.comm_bytes.as_dict()
        sent[stage] = (counted["inner_ring"] + counted["outer_ring"]) / (s_local * hp)  # per token of the block
    return sent


@pytest.mark.distributed
@pytest.mark.parametrize("hp", [1, 2])
def test_ring_bytes_follow_the_closed_form_and_the_latent_ring_sends_an_eighth(hp):
    world, d = 4, DSV3_TP8
    cp, local_heads = world // hp, d["heads"] // hp
    expanded = ring_bytes_per_token(local_heads * (d["nope"] + d["rope"] + d["value"]), cp)  # K and V per head
    latent = ring_bytes_per_token(d["rank"] + d["rope"], cp)  # once per token
    for sent in run_on_ranks(world, ring_bytes, hp, timeout_s=120):
        assert sent == {"expanded": expanded, "latent": latent}
    if hp == 1:  # DeepSeek-V3 at TP 8: 576 values per token against 16 x 320 = 5120
        assert latent / expanded <= 1 / 8


@pytest.mark.parametrize(
    "shape, dtype, message",
    [
        (
            (8, 4, 24),
            torch.float32,
            r"q must be 4-D \[s, b, heads, d\] \(Megatron sbhd\); a 3-D \(THD\) q \(8, 4, 24\)",
        ),
        ((8, 1, 4, 24, 1), torch.float32, r"q must be 4-D \[s, b, heads, d\] \(Megatron sbhd\), got shape"),
        ((8, 1, 4, 24), torch.int32, r"dtype torch.int32 is not supported"),
        ((7, 1, 4, 24), torch.float32, r"the local sequence length 7 must be even"),
    ],
)
def test_latent_query_check_names_q_alone(shape, dtype, message):
    """MLA's op checks q by itself (there are no k and v): check_query, not check_inputs(q, q, q)."""
    from megatron_2d.attention import check_query

    with pytest.raises(ValueError, match=message):
        check_query(torch.zeros(shape, dtype=dtype))
    check_query(torch.zeros(8, 1, 4, 24))
    check_query(torch.zeros(7, 1, 4, 24), packed=True)  # THD slots as [t_local, 1, heads, d]: any count
