"""The shared harness of the attention benchmarks: dtypes, inputs, the single-process baseline, the layouts.

layouts = bench_layouts(cp_size=4, heads=8)         # the Layout2Ds of CP = 4 whose hp divides the heads
q, k, v, dout = make_inputs(args, torch.bfloat16)   # full [S, b, h, d] tensors, the same on every rank
model = bench_model(vars(args))                      # the attention shape as the planner's one-layer model
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from megatron_2d.kernels import select_kernel
from megatron_2d.layout.band import Band
from megatron_2d.layout.topology import Layout2D, every_layout
from megatron_2d.plan import ModelSpec

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bench_layouts(cp_size: int, heads: int) -> list[Layout2D]:
    """Every 2D layout of CP = ``cp_size`` whose head-parallel size divides the query heads; w = 1 only where
    cp = 1, since it is the same ring as w = cp (as the planner lists it: ``plan.candidates.enumerate_schemes``)."""
    return [
        layout
        for layout in every_layout(cp_size)
        if heads % layout.head_parallel_size == 0 and (layout.inner_ring_size > 1 or layout.context_size == 1)
    ]


def label(layout: Layout2D) -> str:
    """A layout's row name: 'hp2 x cp2  w1  head_first'."""
    return f"hp{layout.head_parallel_size} x cp{layout.context_size}  w{layout.inner_ring_size}  {layout.placement}"


def layout_record(layout: Layout2D) -> dict[str, object]:
    """A layout as the benchmarks' JSON rows carry it: {'hp', 'cp', 'w', 'placement'}."""
    return {
        "hp": layout.head_parallel_size,
        "cp": layout.context_size,
        "w": layout.inner_ring_size,
        "placement": layout.placement,
    }


def retain_freed_memory() -> bool:
    """Make this process's glibc malloc keep freed memory instead of returning it to the system, as a GPU caching
    allocator does: large tensors then stop costing a page fault per page on every fresh allocation, which on CPU
    is a cost of the allocator, not of the code measured (PyTorch's CPU tuning guide swaps in tcmalloc or jemalloc
    for the same reason). Returns False where glibc's mallopt is not available (nothing changed)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None  # glibc only
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))  # 32 MiB: the max


def round_order(indices: Sequence[int], round_index: int) -> list[int]:
    """The order of the rows (layouts, implementations) in one timing round: ``indices`` rotated by the round, so
    that over len(indices) rounds each runs once at every position (none always first)."""
    k = round_index % len(indices) if indices else 0
    return list(indices[k:]) + list(indices[:k])


def idle() -> None:
    """What the other ranks run while rank 0 times the baseline alone (the "alone" timing)."""


def mib(n: float) -> str:
    """``n`` bytes in MiB, two decimals (the benchmarks' tables)."""
    return f"{n / 2**20:.2f}"


def time_call(fn, repeats: int, reduce=statistics.median) -> float:
    """``reduce`` (median by default) of the seconds of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return reduce(times)


def make_inputs(args, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, dout: full [S, b, h, d] tensors of ``args`` (seq, batch, heads, kv_heads, dim), from one seed."""
    g = torch.Generator().manual_seed(seed)
    shape_q = (args.seq, args.batch, args.heads, args.dim)
    shape_kv = (args.seq, args.batch, args.kv_heads, args.dim)
    return [torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def single_process_step(args, dtype: torch.dtype, device: str = "cpu"):
    """A function running the local kernel's fwd+bwd once on the full, unsharded problem (the baseline every
    efficiency is measured against); call it on one thread (or one GPU)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kernel = select_kernel(dev, dtype)
    q, k, v, dout = (x.transpose(0, 1).contiguous().to(dev) for x in make_inputs(args, dtype))  # [b, s, h, d]
    scale = args.dim**-0.5
    band = Band(None, 0) if args.causal else None  # the kernels take a band since sliding windows landed

    def step() -> None:
        sync()
        out, lse = kernel.forward(q, k, v, band, scale)
        kernel.backward(dout, q, k, v, out, lse, band, scale)
        sync()

    return step


def time_single_process(args, dtype: torch.dtype, device: str = "cpu") -> float:
    """Median seconds of the local kernel's fwd+bwd on the full, unsharded problem, on one thread (or one GPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_call(single_process_step(args, dtype, device), args.repeats)
    finally:
        torch.set_num_threads(threads)


def measure_copy_bandwidth(elements: int = 2**24) -> float:
    """Single-thread bytes/s of a large fp32 copy, read + write (the best of a few runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x, y = torch.randn(elements), torch.empty(elements)
    seconds = time_call(lambda: y.copy_(x), 5, reduce=min)
    torch.set_num_threads(threads)
    return 2.0 * 4 * elements / seconds


def bench_model(bench_args: dict[str, object]) -> ModelSpec:
    """The benchmark's attention shape as a one-layer model for the planner (the MLP and vocabulary do not enter
    attention)."""
    heads, dim = int(bench_args["heads"]), int(bench_args["dim"])
    return ModelSpec(
        f"bench hq={heads} hkv={bench_args['kv_heads']} d={dim}",
        layers=1,
        hidden=heads * dim,
        heads=heads,
        kv_heads=int(bench_args["kv_heads"]),
        ffn_hidden=1,
        vocab=1,
    )
