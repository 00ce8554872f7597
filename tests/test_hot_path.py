"""The op's hot path: no per-call setup, no host-device synchronisation; dK/dV rider dtype option."""

from __future__ import annotations

import contextlib

import pytest
import torch

import megatron_2d
from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.testing.distributed import GROUP_TIMEOUT, RankFailure, run_on_ranks
from megatron_2d.testing.no_sync import NoHostDataInOp, NoSyncOps
from megatron_2d.testing.reference import TOLERANCES, reference_attention, rel_err

pytestmark = pytest.mark.distributed

TIMEOUT = GROUP_TIMEOUT


def run_twice_guarded(rank, world, hp, w, window, batch, latent=False):
    groups = megatron_2d.build_2d_groups(hp, w, "head_first", timeout=TIMEOUT)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (
        megatron_2d.shard_sequence(torch.randn(64, batch, 4, 16, generator=g), rank, world) for _ in range(4)
    )
    # MLA's latent ring: q/k head dim 16 = 12 + 4 (rope), v head dim 8, latent 6 + 4, up-projection weight
    latent_in = megatron_2d.shard_sequence(torch.randn(64, batch, 10, generator=g), rank, world)
    weight, latent_dout = torch.randn(4 * (12 + 8), 6, generator=g), dout[..., :8].contiguous()

    def step():
        if latent:
            leaves = [x.clone().requires_grad_(True) for x in (q, latent_in, weight)]
            megatron_2d.latent_attention_2d(*leaves, groups, nope_dim=12, value_dim=8, sliding_window=window).backward(
                latent_dout
            )
        else:
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            megatron_2d.attention_2d(*leaves, groups, sliding_window=window).backward(dout)
        return [x.grad for x in leaves]

    first = step()  # builds the setup
    cached = dict(groups.op_cache)
    transport = next(iter(cached.values()))[1].transport
    sent = {kind for kind, n in groups.comm_bytes.as_dict().items() if n and kind != "all_to_all"}
    assert sent and sent <= set(transport.traffic_kinds), (sent, type(transport).__name__)  # what it says it sends
    with NoHostDataInOp(), NoSyncOps():
        second = step()
    assert len(cached) == 1 and groups.op_cache == cached  # the same setup objects, reused
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # the guards do catch what they guard against
    with pytest.raises(AssertionError, match="hot path"), NoSyncOps():
        torch.ones(2).sum().item()
    with pytest.raises(AssertionError, match="hot path"), NoHostDataInOp():
        torch.tensor([1, 2])
    return True


@pytest.mark.parametrize(
    "hp, w, window, batch",
    [(2, 1, (-1, -1), 2), (2, 1, (-1, -1), 1), (1, 2, (-1, -1), 2), (1, 1, (3, 0), 2)],
    ids=["2d_outer_ring", "2d_batch1", "ring_inner", "window_neighbour_exchange"],
)
def test_second_call_makes_no_setup_and_no_sync(hp, w, window, batch):
    assert all(run_on_ranks(4, run_twice_guarded, hp, w, window, batch))


@pytest.mark.parametrize(
    "hp, w, window, batch",
    [(2, 2, (-1, -1), 2), (2, 1, (-1, -1), 1), (1, 1, (3, 0), 2)],
    ids=["2d_double_ring", "2d_batch1", "window_neighbour_exchange"],
)
def test_latent_ring_second_call_makes_no_setup_and_no_sync(hp, w, window, batch):
    assert all(run_on_ranks(4, run_twice_guarded, hp, w, window, batch, latent=True))


def run_dkv_dtypes(rank, world):
    groups = megatron_2d.build_2d_groups(1, 1, timeout=TIMEOUT)
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(16 * world, 1, 4, 32, generator=g).to(torch.bfloat16).double() for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    reference_attention(*leaves, True, 32**-0.5).backward(dout)
    out = {}
    for mode in ("accumulator", "input"):
        ql, kl, vl = (
            megatron_2d.shard_sequence(x, rank, world).to(torch.bfloat16).requires_grad_(True) for x in (q, k, v)
        )
        groups.comm_bytes.reset()
        megatron_2d.attention_2d(ql, kl, vl, groups, dkv_comm_dtype=mode).backward(
            megatron_2d.shard_sequence(dout, rank, world).to(torch.bfloat16)
        )
        shard = lambda x: megatron_2d.shard_sequence(x, rank, world)  # noqa: E731
        out[mode] = (
            max(
                rel_err(ql.grad, shard(leaves[0].grad)),
                rel_err(kl.grad, shard(leaves[1].grad)),
                rel_err(vl.grad, shard(leaves[2].grad)),
            ),
            groups.comm_bytes.as_dict()["outer_ring"],
        )
    return out


def test_dkv_comm_dtype_bytes_and_error():
    world = 4
    results = run_on_ranks(world, run_dkv_dtypes)
    block = 2 * 1 * 16 * 4 * 32  # K and V of one context rank: 16 tokens, 4 heads, d 32 (elements)
    for r in results:
        exact_err, exact_bytes = r["accumulator"]
        input_err, input_bytes = r["input"]
        # w = 1: forward and backward each send cp-1 bf16 K/V blocks; backward riders make cp-1 hops
        assert exact_bytes == 2 * (world - 1) * block * 2 + (world - 1) * block * 4
        assert input_bytes == 2 * (world - 1) * block * 2 + (world - 1) * block * 2
        assert exact_err < TOLERANCES[torch.bfloat16].end_to_end and input_err < TOLERANCES[torch.bfloat16].end_to_end


def bad_dkv_dtype(rank, world):
    groups = megatron_2d.build_2d_groups(1, 1, timeout=TIMEOUT)
    megatron_2d.attention_2d(*(torch.zeros(4, 1, 2, 8) for _ in range(3)), groups, dkv_comm_dtype="fp8")


def test_dkv_comm_dtype_is_checked():
    with pytest.raises(RankFailure, match=r"dkv_comm_dtype 'fp8' is not one of \['accumulator', 'input'\]"):
        run_on_ranks(1, bad_dkv_dtype)


def run_flash_attn_varlen_new_batch(rank, world):
    """flash-attn's varlen path on the calls of a batch it has not seen: building the block's index tensors and
    running forward and backward make no host sync (the real flash-attn 2.8 Python layer over the CPU extension)."""
    from megatron_2d.kernels.flash_attn2 import FlashAttn2Kernel
    from megatron_2d.layout.band import Band
    from megatron_2d.layout.block_calls import BlockCall
    from megatron_2d_dev.flash_attn_package import load_release

    load_release("2.8.3.post2")
    kernel = FlashAttn2Kernel()
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 24, 4, 16, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 20, 2, 16, generator=g).bfloat16() for _ in range(2))
    out, lse = torch.zeros_like(q), torch.zeros(1, 4, 24)
    calls = [
        BlockCall(0, 6, 0, 6, Band(None, 0)),
        BlockCall(6, 10, 6, 10, Band(None, 0)),
        BlockCall(10, 16, 2, 9, None),
        BlockCall(16, 24, 12, 20, None),
    ]
    with NoHostDataInOp(), NoSyncOps():
        kernel.forward_calls(q, k, v, calls, 0, 0.3)
        kernel.backward_calls(dout, q, k, v, out, lse, calls, 0, 0.3)
    groups, alone = next(iter(kernel._groups.values()))
    return len(kernel._groups), len(groups), len(alone)


def test_flash_attn_varlen_index_tensors_of_a_new_batch_make_no_sync():
    assert run_on_ranks(1, run_flash_attn_varlen_new_batch) == [(1, 2, 0)]  # built under the guards


def run_cudnn_pieces_new_batch(rank, world, kernel_name):
    """The cuDNN kernels' varlen pieces on a batch they have not seen (packed calls and a windowed call): building
    the pieces' index tensors and running forward and backward make no host sync (torch_cudnn through PyTorch's
    cuDNN ops on CPU; te_fused through the real TE 2.20.2 Python layer over its CPU extension)."""
    from megatron_2d.kernels.te_fused import TeFusedKernel
    from megatron_2d.kernels.torch_cudnn import TorchCudnnKernel
    from megatron_2d.layout.band import Band
    from megatron_2d.layout.block_calls import BlockCall
    from megatron_2d_dev.te_package import load_release
    from megatron_2d_dev.torch_cudnn_cpu import torch_cudnn_on_cpu

    if kernel_name == "te_fused":
        load_release("2.20.2")
        context, make = contextlib.nullcontext(), TeFusedKernel
    else:
        context, make = torch_cudnn_on_cpu(), TorchCudnnKernel
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 24, 4, 16, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 20, 2, 16, generator=g).bfloat16() for _ in range(2))
    out, lse = torch.zeros_like(q), torch.zeros(1, 4, 24)
    calls = [
        BlockCall(0, 6, 0, 6, Band(None, 0)),
        BlockCall(6, 10, 6, 10, Band(None, 0)),
        BlockCall(10, 16, 2, 9, None),
        BlockCall(16, 24, 8, 20, Band(-3, 4)),
    ]
    with context:
        kernel = make()
        with NoHostDataInOp(), NoSyncOps():
            kernel.forward_calls(q, k, v, calls, 0, 0.3)
            kernel.backward_calls(dout, q, k, v, out, lse, calls, 0, 0.3)
    return len(kernel._groups)


@pytest.mark.parametrize("kernel_name", ["torch_cudnn", "te_fused"])
def test_cudnn_kernels_pieces_of_a_new_batch_make_no_sync(kernel_name):
    assert run_on_ranks(1, run_cudnn_pieces_new_batch, kernel_name) == [1]  # built under the guards


def run_new_packed_batches_guarded(rank, world):
    """Every packed mode, hp 2 x cp 2 and hp 1 x cp 4: a layout built ahead of the step (host cu_seqlens), then its
    FIRST attention call (the per-batch setup: head all-to-all order, calls, ring or neighbour exchange) under the
    guards; the result equals the same batch run unguarded on a layout built the same way."""
    import numpy as np

    from megatron_2d.transport.neighbour_exchange import NeighbourExchange

    cu = np.cumsum([0, 1, 37, 5, 90, 3, 64, 1, 11])  # 212 tokens: 2*CP divides 208 + 4
    cu[-1] += (-cu[-1]) % (2 * world)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(int(cu[-1]), 4, 16, generator=g) for _ in range(4))
    results, transports = {}, set()
    for hp in (2, 1):
        groups = megatron_2d.build_2d_groups(hp, 1, "head_first", timeout=TIMEOUT)
        for mode in PACKING_MODES:
            outs = []
            for guarded in (False, True):
                layout = megatron_2d.PackedSharding(cu, groups, mode=mode)  # built ahead: may read the host
                ql, kl, vl, dl = (layout.shard(x) for x in (q, k, v, dout))
                leaves = [x.requires_grad_(True) for x in (ql, kl, vl)]
                with (
                    NoHostDataInOp() if guarded else contextlib.nullcontext(),
                    NoSyncOps() if guarded else contextlib.nullcontext(),
                ):
                    megatron_2d.attention_2d(*leaves, groups, packing=layout, sliding_window=(5, 0)).backward(dl)
                outs.append([x.grad for x in leaves])
                transports |= {type(rc.transport).__name__ for _, rc in layout.op_cache.values()}
            results[(hp, mode)] = all(torch.equal(a, b) for a, b in zip(*outs))
    return results, NeighbourExchange.__name__ in transports


def test_new_packed_batch_makes_no_sync():
    for per_rank, neighbour_exchange_ran in run_on_ranks(4, run_new_packed_batches_guarded):
        assert len(PACKING_MODES) == 3
        assert per_rank == {(hp, mode): True for hp in (2, 1) for mode in PACKING_MODES}, per_rank
        assert neighbour_exchange_ran
