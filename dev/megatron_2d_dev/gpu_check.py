"""``make gpu-check``: every GPU path of the op on the machine at hand, one table, pass/fail per item.

    python tools/gpu_smoke.py --device cuda      # make gpu-check: on a GPU machine (under 5 minutes on one H100)
    python tools/gpu_smoke.py --dry-run          # the same items on CPU at small sizes (CI runs it)

Items (errors are the worst output's norm_err over its bound in megatron_2d.testing.reference.TOLERANCES,
against fp64 math on the same rounded inputs; a row passes below 1):
    kernel NAME d=D            one block forward + backward per mask: causal square, full rectangle, a causal
                               sliding-window band, a two-sided band; GQA (8 query, 2 K/V heads); d = 64, 128, 192
    MLA dims NAME              one block with d_qk 192, d_v 128 (MLA's), causal and a window, forward + backward
    varlen NAME                a packed block's calls (causal squares, full rectangles, a tall causal call, a band)
                               through forward_calls / backward_calls: the kernels' batched (varlen) launches
    max logit NAME             QK-clip's max attention logit of a causal block and of a packed block's calls
                               (forward_calls_with_max: te_fused from TE's launches, the others' separate pass)
                               against an fp64 brute force (rel_err over TOLERANCES[bf16].max_logit)
    timing NAME                one 32K causal block (16 query, 4 K/V heads, d 128) forward + backward: TFLOP/s and
                               the share of peak beside the planner's assumed efficiency for the kernel; fails when
                               the kernel runs at under a third of what the planner assumes (CUDA)
    tall bands NAME            trimmed blocks with 4x more queries than keys whose band bounds the right side
                               (causal-like and two-sided), dense and as one batched (varlen) pair of calls: where
                               flash-attn reads a window side >= the keys as unbounded (issue 29, item 2)
    loopback NAME CASE         the ring's device work for the calls of cp > 1 on one device (every context rank in turn,
                               megatron_2d.testing.loopback): 2D CP 8 = hp 2 x cp 4 (w 2, context_first), a sliding
                               window that leaves ranks nothing to see (the neighbour exchange's calls), packed
                               documents (zigzag and documents modes: varlen launches), sinks, dK/dV riders in the
                               input dtype (dkv_comm_dtype="input", end-to-end bound)
    attention_2d NAME          the op end to end on a one-rank group (NCCL on CUDA), plain and packed
    no host sync               the first call on a new packed batch (its layout built before) under
                               torch.cuda.set_sync_debug_mode("error"); on CPU the guards of testing.no_sync
    megatron KIND, checkpoint++  Megatron models from the 2d specs (TE's and local layers) against Megatron's own,
                               and Selective Checkpoint++ against no recompute (gpu_check_megatron)
    peak memory                one long layer's forward + backward: measured peak over the planner's attention
                               memory (linear in the sequence; bound 6x; a score matrix would be ~1000x) (CUDA)
    CUDA graph capture         attention_2d refuses to run inside torch.cuda.graph (CUDA)
    distributed N ranks        with >= 2 GPUs, torchrun over them (NCCL), gpu_check_distributed: head all-to-all,
                               Double-Ring, neighbour exchange, 2D, and for each kernel packed documents (plain and
                               windowed); the dry run uses 2 CPU ranks (gloo)
The dry run plays the CUDA kernels through their stand-ins: torch_flash and torch_cudnn through CPU kernels for
PyTorch's flash and cuDNN ops, flash_attn2 through the real flash-attn 2.8.3.post2 package over a CPU extension and
te_fused through the real Transformer Engine 2.20.2 Python layer over a CPU transformer_engine_torch (when installed),
and megatron-core through the CPU shims of megatron_2d_dev. On CUDA every kernel that builds runs (te_fused when
TE imports, torch_cudnn with cuDNN >= 9, flash_attn2 when flash-attn imports, torch_flash). Items that cannot run
here (CUDA only, Transformer Engine's layers) say "not run", which is not a pass.

How it runs (gpu_check_runner): this process starts workers and keeps the time. The single-device items run in one
worker process, the distributed cases in a torchrun; each item and case has ``--timeout`` seconds (a worker's
start-up counts against its first). One that hangs is a FAIL row "timed out after N s": its worker's whole process
tree is ended (SIGTERM, then SIGKILL) and a new worker runs the items after it. The table is always printed; the
exit status is 1 when a row failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import megatron_2d
import megatron_2d_dev
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.base import band_mask
from megatron_2d.kernels.merge import merge_attention_
from megatron_2d.layout.band import Band
from megatron_2d.layout.block_calls import BlockCall
from megatron_2d.testing.reference import (
    TOLERANCES,
    attention_with_lse,
    norm_err,
    packed_reference_attention,
    reference_attention,
    rel_err,
    rounded,
)

from .gpu_check_runner import FAIL, NOT_RUN, Item, NotRun, Row, run_streamed, run_worker, summary

DTYPE = torch.bfloat16
HEAD_DIMS = (64, 128, 192)
DOCS = [3, 200, 1, 57, 128, 33, 90, 256, 40]  # packed document lengths (cut to the run's size)


@dataclasses.dataclass(frozen=True)
class Sizes:
    kernel_seq: int  # one block's queries
    loop_seq: int  # tokens of the loopback / world-1 runs
    memory_seq: int  # tokens of the peak-memory run
    dist_seq: int  # tokens of the distributed run


SIZES = {
    "cuda": Sizes(kernel_seq=1024, loop_seq=2048, memory_seq=32768, dist_seq=4096),
    "cpu": Sizes(kernel_seq=64, loop_seq=128, memory_seq=1024, dist_seq=64),
}


def seeded(*shape, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """The same inputs on every run and device (drawn on the CPU), rounded to ``dtype``, as fp64."""
    return rounded(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dtype).to(
        device
    )


PIECE_KERNELS = ("te_fused", "torch_cudnn")
"""The kernels that cut a band into pieces sharing rows (megatron_2d.kernels.piece_kernel): a row's dQ adds up to
three bf16 partials of one block, so dQ is held to the end-to-end bound there (out, lse, dK, dV keep theirs)."""


def worst(pairs, dtype=DTYPE, kernel: str | None = None) -> float:
    """The largest error / bound of (output, actual, expected) triples: norm_err over the output's bound, for a
    piece kernel's dQ rel_err over the end-to-end bound (see :data:`PIECE_KERNELS`)."""
    tol = TOLERANCES[dtype]
    return max(
        rel_err(a, e) / tol.end_to_end if key == "dq" and kernel in PIECE_KERNELS else norm_err(a, e) / tol.of(key)
        for key, a, e in pairs
    )


# ---- kernels ------------------------------------------------------------------------------------------------


def block_reference(q, k, v, dout, band, scale):
    """fp64 (out, lse, dq, dk, dv) of one block under ``band`` (local top-left coordinates, None = all)."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1].repeat_interleave(rep, 2)) * scale
    if band is not None:
        s = s + band_mask(band, s.shape[-2], s.shape[-1], s.dtype, s.device)
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), leaves[2].repeat_interleave(rep, 2))
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), *(x.grad for x in leaves)


def block_error(kernel, band, sq, sk, d, device, seed) -> float:
    """One block forward + backward of ``kernel`` under ``band`` (GQA 8/2) against fp64: worst error / bound."""
    q, dout = (seeded(1, sq, 8, d, device=device, seed=seed + j) for j in (0, 1))
    k, v = (seeded(1, sk, 2, d, device=device, seed=seed + j) for j in (2, 3))
    want = block_reference(q, k, v, dout, band, d**-0.5)
    out, lse = kernel.forward(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), band, d**-0.5)
    grads = kernel.backward(dout.to(DTYPE), q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), out, lse, band, d**-0.5)
    return worst(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want), kernel=kernel.name)


def trimmed_as_is(band: Band | None, sq: int, sk: int) -> bool:
    """Whether ``band`` on an sq x sk block is as the planner hands calls to kernels: trimming keeps it whole."""
    box = band.trim(sq, sk) if band is not None else None
    return box is None or (box.q_start, box.q_end, box.k_start, box.k_end, box.band) == (0, sq, 0, sk, band)


def check_kernel(name, device, d, seq) -> float:
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    width = max(8, seq // 8)
    masks = [
        (Band(None, 0), seq, seq),
        (None, seq, seq + seq // 2),
        (Band(-width, 0), seq, seq),
        (Band(-width, width // 2), seq, seq),
    ]  # causal, full, causal window, two-sided band
    assert all(trimmed_as_is(*m) for m in masks)
    return max(block_error(kernel, band, sq, sk, d, device, seed=10 * i) for i, (band, sq, sk) in enumerate(masks))


def tall_calls(seq: int) -> list[BlockCall]:
    """Two calls of one seq x seq block, each 2 key columns under 4 query rows (in units of seq / 8) with the band
    Band(None, 0): issue 29's BlockCall(0, 4, 2, 4, Band(None, 0)) of a packed plan with a two-sided window, scaled.
    Their right window side is as wide as their keys, and so is the batch's longest key run."""
    u = seq // 8
    return [BlockCall(0, 4 * u, 2 * u, 4 * u, Band(None, 0)), BlockCall(4 * u, 8 * u, 6 * u, 8 * u, Band(None, 0))]


def calls_error(kernel, calls: list[BlockCall], seq, d, device) -> float:
    """``kernel.forward_calls`` / ``backward_calls`` on one seq x seq block (the batched, varlen, path of kernels
    that have one) for calls with disjoint rows and keys, each call against its own fp64 block. The kernel's
    results are gathered as the ring gathers them (it may return a call as pieces): outputs merged by log-sum-exp
    into their rows, dQ added into their rows, dK/dV into their keys."""
    q, dout = (seeded(1, seq, 8, d, device=device, seed=50 + j) for j in (0, 1))
    k, v = (seeded(1, seq, 2, d, device=device, seed=50 + j) for j in (2, 3))
    scale = d**-0.5
    qb, kb, vb, doutb = (x.to(DTYPE) for x in (q, k, v, dout))
    out = torch.zeros(1, seq, 8, d, device=device)
    lse = torch.full((1, 8, seq), float("-inf"), device=device)
    for c, o, m in kernel.forward_calls(qb, kb, vb, calls, 0, scale):
        merge_attention_(out[:, c.q_start : c.q_end], lse[:, :, c.q_start : c.q_end], o, m)
    out = out.to(DTYPE)
    dout_in, out_in = kernel.backward_inputs(doutb, out)
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for c, dq_c, dk_c, dv_c in kernel.backward_calls(dout_in, qb, kb, vb, out_in, lse, calls, 0, scale):
        dq[:, c.q_start : c.q_end] += dq_c
        dk[:, c.k_start : c.k_end] += dk_c
        dv[:, c.k_start : c.k_end] += dv_c
    errors = []
    for c in calls:
        rows, keys = slice(c.q_start, c.q_end), slice(c.k_start, c.k_end)
        want = block_reference(q[:, rows], k[:, keys], v[:, keys], dout[:, rows], c.band, scale)
        got = (out[:, rows], lse[:, :, rows], dq[:, rows], dk[:, keys], dv[:, keys])
        errors.append(worst(zip(("out", "lse", "dq", "dk", "dv"), got, want), kernel=kernel.name))
    return max(errors)


def check_tall_bands(name, device, d, seq) -> float:
    """Trimmed blocks with sq = 4 sk whose band bounds the right side: flash-attn's window right side is then
    right = hi + (sq - sk) >= sk, which its C++ reads as unbounded (rows would see later keys). Dense: the
    causal-like Band(None, 0) and a two-sided band; batched: :func:`tall_calls`."""
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    masks = [(Band(None, 0), seq, seq // 4), (Band(-(7 * seq // 8), seq // 16), seq, seq // 4)]
    assert all(trimmed_as_is(band, sq, sk) and band.hi + (sq - sk) >= sk for band, sq, sk in masks)
    dense = max(
        block_error(kernel, band, sq, sk, d, device, seed=30 + 10 * i) for i, (band, sq, sk) in enumerate(masks)
    )
    return max(dense, calls_error(kernel, tall_calls(seq), seq, d, device))


def check_mla_dims(name, device, seq) -> float:
    """One block with MLA's head dims (q/k 192, v 128): causal square and a causal window, forward + backward."""
    kernel = select_kernel(device, DTYPE, name, head_dim=192).for_head_dims(192, 128)
    errors = []
    for i, band in enumerate((Band(None, 0), Band(-(seq // 4), 0))):
        q, dout = seeded(1, seq, 8, 192, device=device, seed=70 + i), seeded(1, seq, 8, 128, device=device, seed=72)
        k, v = seeded(1, seq, 2, 192, device=device, seed=74 + i), seeded(1, seq, 2, 128, device=device, seed=76)
        want = block_reference(q, k, v, dout, band, 192**-0.5)
        out, lse = kernel.forward(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), band, 192**-0.5)
        grads = kernel.backward(dout.to(DTYPE), q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), out, lse, band, 192**-0.5)
        errors.append(worst(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want), kernel=kernel.name))
    return max(errors)


def packed_calls(seq: int) -> list[BlockCall]:
    """A packed block's calls (units of seq / 8), disjoint rows and keys: a causal square, a full rectangle, a
    tall causal call (2 queries per key) and a causal call whose keys reach past the diagonal."""
    u = seq // 8
    return [
        BlockCall(0, 2 * u, 0, 2 * u, Band(None, 0)),
        BlockCall(2 * u, 3 * u, 2 * u, 4 * u, None),
        BlockCall(3 * u, 5 * u, 4 * u, 5 * u, Band(None, 0)),
        BlockCall(5 * u, 8 * u, 5 * u, 8 * u, Band(None, u // 2)),
    ]


def check_varlen(name, device, d, seq) -> float:
    """A packed block's calls through forward_calls / backward_calls (the batched launches), against fp64."""
    return calls_error(select_kernel(device, DTYPE, name, head_dim=d), packed_calls(seq), seq, d, device)


def check_max_logit(name, device, d, seq) -> float:
    """``kernel.forward_calls_with_max`` on one causal seq x seq block and on a packed block's calls (GQA 8/2): the
    max attention logit against an fp64 brute force over the calls' visible pairs, rel_err / its bound."""
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    q, k = seeded(1, seq, 8, d, device=device, seed=90), seeded(1, seq, 2, d, device=device, seed=91)
    v = seeded(1, seq, 2, d, device=device, seed=92)
    errors = []
    for calls in ([BlockCall(0, seq, 0, seq, Band(None, 0))], packed_calls(seq)):
        _, got = kernel.forward_calls_with_max(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), calls, 0, d**-0.5)
        want = torch.full((8,), float("-inf"), dtype=torch.float64, device=device)
        for c in calls:
            s = (
                torch.einsum(
                    "bqhd,bkhd->bhqk", q[:, c.q_start : c.q_end], k[:, c.k_start : c.k_end].repeat_interleave(4, 2)
                )
                * d**-0.5
            )
            if c.band is not None:
                s = s + band_mask(c.band, s.shape[-2], s.shape[-1], s.dtype, s.device)
            want = torch.maximum(want, s.amax(dim=(0, 2, 3)))
        errors.append(rel_err(got, want) / TOLERANCES[DTYPE].max_logit)
    return max(errors)


TIMING = dict(seq=32768, heads=16, kv_heads=4, d=128)  # one 32K causal block


def check_timing(name, device) -> tuple[float, str]:
    """One 32K causal block forward + backward, 3 timed runs after a warm-up: (planner's assumed efficiency /
    measured, "TFLOP/s and shares of peak"). Causal FLOPs: 4 * s^2 / 2 * heads * d forward, 2.5x that backward."""
    from megatron_2d.plan.hardware import get_cluster
    from megatron_2d.plan.kernel_rates import kernel_rate

    if device.type != "cuda":
        raise NotRun("timing needs CUDA")
    s, h, hkv, d = TIMING["seq"], TIMING["heads"], TIMING["kv_heads"], TIMING["d"]
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    q, dout = (torch.randn(1, s, h, d, device=device, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(1, s, hkv, d, device=device, dtype=DTYPE) for _ in range(2))
    band = Band(None, 0)

    def once():
        out, lse = kernel.forward(q, k, v, band, d**-0.5)
        kernel.backward(dout, q, k, v, out, lse, band, d**-0.5)

    once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        once()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 3
    tflops = 3.5 * 2.0 * s * s * h * d / seconds / 1e12
    major, minor = torch.cuda.get_device_capability(device)
    arch = "hopper" if (major, minor) >= (9, 0) else "ampere"
    peak = get_cluster("8xH100" if arch == "hopper" else "8xA100").peak_tflops
    assumed = kernel_rate(arch, name).efficiency
    measured = tflops / peak
    note = (
        f"{tflops:.0f} TFLOP/s = {100 * measured:.1f}% of {peak:.0f}; the planner assumes {100 * assumed:.1f}% ({arch})"
    )
    return assumed / measured, note


# ---- the ring's device work on one device (loopback) ---------------------------------------------------------

LOOPBACK_CASES = {  # case -> (CP, hp, w, placement, causal, window as a fraction of the sequence, packing, ...)
    "2D CP8 = 2x4 w2 context_first": dict(layout=(8, 2, 2, "context_first")),
    "window S/16 (neighbour calls)": dict(layout=(8, 1, 1, "head_first"), window=16),
    "full, sinks": dict(layout=(4, 2, 1, "head_first"), causal=False, sinks=True),
    "packed zigzag (varlen)": dict(layout=(4, 2, 1, "head_first"), packing="zigzag"),
    "packed documents, window": dict(layout=(4, 1, 2, "head_first"), packing="documents", window=32),
    "dK/dV riders in bf16": dict(layout=(8, 1, 1, "head_first"), dkv="input"),
}


def check_loopback(
    name, device, seq, layout, causal=True, window=None, sinks=False, packing=None, dkv="accumulator"
) -> float:
    from megatron_2d.layout.topology import Layout2D
    from megatron_2d.testing.loopback import loopback_attention

    d, scale = 128 if device.type == "cuda" else 64, None
    q, k, v, dout = (seeded(1, seq, h, d, device=device, seed=i) for i, h in enumerate((8, 2, 2, 8)))
    s = seeded(8, device=device, seed=9) if sinks else None
    win = (-1, -1) if window is None else ((seq // window, 0) if causal else (seq // window, seq // window))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)] + ([s.clone().requires_grad_(True)] if sinks else [])
    cu = None
    if packing is not None:
        lengths = list(itertools.accumulate(DOCS))
        cu = torch.tensor([0] + [x for x in lengths if x < seq] + [seq])
        ref = packed_reference_attention(
            *(x[0] for x in leaves[:3]), cu, causal, d**-0.5, window=win, sinks=leaves[3] if sinks else None
        ).unsqueeze(0)
    else:
        ref = attention_with_lse(*leaves[:3], causal, d**-0.5, window=win, sinks=leaves[3] if sinks else None)[0]
    ref.backward(dout)
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    out, dq, dk, dv, ds = loopback_attention(
        q.to(DTYPE),
        k.to(DTYPE),
        v.to(DTYPE),
        dout.to(DTYPE),
        Layout2D(*layout),
        kernel,
        causal,
        win,
        scale,
        s.to(DTYPE) if sinks else None,
        dkv,
        cu,
        packing or "zigzag",
    )
    pairs = [("out", out, ref), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad), ("dv", dv, leaves[2].grad)]
    if dkv == "input":  # riders rounded once per hop: the end-to-end bound
        return max(rel_err(a, e) / TOLERANCES[DTYPE].end_to_end for _, a, e in pairs)
    err = worst(pairs, kernel=name)
    if sinks:
        err = max(err, rel_err(ds, leaves[3].grad) / TOLERANCES[DTYPE].end_to_end)
    return err


# ---- the op on a one-rank group ------------------------------------------------------------------------------


def check_world_one(name, device, seq, packed) -> float:
    groups = megatron_2d.build_2d_groups(1, 1)
    q, k, v, dout = (seeded(seq, 1, h, 128, device=device, seed=i) for i, h in enumerate((8, 2, 2, 8)))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if packed:
        cu = torch.tensor([0] + [x for x in itertools.accumulate(DOCS) if x < seq] + [seq])
        layout = megatron_2d.PackedSharding(cu, groups, mode="documents")
        ref = packed_reference_attention(*(x[:, 0] for x in leaves), cu, True, 128**-0.5)
        ref.backward(dout[:, 0])
        local = [layout.shard(x[:, 0]).to(DTYPE).requires_grad_(True) for x in (q, k, v)]
        out = megatron_2d.attention_2d(*local, groups, kernel=name, packing=layout)
        out.backward(layout.shard(dout[:, 0]).to(DTYPE))
        grads = [x.grad[:, 0] for x in leaves]
    else:
        ref = reference_attention(*leaves, True, 128**-0.5)
        ref.backward(dout)
        local = [x.detach().to(DTYPE).requires_grad_(True) for x in (q, k, v)]
        out = megatron_2d.attention_2d(*local, groups, kernel=name)
        out.backward(dout.to(DTYPE))
        grads = [x.grad for x in leaves]
    return worst(zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)), (ref, *grads)), kernel=name)


def check_no_sync_new_batch(name, device, seq) -> float:
    """The first call on a packed batch the op has not seen: calls, index tensors and setup are built there."""
    groups = megatron_2d.build_2d_groups(1, 1)
    cu = torch.tensor([0, 7, seq // 3, seq // 2 + 5, seq])
    layout = megatron_2d.PackedSharding(cu, groups, mode="zigzag")  # the batch's layout, built outside
    q, k, v, dout = (
        layout.shard(seeded(seq, h, 64, device=device, seed=i).to(DTYPE)) for i, h in enumerate((8, 2, 2, 8))
    )
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        guards = contextlib.nullcontext()
    else:
        from megatron_2d.testing.no_sync import NoHostDataInOp, NoSyncOps

        guards = contextlib.ExitStack()
        guards.enter_context(NoHostDataInOp())
        guards.enter_context(NoSyncOps())
    try:
        with guards:
            megatron_2d.attention_2d(*leaves, groups, kernel=name, packing=layout).backward(dout)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    return 0.0


def planner_attention_bytes(seq, heads, kv_heads, d) -> float:
    """The planner's memory for one layer's attention at CP 1: q/k/v, output, o-proj input and lse per token, plus
    its transient buffers (megatron_2d.plan.memory.memory_breakdown)."""
    from megatron_2d.plan.hardware import ModelSpec, ParallelSpec
    from megatron_2d.plan.memory import memory_breakdown

    model = ModelSpec(
        "gpu-check", layers=1, hidden=heads * d, heads=heads, kv_heads=kv_heads, ffn_hidden=4 * heads * d, vocab=1024
    )
    mb = memory_breakdown(model, ParallelSpec(gpus=1), hp=1, cp=1, w=1, seq=seq)
    return mb.tokens * (mb.qkv + mb.attn_out + mb.o_proj_in + mb.lse) + mb.comm_buffers


def check_peak_memory(name, device, seq) -> float:
    """Measured peak of one layer's forward + backward over the planner's attention memory (CUDA)."""
    heads, kv_heads, d = 32, 8, 128
    estimate = planner_attention_bytes(seq, heads, kv_heads, d)
    if device.type != "cuda":
        raise NotRun(f"needs CUDA (planner's attention memory {estimate / 2**20:.1f} MiB)")
    groups = megatron_2d.build_2d_groups(1, 1)
    q, k, v, dout = (torch.randn(seq, 1, h, d, device=device, dtype=DTYPE) for h in (heads, kv_heads, kv_heads, heads))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    megatron_2d.attention_2d(*leaves, groups, kernel=name).backward(dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / estimate


def check_graph_capture_refused(name, device) -> float:
    if device.type != "cuda":
        raise NotRun("needs CUDA")
    groups = megatron_2d.build_2d_groups(1, 1)
    q = torch.randn(256, 1, 8, 64, device=device, dtype=DTYPE)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            megatron_2d.attention_2d(q, q[:, :, :2], q[:, :, :2], groups, kernel=name)
    except RuntimeError as err:
        if "cannot run inside a CUDA graph capture" in str(err):
            return 0.0
        raise
    raise AssertionError("attention_2d ran inside a CUDA graph capture")


# ---- the items, their worker and the run ------------------------------------------------------------------------


DRY_RUN_TE = "2.20.2"
DRY_RUN_FLASH_ATTN = "2.8.3.post2"


def cuda_kernel_stand_ins(stack: contextlib.ExitStack) -> list[str]:
    """Dry run: the CUDA kernels on CPU through their stand-ins; returns the kernels this run checks (in the
    selection's Hopper order)."""
    from megatron_2d.kernels.flash_attn2 import FlashAttn2Kernel
    from megatron_2d.kernels.te_fused import TeFusedKernel
    from megatron_2d_dev import flash_attn_package, te_package
    from megatron_2d_dev.torch_cudnn_cpu import torch_cudnn_on_cpu
    from megatron_2d_dev.torch_flash_cpu import kernel_on_cpu, torch_flash_on_cpu

    names = []
    if te_package.is_installed(DRY_RUN_TE):
        te_package.load_release(DRY_RUN_TE)
        stack.enter_context(kernel_on_cpu(TeFusedKernel))
        names.append("te_fused")
    stack.enter_context(torch_cudnn_on_cpu())
    names.append("torch_cudnn")
    if flash_attn_package.is_installed(DRY_RUN_FLASH_ATTN):
        flash_attn_package.load_release(DRY_RUN_FLASH_ATTN)
        stack.enter_context(kernel_on_cpu(FlashAttn2Kernel))
        names.append("flash_attn2")
    stack.enter_context(torch_flash_on_cpu())
    return names + ["torch_flash"]


def cuda_kernels() -> list[str]:
    """The CUDA kernels that build here, in the selection's Hopper order (each one's own checks at build time:
    TE and flash-attn importable, PyTorch's cuDNN and flash op schemas)."""
    names = []
    for name in ("te_fused", "torch_cudnn", "flash_attn2", "torch_flash"):
        try:
            select_kernel(torch.device("cuda"), DTYPE, name)
        except ValueError:
            continue
        names.append(name)
    return names


def kernels_here(device: torch.device, stack: contextlib.ExitStack) -> list[str]:
    """The CUDA kernels this run checks: the installed ones on CUDA, their stand-ins on CPU (entered on ``stack``)."""
    if device.type == "cuda":
        return cuda_kernels()
    return cuda_kernel_stand_ins(stack)


def single_device_items(device: torch.device, names: list[str], sizes: Sizes) -> list[Item]:
    """Every item of the single-device worker, in table order (the same list on every start)."""
    from .gpu_check_megatron import megatron_items

    items = [
        Item(
            f"kernel {name}",
            f"d={d}: causal, full, windows, GQA",
            lambda n=name, d=d: check_kernel(n, device, d, sizes.kernel_seq),
        )
        for name in names
        for d in HEAD_DIMS
    ]
    items += [
        Item(f"MLA dims {name}", "d_qk=192 d_v=128: causal, window", lambda n=name: check_mla_dims(n, device, seq))
        for name in names
        for seq in (sizes.kernel_seq,)
    ]
    items += [
        Item(
            f"varlen {name}",
            "d=128: a packed block's calls, batched launches",
            lambda n=name: check_varlen(n, device, 128, sizes.kernel_seq),
        )
        for name in names
    ]
    items += [
        Item(
            f"max logit {name}",
            "d=128: a causal block, a packed block's calls",
            lambda n=name: check_max_logit(n, device, 128, sizes.kernel_seq),
        )
        for name in names
    ]
    items += [
        Item(
            f"timing {name}",
            "32K causal block, 16/4 heads, d=128, forward + backward",
            lambda n=name: check_timing(n, device),
            bound=3.0,
            label="planner's efficiency / measured",
        )
        for name in names
    ]
    items += [
        Item(
            f"tall bands {name}",
            "d=128: sq = 4 sk, right side bounded: causal-like, two-sided, varlen pair",
            lambda n=name: check_tall_bands(n, device, 128, sizes.kernel_seq),
        )
        for name in names
    ]
    items += [
        Item(f"loopback {name}", case, lambda n=name, o=options: check_loopback(n, device, sizes.loop_seq, **o))
        for name in names
        for case, options in LOOPBACK_CASES.items()
    ]
    items += [
        Item(
            f"attention_2d {name}",
            "world 1, " + ("packed documents" if packed else "causal"),
            lambda n=name, p=packed: check_world_one(n, device, sizes.loop_seq, p),
        )
        for name in names
        for packed in (False, True)
    ]
    items += [
        Item(
            "no host sync",
            f"new packed batch, {name}",
            lambda n=name: check_no_sync_new_batch(n, device, sizes.loop_seq),
            label="syncs",
        )
        for name in names
    ]
    items += megatron_items(device, names[0])
    items += [
        Item(
            "peak memory",
            f"{name}, S={sizes.memory_seq}, 32/8 heads, d=128",
            lambda n=name: check_peak_memory(n, device, sizes.memory_seq),
            bound=6.0,
            label="measured / planner's attention memory",
        )
        for name in names
    ]
    items.append(
        Item(
            "CUDA graph capture",
            "attention_2d refuses",
            lambda: check_graph_capture_refused(names[0], device),
            label="",
        )
    )
    return items


@contextlib.contextmanager
def one_rank_world(device: torch.device):
    """The one-rank default process group the single-device items run on (NCCL on CUDA, gloo on CPU)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="m2d_gpu_check_store_") as store:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{store}/store",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def items_worker(args) -> int:
    """The single-device worker: set up the device (on CPU: the kernels' and megatron-core's stand-ins), then run
    the items from ``--resume-at`` on (gpu_check_runner's protocol)."""
    device = torch.device(args.device)
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            torch.cuda.set_device(0)
        else:
            from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
            install_hybrid_cpu_shims()  # megatron-core's CPU shims, HybridStack's TENorm, the Mamba/GDN stand-ins
        names = kernels_here(device, stack)
        stack.enter_context(one_rank_world(device))
        run_worker(single_device_items(device, names, SIZES[device.type]), args.resume_at, hang=args.hang)
    return 0


def worker_env() -> dict[str, str]:
    """The workers' environment: this checkout (megatron_2d and dev/) first on the path, one CPU thread per
    process."""
    root = pathlib.Path(megatron_2d.__file__).resolve().parents[1]
    dev = megatron_2d_dev.DEV_ROOT
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), str(dev), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )


def worker_command(launcher: list[str], module: str, args, *flags: str):
    """The command that starts a worker from case ``start`` (gpu_check_runner's contract)."""

    def command(start: int) -> list[str]:
        hang = [x for h in args.hang for x in ("--hang", h)]
        return [*launcher, "-m", module, *flags, "--device", args.device, "--resume-at", str(start), *hang]

    return command


def single_device_rows(args, env: dict[str, str]) -> list[Row]:
    """The single-device worker's rows (each item ``args.timeout`` seconds)."""
    items = worker_command([sys.executable], "megatron_2d_dev.gpu_check", args, "--items")
    return run_streamed("single-device items", items, args.timeout, env, startup=args.startup_timeout)


def distributed_rows(args, world: int, env: dict[str, str]) -> list[Row]:
    """The distributed cases' rows: torchrun over ``world`` ranks (each case ``args.timeout`` seconds)."""
    if world < 2:
        return [Row("distributed", "NCCL ring, head and neighbour exchange", NOT_RUN, "one device: needs >= 2 GPUs")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cases = worker_command(torchrun, "megatron_2d_dev.gpu_check_distributed", args)
    # torchrun's own log folder (torchelastic_*, never removed by torch) goes in a folder removed here
    with tempfile.TemporaryDirectory(prefix="m2d_gpu_check_torchrun_") as tmp:
        env = {**(os.environ if env is None else env), "TMPDIR": tmp}
        return run_streamed(f"distributed {world} ranks", cases, args.timeout, env, startup=args.startup_timeout)


def report(title: str, rows: list[Row]) -> int:
    """Print the table and its summary; the exit status: 1 when a row failed, else 0."""
    from megatron_2d_dev.cli import format_table

    print(
        format_table(title, ["item", "case", "result", "detail"], [[r.item, r.case, r.result, r.detail] for r in rows])
    )
    print(summary(rows))
    return 1 if any(r.result == FAIL for r in rows) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="every GPU path of attention_2d, one table (make gpu-check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="on CPU, small sizes, CUDA kernels through stand-ins")
    p.add_argument(
        "--ranks", type=int, default=None, help="ranks of the distributed check (default: every GPU; the dry run: 2)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each item and each distributed case")
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds for a worker to start (imports, device set-up)"
    )
    p.add_argument("--items", action="store_true", help=argparse.SUPPRESS)  # the single-device worker
    p.add_argument("--resume-at", type=int, default=0, help=argparse.SUPPRESS)
    # test hook (tests/test_gpu_check_runner.py): the items and cases whose "item: case" contains it sleep
    p.add_argument("--hang", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.items:
        return items_worker(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    world = args.ranks if args.ranks is not None else (torch.cuda.device_count() if device.type == "cuda" else 2)
    env = worker_env()
    rows = single_device_rows(args, env) + distributed_rows(args, world, env)
    what = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU dry run (CUDA kernels through stand-ins)"
    return report(f"gpu-check on {what}: {len(rows)} items, {time.perf_counter() - start:.0f} s", rows)


if __name__ == "__main__":
    sys.exit(main())
