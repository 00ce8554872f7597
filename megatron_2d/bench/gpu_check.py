"""``make gpu-check``: every GPU path of the op on the machine at hand, one table, pass/fail per item.

    python tools/gpu_smoke.py --device cuda      # make gpu-check: on a GPU machine (under 5 minutes on one H100)
    python tools/gpu_smoke.py --dry-run          # the same items on CPU at small sizes (CI runs it)

Items (errors are the worst output's norm_err over its bound in megatron_2d.testing.reference.TOLERANCES,
against fp64 math on the same rounded inputs; a row passes below 1):
    kernel NAME d=D            one block forward + backward per mask: causal square, full rectangle, a causal
                               sliding-window band, a two-sided band; GQA (8 query, 2 K/V heads); d = 64, 128, 192
    loopback NAME CASE         the ring's device work for plans of cp > 1 on one device (every context rank in turn,
                               megatron_2d.testing.loopback): 2D CP 8 = hp 2 x cp 4 (w 2, context_first), a sliding
                               window that leaves ranks nothing to see (the neighbour exchange's plans), packed
                               documents (zigzag and documents modes: varlen launches), sinks, dK/dV riders in the
                               input dtype (dkv_comm_dtype="input", end-to-end bound)
    attention_2d NAME          the op end to end on a one-rank group (NCCL on CUDA), plain and packed
    no host sync               the first call on a new packed batch (its layout built before) under
                               torch.cuda.set_sync_debug_mode("error"); on CPU the guards of testing.no_sync
    peak memory                one long layer's forward + backward: measured peak over the planner's attention
                               memory (linear in the sequence; bound 6x; a score matrix would be ~1000x) (CUDA)
    CUDA graph capture         attention_2d refuses to run inside torch.cuda.graph (CUDA)
    distributed N ranks        with >= 2 GPUs, torchrun over them (NCCL): head exchange (batch 1 and 2), Double-Ring,
                               neighbour exchange, 2D, against the reference; the dry run uses 2 CPU ranks (gloo)
The dry run plays the CUDA kernels through their stand-ins: torch_flash through CPU kernels for PyTorch's flash ops,
flash_attn2 through the real flash-attn 2.8.3.post2 package over a CPU extension (when installed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.band import Band
from megatron_2d.kernels import select_kernel
from megatron_2d.kernels.base import band_mask
from megatron_2d.testing.reference import (
    TOLERANCES,
    attention_with_lse,
    norm_err,
    packed_reference_attention,
    reference_attention,
    rel_err,
    rounded,
)

DTYPE = torch.bfloat16
HEAD_DIMS = (64, 128, 192)
DOCS = [3, 200, 1, 57, 128, 33, 90, 256, 40]  # packed document lengths (cut to the run's size)


@dataclass(frozen=True)
class Sizes:
    kernel_seq: int  # one block's queries
    loop_seq: int  # tokens of the loopback / world-1 runs
    memory_seq: int  # tokens of the peak-memory run
    dist_seq: int  # tokens of the distributed run


SIZES = {
    "cuda": Sizes(kernel_seq=1024, loop_seq=2048, memory_seq=32768, dist_seq=4096),
    "cpu": Sizes(kernel_seq=64, loop_seq=128, memory_seq=1024, dist_seq=64),
}


@dataclass
class Row:
    item: str
    case: str
    result: str  # "ok", "FAIL", or "not run"
    detail: str


def seeded(*shape, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """The same inputs on every run and device (drawn on the CPU), rounded to ``dtype``, as fp64."""
    return rounded(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dtype).to(
        device
    )


def worst(pairs, dtype=DTYPE) -> float:
    """The largest norm_err / bound of (output, actual, expected) triples."""
    tol = TOLERANCES[dtype]
    return max(norm_err(a, e) / tol.of(key) for key, a, e in pairs)


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


def check_kernel(name, device, d, seq) -> float:
    kernel = select_kernel(device, DTYPE, name, head_dim=d)
    width = max(8, seq // 8)
    masks = [
        (Band(None, 0), seq, seq),
        (None, seq, seq + seq // 2),
        (Band(-width, 0), seq, seq),
        (Band(-width, width // 2), seq, seq),
    ]  # causal, full, causal window, two-sided band
    errors = []
    for i, (band, sq, sk) in enumerate(masks):
        box = band.trim(sq, sk) if band is not None else None
        assert box is None or (box.q_start, box.q_end, box.k_start, box.k_end) == (0, sq, 0, sk)
        q, dout = (seeded(1, sq, 8, d, device=device, seed=10 * i + j) for j in (0, 1))
        k, v = (seeded(1, sk, 2, d, device=device, seed=10 * i + j) for j in (2, 3))
        want = block_reference(q, k, v, dout, band, d**-0.5)
        out, lse = kernel.forward(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), band, d**-0.5)
        grads = kernel.backward(dout.to(DTYPE), q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), out, lse, band, d**-0.5)
        errors.append(worst(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want)))
    return max(errors)


# ---- the ring's device work on one device (loopback) ---------------------------------------------------------

LOOPBACK_CASES = {  # case -> (CP, hp, w, placement, causal, window as a fraction of the sequence, packing, ...)
    "2D CP8 = 2x4 w2 context_first": dict(layout=(8, 2, 2, "context_first")),
    "window S/16 (neighbour plans)": dict(layout=(8, 1, 1, "head_first"), window=16),
    "full, sinks": dict(layout=(4, 2, 1, "head_first"), causal=False, sinks=True),
    "packed zigzag (varlen)": dict(layout=(4, 2, 1, "head_first"), packing="zigzag"),
    "packed documents, window": dict(layout=(4, 1, 2, "head_first"), packing="documents", window=32),
    "dK/dV riders in bf16": dict(layout=(8, 1, 1, "head_first"), dkv="input"),
}


def check_loopback(
    name, device, seq, layout, causal=True, window=None, sinks=False, packing=None, dkv="accumulator"
) -> float:
    from megatron_2d.testing.loopback import loopback_attention
    from megatron_2d.topology import Layout2D

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
    err = worst(pairs)
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
        layout = megatron_2d.PackedLayout(cu, groups, mode="documents")
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
    return worst(zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)), (ref, *grads)))


def check_no_sync_new_batch(name, device, seq) -> float:
    """The first call on a packed batch the op has not seen: plans, index tensors and setup are built there."""
    groups = megatron_2d.build_2d_groups(1, 1)
    cu = torch.tensor([0, 7, seq // 3, seq // 2 + 5, seq])
    layout = megatron_2d.PackedLayout(cu, groups, mode="zigzag")  # the batch's layout, built outside
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


# ---- several devices: torchrun ---------------------------------------------------------------------------------


def distributed_cases(world: int):
    """(case, hp, w, placement, batch, window) of the distributed check for ``world`` ranks."""
    hp = max(h for h in (1, 2, 4, 8) if world % h == 0)
    cases = [
        (f"head exchange hp{hp} b1", hp, 1, "head_first", 1, None),
        (f"head exchange hp{hp} b2", hp, 1, "head_first", 2, None),
        (f"Double-Ring cp{world} w{world}", 1, world, "head_first", 1, None),
        (f"sliding window cp{world}", 1, 1, "head_first", 1, 4 * world),
    ]  # neighbour exchange from cp 4
    if world >= 4 and world % 4 == 0:
        cases.append((f"2D hp2 x cp{world // 2} w2", 2, 2, "context_first", 1, None))
    return cases


def worker(args) -> int:
    """One torchrun rank: every distributed case against the reference; rank 0 prints one JSON line per case."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = SIZES[device.type].dist_seq
    for case, hp, w, placement, batch, window in distributed_cases(world):
        try:
            groups = megatron_2d.build_2d_groups(hp, w, placement)
            q, k, v, dout = (seeded(seq, batch, h, 64, device=device, seed=i) for i, h in enumerate((8, 2, 2, 8)))
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            win = (-1, -1) if window is None else (seq // window, 0)
            ref = reference_attention(*leaves, True, 64**-0.5, window=win)
            ref.backward(dout)
            shard = lambda x: megatron_2d.shard_sequence(x.detach(), rank, world)  # noqa: E731
            local = [shard(x).to(DTYPE).requires_grad_(True) for x in (q, k, v)]
            out = megatron_2d.attention_2d(*local, groups, sliding_window=win)  # the automatic kernel
            out.backward(shard(dout).to(DTYPE))
            err = worst(
                zip(
                    ("out", "dq", "dk", "dv"),
                    (out, *(x.grad for x in local)),
                    (shard(ref), *(shard(x.grad) for x in leaves)),
                )
            )
            err_t = torch.tensor([err], dtype=torch.float64, device=device)
            dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
            exchange, rc = next(iter(groups.op_cache.values()))
            path = (
                "no head exchange"
                if exchange.group is None
                else ("head exchange point-to-point" if exchange.point_to_point(batch) else "head all-to-all")
            )
            result = dict(case=case, error=float(err_t.cpu()), path=f"{path}, {type(rc.transport).__name__}")
        except Exception as exc:  # noqa: BLE001  (reported as a row)
            result = dict(case=case, failure=f"{type(exc).__name__}: {exc}"[:300])
        if rank == 0:
            print("GPU-CHECK " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


def run_distributed(device: torch.device, world: int, timeout: float) -> list[Row]:
    root = pathlib.Path(megatron_2d.__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "megatron_2d.bench.gpu_check",
        "--worker",
        "--device",
        device.type,
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    rows = []
    for line in run.stdout.splitlines():
        if line.startswith("GPU-CHECK "):
            r = json.loads(line[len("GPU-CHECK ") :])
            if "failure" in r:
                rows.append(Row(f"distributed {world} ranks", r["case"], "FAIL", r["failure"]))
            else:
                rows.append(
                    Row(
                        f"distributed {world} ranks",
                        r["case"],
                        "ok" if r["error"] < 1 else "FAIL",
                        f"worst error / bound {r['error']:.2f} ({r['path']})",
                    )
                )
    expected = len(distributed_cases(world))
    if run.returncode != 0 or len(rows) != expected:
        rows.append(
            Row(
                f"distributed {world} ranks",
                "torchrun",
                "FAIL",
                f"exit {run.returncode}, {len(rows)}/{expected} cases; {run.stderr.strip()[-300:]}",
            )
        )
    return rows


# ---- the run ------------------------------------------------------------------------------------------------


def cuda_kernel_stand_ins(stack: contextlib.ExitStack) -> list[str]:
    """Dry run: the CUDA kernels on CPU through their stand-ins; returns the kernels this run checks."""
    from megatron_2d.kernels.flash_attn2 import FlashAttn2Kernel
    from megatron_2d.testing import flash_attn_package
    from megatron_2d.testing.torch_flash_cpu import kernel_on_cpu, torch_flash_on_cpu

    stack.enter_context(torch_flash_on_cpu())
    names = ["torch_flash"]
    if flash_attn_package.is_installed("2.8.3.post2"):
        flash_attn_package.load_release("2.8.3.post2")
        stack.enter_context(kernel_on_cpu(FlashAttn2Kernel))
        names.insert(0, "flash_attn2")
    return names


def cuda_kernels() -> list[str]:
    from megatron_2d.kernels.flash_attn2 import flash_attn_available

    return (["flash_attn2"] if flash_attn_available() else []) + ["torch_flash"]


def collect(
    device: torch.device, names: list[str], sizes: Sizes, rows: list[Row], distributed: int, timeout: float
) -> None:
    def add(item: str, case: str, fn: Callable[[], float], bound: float = 1.0, label: str = "worst error / bound"):
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001  one broken case must not hide others
            rows.append(Row(item, case, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
            return
        rows.append(
            Row(
                item,
                case,
                "ok" if value < bound else "FAIL",
                f"{label} {value:.2f} ({time.perf_counter() - start:.1f} s)",
            )
        )

    for name in names:
        for d in HEAD_DIMS:
            add(
                f"kernel {name}",
                f"d={d}: causal, full, windows, GQA",
                lambda: check_kernel(name, device, d, sizes.kernel_seq),
            )
    for name in names:
        for case, options in LOOPBACK_CASES.items():
            add(f"loopback {name}", case, lambda: check_loopback(name, device, sizes.loop_seq, **options))
    for name in names:
        for packed in (False, True):
            add(
                f"attention_2d {name}",
                "world 1, " + ("packed documents" if packed else "causal"),
                lambda: check_world_one(name, device, sizes.loop_seq, packed),
            )
    for name in names:
        add(
            "no host sync",
            f"new packed batch, {name}",
            lambda: check_no_sync_new_batch(name, device, sizes.loop_seq),
            label="syncs",
        )
    if device.type == "cuda":
        for name in names:
            add(
                "peak memory",
                f"{name}, S={sizes.memory_seq}, 32/8 heads, d=128",
                lambda: check_peak_memory(name, device, sizes.memory_seq),
                bound=6.0,
                label="measured / planner's attention memory",
            )
        add(
            "CUDA graph capture",
            "attention_2d refuses",
            lambda: check_graph_capture_refused(names[0], device),
            label="",
        )
    else:
        estimate = planner_attention_bytes(sizes.memory_seq, 32, 8, 128)
        rows.append(
            Row(
                "peak memory",
                f"S={sizes.memory_seq}",
                "not run",
                f"needs CUDA (planner's attention memory {estimate / 2**20:.1f} MiB)",
            )
        )
        rows.append(Row("CUDA graph capture", "attention_2d refuses", "not run", "needs CUDA"))
    if distributed >= 2:
        rows.extend(run_distributed(device, distributed, timeout))
    else:
        rows.append(
            Row("distributed", "NCCL ring, head and neighbour exchange", "not run", "one device: needs >= 2 GPUs")
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="every GPU path of attention_2d, one table (make gpu-check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="on CPU, small sizes, CUDA kernels through stand-ins")
    p.add_argument(
        "--ranks", type=int, default=None, help="ranks of the distributed check (default: every GPU; the dry run: 2)"
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the distributed check")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.dry_run:
        args.device = "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            torch.cuda.set_device(0)
            names, world = cuda_kernels(), torch.cuda.device_count() if args.ranks is None else args.ranks
        else:
            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
            names, world = cuda_kernel_stand_ins(stack), 2 if args.ranks is None else args.ranks
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{tempfile.mktemp()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            collect(device, names, SIZES[device.type], rows, world, args.timeout)
        finally:
            dist.destroy_process_group()
    from megatron_2d.bench.cli import format_table

    what = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU dry run (CUDA kernels through stand-ins)"
    print(
        format_table(
            f"gpu-check on {what}: {len(rows)} items, {time.perf_counter() - start:.0f} s",
            ["item", "case", "result", "detail"],
            [[r.item, r.case, r.result, r.detail] for r in rows],
        )
    )
    failed = [r for r in rows if r.result == "FAIL"]
    print("all passed" if not failed else f"{len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
