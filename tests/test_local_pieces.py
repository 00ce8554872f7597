"""Single-process pieces: the (out, lse) merge, the block plan, the local kernels."""

import itertools

import pytest
import torch

from megatron_2d.band import Band
from megatron_2d.block_plan import BlockCall, plan_block
from megatron_2d.kernels import KERNELS, select_kernel
from megatron_2d.merge import merge_attention_
from megatron_2d.sequence_layout import shard_sequence, unshard_sequence

from megatron_2d.testing.reference import TOLERANCE, attention_with_lse, rel_err


def test_merge_equals_full_softmax():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 12, 3, 8, dtype=torch.float64), torch.randn(2, 12, 3, 8, dtype=torch.float64)
    full, full_lse = attention_with_lse(q, k, v)
    out = torch.zeros(2, 5, 3, 8, dtype=torch.float64)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 5), slice(5, 12)):  # uneven blocks, any order
        o, l = attention_with_lse(q, k[:, part], v[:, part])
        merge_attention_(out, lse, o, l)
    assert rel_err(out, full) < 1e-12 and rel_err(lse, full_lse) < 1e-12


def test_merge_row_subsets_in_place():
    """Merging into row views of larger buffers (as the ring does) updates only those rows."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    out = torch.zeros(1, 6, 2, 4, dtype=torch.float64)
    lse = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
    o, l = attention_with_lse(q[:, 2:4], k, v)
    merge_attention_(out[:, 2:4], lse[:, :, 2:4], o, l)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])) and torch.isinf(lse[:, :, 4:]).all()
    assert rel_err(out[:, 2:4], o) < 1e-12


def test_plan_zigzag_half_blocks():
    # CP=4, hp=1: context rank 1 holds chunks (1, 6).
    assert plan_block([1, 6], [1, 6], 4, causal=True) == [BlockCall(0, 8, 0, 8, Band(None, 0))]
    assert plan_block([1, 6], [0, 7], 4, causal=True) == [BlockCall(0, 8, 0, 4, None)]   # all Q, first half K
    assert plan_block([1, 6], [3, 4], 4, causal=True) == [BlockCall(4, 8, 0, 8, None)]   # second half Q, all K
    assert plan_block([1, 6], [3, 4], 4, causal=False) == [BlockCall(0, 8, 0, 8, None)]


def test_plan_matches_token_mask():
    """Every plan, for arbitrary disjoint chunk sets, reproduces the token-level causal mask exactly."""
    c = 2
    for q_chunks, kv_chunks in [([0, 3, 4, 7], [1, 2, 5, 6]), ([1, 2, 5, 6], [0, 3, 4, 7]), ([2, 9], [0, 1, 10, 11])]:
        mask = torch.zeros(len(q_chunks) * c, len(kv_chunks) * c, dtype=torch.bool)
        for call in plan_block(q_chunks, kv_chunks, c, causal=True):
            assert call.band is None
            mask[call.q_start:call.q_end, call.k_start:call.k_end] = True
        qpos = torch.tensor([x * c + t for x in q_chunks for t in range(c)])
        kpos = torch.tensor([y * c + t for y in kv_chunks for t in range(c)])
        assert torch.equal(mask, kpos[None, :] < qpos[:, None])


def test_shard_round_trip_matches_megatron():
    x = torch.arange(2 * 48).view(2, 48)
    for cp in (1, 2, 3, 4):
        shards = [shard_sequence(x, r, cp, seq_dim=1) for r in range(cp)]
        assert torch.equal(unshard_sequence(shards, seq_dim=1), x)
        # the index formula of Megatron's get_batch_on_this_cp_rank
        for r in range(cp):
            v = x.view(2, 2 * cp, 48 // (2 * cp))
            idx = torch.tensor([r, 2 * cp - r - 1])
            assert torch.equal(shards[r], v.index_select(1, idx).reshape(2, -1))


def test_shard_rejects_indivisible_sequence():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*CP = 4.*multiple of 4 \(e.g. 8 or 12\)"):
        shard_sequence(torch.zeros(10), 0, 2)


CPU_KERNELS = [name for name in KERNELS if name != "flash_attn2"]


@pytest.mark.parametrize("name, dtype, causal, hkv", [
    (n, dt, c, h) for n, dt, c, h in itertools.product(
        CPU_KERNELS, [torch.float32, torch.bfloat16, torch.float16], [True, False], [4, 2, 1])])
def test_kernel_forward_backward(name, dtype, causal, hkv):
    torch.manual_seed(2)
    b, sq, hq, d = 2, 16, 4, 32
    sk = sq if causal else 24
    q64 = torch.randn(b, sq, hq, d, dtype=torch.float64, requires_grad=True)
    k64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    v64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, sq, hq, d, dtype=torch.float64)
    ref, ref_lse = attention_with_lse(q64, k64, v64, causal, 0.3)
    ref.backward(dout)
    kernel = select_kernel(torch.device("cpu"), dtype, name)
    q, k, v = (x.detach().to(dtype) for x in (q64, k64, v64))
    band = Band(None, 0) if causal else None
    out, lse = kernel.forward(q, k, v, band, 0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    dq, dk, dv = kernel.backward(dout.to(dtype), q, k, v, out, lse, band, 0.3)
    tol = TOLERANCE[dtype]
    for got, want in ((out, ref), (lse, ref_lse), (dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert got.shape == want.shape
        assert rel_err(got, want) < tol


def test_kernel_selection():
    assert select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    assert select_kernel(torch.device("cpu"), torch.float32, "torch_math").name == "torch_math"
    with pytest.raises(ValueError, match=r"unknown attention kernel 'nope'; choose one of"):
        select_kernel(torch.device("cpu"), torch.float32, "nope")
    with pytest.raises(ValueError, match=r"'flash_attn2' (is not available here|does not run on device cpu)"):
        select_kernel(torch.device("cpu"), torch.bfloat16, "flash_attn2")
