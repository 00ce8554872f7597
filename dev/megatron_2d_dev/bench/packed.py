"""Packed documents (THD) under 2D on CPU ranks: zigzag mode vs documents mode vs one unmasked causal sequence vs
ring-flash-attn's zigzag varlen ring.

    python tools/bench_packed.py --ranks 8                       # 16K tokens, the three length distributions
    python tools/bench_packed.py --ranks 4 --tokens 32K --hp 2 --dists one-half

Rows (same q, k, v, dout, fp32 or --dtype, causal, hq = hkv heads of dim d):
    zigzag          attention_2d(packing=PackedSharding(cu, groups, "zigzag")): Megatron/TE THD, every document
                    padded to 2*CP and split over every CP rank
    documents       attention_2d(packing=PackedSharding(cu, groups, "documents")): short documents whole on one
                    context rank, long ones zigzag-sharded; the ring carries the long prefix only
    one sequence    the same T tokens as ONE causal sequence (sbhd attention_2d, shard_sequence): what attention
                    costs when the document boundaries are ignored (padding-free, balanced, every pair computed)
    ring-flash-attn zigzag_ring_flash_attn_varlen_func over all N ranks (hp = 1), through the CPU flash_attn
                    stand-in; its layout per document is zigzag_slots(cu, N) (local cu_seqlens = padded // N).
                    In fp32 its backward is wrong (ring-flash-attn 0.1.8: ``dq = dq_buffer.to(torch.float32)``
                    aliases the buffer the next step overwrites; see tools/bench_compare.py), so that row fails
                    the check and is not timed; its bytes are still counted
    ring-flash-attn fp64  the same in fp64 (the cast copies, the result is right): timed, but in fp64
                    arithmetic, so its time is an upper bound for what fp32 would cost
    TE p2p / a2a /  stock Megatron's packed CP: Transformer Engine --te-release's own THD context parallelism
    a2a+p2p [A, P]  (attn_forward_func_with_cp with qkv_format "thd", pad_between_seqs, as its DotProductAttention
    / all_gather    calls it) on CPU ranks (megatron_2d_dev.te_context_parallel): every document padded to a
                    multiple of 2*CP by TE's rule and split by TE's partition (megatron_2d_dev.stock_cp.
                    thd_layout); each comm type the release runs with THD; bf16 only (--dtype bf16: TE's fused
                    attention takes fp16 / bf16), the cpu_flash kernel inside; bytes counted as TE's code sends them

    python tools/bench_packed.py --ranks 4 --dtype bf16          # every row in bf16, beside TE's THD rows

Every row is first run once and checked against an fp64 single-process reference (out, dq, dk, dv; max |err| /
max |ref| under TOLERANCES[dtype].end_to_end); a row that fails is reported as failing and not timed. The reference
is the project's one blockwise fp64 reference (:func:`megatron_2d.testing.reference.blockwise_reference`, per
document of cu_seqlens, one block of query rows at a time), because the dense one needs T^2 memory.

Columns: wall ms = median fwd+bwd step of the slowest rank; cpu ms = median CPU time of the busiest rank (on 2
shared cores with N > 2 ranks, wall time is roughly the SUM of the ranks' work, so cpu ms is the better proxy for
one core per rank); "vs zigzag" = wall / zigzag's wall (and the same for cpu); ring / a2a MiB = bytes the busiest
rank sends per fwd+bwd; pairs and tokens = max / mean over context ranks of causal (query, key) pairs within a
document and of real tokens; padding = padding slots / all slots. Timing is not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import megatron_2d
from megatron_2d.layout.band import SlidingWindow
from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.packing.sharding import PackingCost, row_pairs, shard_documents, zigzag_slots
from megatron_2d.plan.lengths import DISTRIBUTIONS, cu_seqlens_of, document_lengths, read_lengths
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES, blockwise_reference
from megatron_2d_dev.bench.cluster import add_cluster_arguments, bench_cluster
from megatron_2d_dev.bench.harness import DTYPES, mib
from megatron_2d_dev.bench.runners import TE_RELEASE, count_collective_sends, count_ring_comm_sends
from megatron_2d_dev.stock_cp import StockCPGroups

ROWS = (*PACKING_MODES, "one sequence", "ring-flash-attn", "ring-flash-attn fp64")


# -- per-rank stats that do not come from a PackedSharding ------------------------------------------------------------


def slot_pairs(slots: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
    """[ranks] causal pairs of each rank's real slots (each query sees its position + 1 keys of its document)."""
    return row_pairs(slots, cu_seqlens)


def _max_over_mean(x: np.ndarray) -> float:
    return float(x.max() / max(x.mean(), 1e-30))


# -- the ranks --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One distribution's batch: lengths and the fp32 tensors [T, h, d] (inherited by the forked ranks)."""

    name: str
    cu_seqlens: np.ndarray
    tensors: tuple[torch.Tensor, ...]  # q, k, v, dout fp32
    reference: tuple[torch.Tensor, ...]  # out, dq, dk, dv fp64 (packed)


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _time_step(step, repeats: int) -> tuple[float, float]:
    """(median wall s, median CPU s of this process) over ``repeats`` steps, the ranks started together."""
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _count_ring_flash_sends(module) -> dict[str, int]:
    """Bytes ring-flash-attn's RingComm.send_recv sends (the harness's counter, see bench.runners)."""
    return count_ring_comm_sends(module)


def _errors(idx: torch.Tensor, results: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> list[float]:
    """max |result - reference| over this rank's real slots, per output."""
    real = idx >= 0
    return [
        float((r[real].to(torch.float64) - ref[idx[real]]).abs().max()) if real.any() else 0.0
        for r, ref in zip(results, reference)
    ]


def _agreed_errors(errs: list[float]) -> list[float]:
    t = torch.tensor(errs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def calibrate_cost(groups, heads: int, dim: int, repeats: int = 5) -> PackingCost:
    """The documents mode's :class:`PackingCost` measured on these ranks, all at once (so under the same sharing of
    cores as the run), and averaged over them (every rank must choose the same layout): one causal kernel call
    on 1024 tokens (fwd + bwd) for the pair cost, 64 calls of 8 x 8 for the per-call cost, a K/V block of 64 and of
    1024 tokens sent round the context ring for the ring's per-step and per-token costs (a step moves K/V forward
    and K/V plus fp32 dK/dV backward: three such transfers). The cores the ring's copies use are the ones that
    compute (gloo): no overlap."""
    from megatron_2d.kernels import select_kernel
    from megatron_2d.layout.band import Band
    from megatron_2d.layout.block_calls import BlockCall

    kernel = select_kernel(torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)

    def kernel_s(n: int, calls: int) -> float:
        q, k, v, do = (torch.randn(1, n * calls, heads, dim, generator=g) for _ in range(4))
        diagonal = [BlockCall(i * n, (i + 1) * n, i * n, (i + 1) * n, Band(None, 0)) for i in range(calls)]

        def step():
            results = kernel.forward_calls(q, k, v, diagonal, 0, dim**-0.5)
            out = torch.cat([o for _, o, _ in results], dim=1)
            lse = torch.cat([l for _, _, l in results], dim=2)
            kernel.backward_calls(do, q, k, v, out, lse, diagonal, 0, dim**-0.5)

        return min(_timed(step) for _ in range(repeats))

    def ring_s(tokens: int) -> float:
        if groups.context_kv_group is None:
            return 0.0
        ranks, me = groups.place.context_group, groups.place.context_rank
        send = torch.randn(2, 1, tokens, heads, dim, generator=g)
        recv = torch.empty_like(send)

        def step():
            ops = [  # the receive first, as the op's ring steps post them
                dist.P2POp(dist.irecv, recv, ranks[(me - 1) % len(ranks)], groups.context_kv_group),
                dist.P2POp(dist.isend, send, ranks[(me + 1) % len(ranks)], groups.context_kv_group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return min(_timed(step) for _ in range(repeats))

    pair_s = kernel_s(1024, 1) / (1024 * 1025 / 2)
    call_s = max(kernel_s(8, 64) / 64 - pair_s * 36, 0.0)
    small, large = ring_s(64), ring_s(1024)
    per_token = max(large - small, 0.0) / (1024 - 64)
    figures = torch.tensor([pair_s, call_s, 3 * per_token, 3 * max(small - 64 * per_token, 0.0)], dtype=torch.float64)
    dist.all_reduce(figures)
    pair_s, call_s, token_s, step_s = (figures / dist.get_world_size()).tolist()
    return PackingCost(pair_s=pair_s, ring_token_s=token_s, call_s=call_s, ring_step_s=step_s, overlap=0.0)


def _timed(step) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def bench_rank(rank, world, args, cases: list[Case], seq_case: Case | None, ring_flash, te_rows=()) -> dict:
    """Every row of every case on this rank: {(case, row): {...}}. ``te_rows``: (name, cp_comm_type, a2a level) of
    TE's THD context parallelism, run inside TE's CPU context (entered by the parent)."""
    timeout = datetime.timedelta(seconds=args.timeout)
    groups = megatron_2d.build_2d_groups(args.hp, args.inner_ring_size, args.placement, timeout=timeout)
    dtype = DTYPES[args.dtype]
    rows = _Rows({}, TOLERANCES[dtype].end_to_end, args.repeats)
    cost = calibrate_cost(groups, args.heads, args.dim)
    rows.out["cost"] = cost
    te_groups = StockCPGroups(world, [(world, a2a) for _, _, a2a in te_rows]) if te_rows else None
    for case in cases:
        _bench_packing_modes(rows, groups, world, case, cost, dtype)
        if ring_flash is not None:
            _bench_ring_flash(rows, rank, world, case, ring_flash, args.dim**-0.5, dtype)
        for name, kind, a2a in te_rows:
            _bench_te_thd(rows, rank, world, case, name, kind, a2a, te_groups, args.dim**-0.5, dtype)
    if seq_case is not None:
        _bench_one_sequence(rows, groups, seq_case, dtype)
    return rows.out


@dataclass
class _Rows:
    """The records of one rank's rows, {(case, row): {...}}, and how each is checked and timed."""

    out: dict
    tol: float
    repeats: int

    def run(self, key, idx, step_once, step_timed, bytes_fn, ref, ref_max) -> dict:
        """Check once (every rank agrees on pass/fail), then time; records errors, bytes and times."""
        results = step_once()
        errs = _agreed_errors(_errors(idx, results, ref))
        rel = [e / m for e, m in zip(errs, ref_max)]
        entry = {"rel_err": max(rel), "ok": max(rel) <= self.tol, "bytes": bytes_fn()}
        if entry["ok"]:
            entry["wall"], entry["cpu"] = _time_step(step_timed, self.repeats)
        self.out[key] = entry
        return entry


def _ours_sent(groups) -> dict[str, int]:
    """What the op sent since the counter was reset: ring (Double-Ring or neighbour exchange) and all-to-all."""
    b = groups.comm_bytes.as_dict()
    return {"ring": b["inner_ring"] + b["outer_ring"] + b["neighbour"], "a2a": b["all_to_all"]}


def _bench_packing_modes(rows: _Rows, groups, world: int, case: Case, cost: PackingCost, dtype) -> None:
    """The op on the case's packed batch in every packing mode (the sequence mode where 2*CP divides T)."""
    q, k, v, dout = case.tensors
    ref_max = [float(r.abs().max()) for r in case.reference]
    for mode in PACKING_MODES:
        if mode == "sequence" and int(case.cu_seqlens[-1]) % (2 * world):
            continue
        t0 = time.perf_counter()  # sharding build + this rank's calls (once per batch)
        layout = megatron_2d.PackedSharding(
            case.cu_seqlens, groups, mode=mode, **({"cost": cost} if mode == "documents" else {})
        )
        layout.calls(True, SlidingWindow())
        layout_s = time.perf_counter() - t0
        idx = layout.local_indices()
        ql, kl, vl, dl = (layout.shard(x).to(dtype) for x in (q, k, v, dout))

        def once(layout=layout, ql=ql, kl=kl, vl=vl, dl=dl):
            groups.comm_bytes.reset()
            leaves = _leaves(ql, kl, vl)
            o = megatron_2d.attention_2d(*leaves, groups, causal=True, packing=layout)
            o.backward(dl)
            return [o.detach()] + [x.grad for x in leaves]

        def timed(layout=layout, ql=ql, kl=kl, vl=vl, dl=dl):
            leaves = _leaves(ql, kl, vl)
            megatron_2d.attention_2d(*leaves, groups, causal=True, packing=layout).backward(dl)

        entry = rows.run((case.name, mode), idx, once, timed, lambda: _ours_sent(groups), case.reference, ref_max)
        stats = layout.stats()
        entry.update(
            pairs=stats["pairs_max_over_mean"],
            tokens=stats["tokens_max_over_mean"],
            padding=stats["padding_fraction"],
            ring_tokens=stats["ring_tokens"],
            long_documents=stats["long_documents"],
            layout_s=layout_s,
        )


def _bench_ring_flash(rows: _Rows, rank: int, world: int, case: Case, ring_flash, scale: float, dtype) -> None:
    """ring-flash-attn's zigzag varlen ring on the same batch (Megatron's per-document zigzag slots), fp32 and fp64."""
    q, k, v, dout = case.tensors
    ref_max = [float(r.abs().max()) for r in case.reference]
    slots = zigzag_slots(case.cu_seqlens, world)
    idx = torch.from_numpy(slots[rank].copy())
    pad = (idx < 0).view(-1, 1, 1)
    padded = np.diff(case.cu_seqlens)
    padded = -(-padded // (2 * world)) * (2 * world)
    cu_local = torch.from_numpy(np.concatenate([[0], np.cumsum(padded // world)])).to(torch.int32)
    max_local = int((padded // world).max())
    counter = _count_ring_flash_sends(ring_flash)
    p = slot_pairs(slots, case.cu_seqlens)
    t = (slots >= 0).sum(axis=1)
    for name, row_dtype in (("ring-flash-attn", dtype), ("ring-flash-attn fp64", torch.float64)):
        ql, kl, vl, dl = (
            x.index_select(0, idx.clamp(min=0)).masked_fill(pad, 0).to(row_dtype) for x in (q, k, v, dout)
        )

        def once_rf(ql=ql, kl=kl, vl=vl, dl=dl):
            counter["bytes"] = 0
            leaves = _leaves(ql, kl, vl)
            o = ring_flash.zigzag_ring_flash_attn_varlen_func(
                *leaves, cu_local, max_local, softmax_scale=scale, causal=True, group=None
            )
            o.backward(dl)
            return [o.detach()] + [x.grad for x in leaves]

        def timed_rf(ql=ql, kl=kl, vl=vl, dl=dl):
            leaves = _leaves(ql, kl, vl)
            ring_flash.zigzag_ring_flash_attn_varlen_func(
                *leaves, cu_local, max_local, softmax_scale=scale, causal=True, group=None
            ).backward(dl)

        def sent_rf():
            return {"ring": counter["bytes"], "a2a": 0}

        entry = rows.run((case.name, name), idx, once_rf, timed_rf, sent_rf, case.reference, ref_max)
        entry.update(pairs=_max_over_mean(p), tokens=_max_over_mean(t), padding=float((slots < 0).mean()))


def te_thd_rows(world: int, heads: int, release: str) -> list[tuple[str, str, int]]:
    """(name, cp_comm_type, a2a level) of TE's THD context parallelism at CP = ``world`` that ``release`` runs
    (megatron_2d_dev.stock_cp.THD_FROM) and the heads allow (a2a levels must divide them)."""
    from megatron_2d_dev.stock_cp import THD_FROM

    version = tuple(int(x) for x in release.split(".")[:2])

    def accepts(kind: str) -> bool:
        return version >= tuple(int(x) for x in THD_FROM[kind].split("."))

    rows = [("TE p2p", "p2p", 1)] if accepts("p2p") else []
    if accepts("a2a") and heads % world == 0:
        rows.append(("TE a2a", "a2a", world))
    if accepts("a2a+p2p"):
        rows += [(f"TE a2a+p2p [{a}, {world // a}]", "a2a+p2p", a) for a in range(2, world) if world % a == 0
                 and heads % a == 0]  # fmt: skip
    if accepts("all_gather"):
        rows.append(("TE all_gather", "all_gather", 1))
    return rows


def _bench_te_thd(rows: _Rows, rank, world, case: Case, name, kind, a2a, te_groups, scale, dtype) -> None:
    """TE's THD context parallelism (attn_forward_func_with_cp, as TE's DotProductAttention calls it for a packed
    batch) on the same batch: every document padded to a multiple of 2 CP by TE's rule and split by TE's partition
    (megatron_2d_dev.stock_cp.thd_layout); its sends counted (count_collective_sends)."""
    from megatron_2d_dev.stock_cp import thd_layout
    from megatron_2d_dev.te_context_parallel import active

    te = active()
    q, k, v, dout = case.tensors
    ref_max = [float(r.abs().max()) for r in case.reference]
    cp_group, ranks, cp_rank = te_groups.layout(world, kind, a2a, rank)
    cu, cu_padded, source, local = thd_layout(te, np.diff(case.cu_seqlens), world, cp_rank)
    idx = source[local]  # this rank's slots: source token, -1 for padding
    ql, kl, vl, dl = (torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx].to(dtype) for x in (q, k, v, dout))
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    counted: dict[str, float] = {}

    def call(leaves):
        return te.attn_forward_func_with_cp(
            True, *leaves, cu, cu, longest, longest, cu_padded, cu_padded, 0.0, cp_group, ranks, torch.cuda.Stream(),
            kind, softmax_scale=scale, qkv_format="thd", attn_mask_type="padding_causal", use_fused_attention=True,
            window_size=(-1, 0), pad_between_seqs=True,
        )  # fmt: skip

    def once_te():
        counted.clear()
        leaves = _leaves(ql, kl, vl)
        with count_collective_sends(counted):
            o = call(leaves)
            o.backward(dl)
        return [o.detach()] + [x.grad for x in leaves]

    def timed_te():
        leaves = _leaves(ql, kl, vl)
        call(leaves).backward(dl)

    def sent_te():
        ring = counted.get("p2p", 0) + counted.get("all_gather", 0) + counted.get("reduce_scatter", 0)
        return {"ring": ring, "a2a": counted.get("a2a", 0)}

    entry = rows.run((case.name, name), idx, once_te, timed_te, sent_te, case.reference, ref_max)
    slots = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(slots, idx)
    slots = torch.stack(slots).numpy()
    p, t = slot_pairs(slots, case.cu_seqlens), (slots >= 0).sum(axis=1)
    entry.update(pairs=_max_over_mean(p), tokens=_max_over_mean(t), padding=float((slots < 0).mean()))


def _bench_one_sequence(rows: _Rows, groups, seq_case: Case, dtype) -> None:
    """The op on the whole batch as one sequence (no document masking): the unpacked baseline."""
    cp_index, cp_size = groups.place.cp_index, groups.layout.cp_size
    q, k, v, dout = (megatron_2d.shard_sequence(x.unsqueeze(1), cp_index, cp_size).to(dtype) for x in seq_case.tensors)
    T = seq_case.tensors[0].shape[0]
    ref_max = [float(r.abs().max()) for r in seq_case.reference]
    chunk = T // (2 * cp_size)
    first, second = megatron_2d.zigzag_chunks(cp_index, cp_size)
    idx = torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )

    def once_seq():
        groups.comm_bytes.reset()
        leaves = _leaves(q, k, v)
        o = megatron_2d.attention_2d(*leaves, groups, causal=True)
        o.backward(dout)
        return [x.squeeze(1) for x in [o.detach()] + [y.grad for y in leaves]]

    def timed_seq():
        leaves = _leaves(q, k, v)
        megatron_2d.attention_2d(*leaves, groups, causal=True).backward(dout)

    entry = rows.run(
        ("*", "one sequence"), idx, once_seq, timed_seq, lambda: _ours_sent(groups), seq_case.reference, ref_max
    )
    entry.update(pairs=1.0, tokens=1.0, padding=0.0)


# -- driver -------------------------------------------------------------------------------------------------------


def parse_tokens(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def cached_reference(args, tensors, cu: np.ndarray, scale: float):
    """The fp64 reference (out, dq, dk, dv) of the packed batch (:func:`blockwise_reference`), stored under
    ``args.cache`` keyed by the lengths, shapes and seed (the inputs are a function of those), so runs at other rank
    counts reuse it."""
    if not args.cache:
        return blockwise_reference(*tensors, cu, scale=scale)
    key = hashlib.sha256(cu.astype(np.int64).tobytes() + repr((tuple(tensors[0].shape), args.seed, scale)).encode())
    path = os.path.join(args.cache, f"ref_{key.hexdigest()[:24]}.pt")
    if os.path.exists(path):
        return tuple(torch.load(path))
    ref = blockwise_reference(*tensors, cu, scale=scale)
    os.makedirs(args.cache, exist_ok=True)
    torch.save(list(ref), path + ".tmp")
    os.replace(path + ".tmp", path)
    return ref


def _tensors(T: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, heads, dim, generator=g) for _ in range(4))


def load_ring_flash():
    """ring-flash-attn's zigzag varlen module through the CPU stand-in, or (None, reason)."""
    from megatron_2d_dev.flash_attn_cpu import flash_attn_stand_in, load_ring_flash_attn_module

    try:
        with flash_attn_stand_in():
            return load_ring_flash_attn_module("zigzag_ring_flash_attn_varlen"), ""
    except ImportError as err:
        return None, f"ring-flash-attn does not import: {err}"


def build_cases(args) -> list[Case]:
    cases = []
    scale = args.dim**-0.5
    tensors = _tensors(args.tokens, args.heads, args.dim, args.seed)
    sources = (
        [(f"file:{args.lengths}", read_lengths(args.lengths))]
        if args.lengths
        else [(name, document_lengths(name, args.tokens, args.seed)) for name in args.dists]
    )
    for name, lengths in sources:
        cu = cu_seqlens_of(lengths)
        T = int(cu[-1])
        ts = tensors if T == args.tokens else _tensors(T, args.heads, args.dim, args.seed)
        t0 = time.perf_counter()
        reference = cached_reference(args, ts, cu, scale)
        print(
            f"[{name}] {len(lengths)} documents, T={T}, longest {int(lengths.max())}: reference in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        cases.append(Case(name, cu, ts, reference))
    return cases


def layout_build_times(documents: int, sizes: Sequence[tuple[int, int]], seed: int = 0) -> Table:
    """Time to build a PackedSharding and one rank's calls (what a batch costs before its first attention call),
    in one process, as CPU time (a loaded machine stretches wall time, not this): a rank's Groups2D without process
    groups (the cross-rank check then has nothing to do). Lognormal lengths (median ~400 tokens), the last one
    lengthened so that 2*CP divides T (the sequence mode); ``sizes``: (CP, hp) pairs. Plans are rank 0's, and
    those of the context rank in the middle (zigzag's rank 0 sees only its own first chunks)."""
    from megatron_2d.groups import Groups2D
    from megatron_2d.layout.topology import Layout2D, place_all_ranks

    lengths = np.maximum(1, np.random.default_rng(seed).lognormal(6, 1.2, size=documents).astype(np.int64))
    lengths[-1] += -lengths.sum() % (2 * max(CP for CP, _ in sizes))
    cu = cu_seqlens_of(lengths.tolist())
    table = Table(title=f"PackedSharding build + calls (CPU time): {documents} documents, T={int(cu[-1])}")
    for col in (
        "CP",
        "hp x cp",
        "mode",
        "layout ms",
        "calls ms",
        "calls",
        "mid-rank calls ms",
        "mid-rank calls",
        "long documents",
    ):
        table.add_column(col, justify="right")
    for CP, hp in sizes:
        layout = Layout2D(CP, hp, 1)
        places = place_all_ranks(layout, [list(range(CP))], CP)
        mid = layout.index_of(0, layout.context_size // 2)
        for mode in PACKING_MODES:
            t0 = time.process_time()
            packed = megatron_2d.PackedSharding(
                cu, Groups2D(layout, places[0], None, None, None, None, None), mode=mode
            )
            t1 = time.process_time()
            own = packed.calls(True, SlidingWindow())
            t2 = time.process_time()
            other = megatron_2d.PackedSharding(
                cu, Groups2D(layout, places[mid], None, None, None, None, None), mode=mode
            )
            t3 = time.process_time()
            other_calls = other.calls(True, SlidingWindow())
            t4 = time.process_time()
            table.add_row(
                str(CP),
                f"{hp} x {CP // hp}",
                mode,
                f"{(t1 - t0) * 1e3:.0f}",
                f"{(t2 - t1) * 1e3:.0f}",
                str(sum(len(c) for c in own.values())),
                f"{(t4 - t3) * 1e3:.0f}",
                str(sum(len(c) for c in other_calls.values())),
                str(packed.stats()["long_documents"]),
            )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks N = hp * cp (default 4)")
    parser.add_argument("--hp", type=int, default=1, help="head-parallel size (default 1: a ring of N)")
    parser.add_argument(
        "--inner-ring-size", type=int, default=None, help="Double-Ring inner ring size w (default: cp, one ring)"
    )
    parser.add_argument("--placement", default="head_first")
    parser.add_argument("--tokens", type=parse_tokens, default=16384, help="total tokens T, e.g. 16K (default)")
    parser.add_argument("--dists", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument("--lengths", help="a file of document lengths (one per line or a JSON list) instead")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-sequence",
        action="store_true",
        help="skip the one-sequence row (its fp64 reference is the slowest part at large T)",
    )
    parser.add_argument("--no-ring-flash", action="store_true", help="skip ring-flash-attn")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="every row's dtype (default fp32; TE's THD rows need bf16: its fused attention takes fp16 / bf16)",
    )
    parser.add_argument(
        "--te-release",
        default=TE_RELEASE,
        help=f"the Transformer Engine release of the TE THD rows (default {TE_RELEASE}; 'none' to skip them)",
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument(
        "--cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "megatron_2d_bench"),
        help="directory for the fp64 references (reused across rank counts; '' = none)",
    )
    add_cluster_arguments(parser)
    parser.add_argument(
        "--layout-build",
        type=int,
        metavar="DOCUMENTS",
        help="only time building shardings and calls for this many documents at CP 8 to 1024",
    )
    args = parser.parse_args(argv)
    if args.layout_build:
        Console(width=190).print(
            layout_build_times(args.layout_build, [(8, 1), (64, 8), (128, 1), (1024, 8), (1024, 1)], args.seed)
        )
        return
    if args.ranks % args.hp:
        parser.error(f"--hp {args.hp} must divide --ranks {args.ranks}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cases = build_cases(args)
    seq_case = None
    if not args.no_sequence:
        if args.tokens % (2 * args.ranks):
            parser.error(f"the one-sequence row needs --tokens divisible by 2 * ranks = {2 * args.ranks}")
        ts = _tensors(args.tokens, args.heads, args.dim, args.seed)
        t0 = time.perf_counter()
        seq_case = Case(
            "*",
            cu_seqlens_of([args.tokens]),
            ts,
            cached_reference(args, ts, cu_seqlens_of([args.tokens]), args.dim**-0.5),
        )
        print(f"[one sequence] reference in {time.perf_counter() - t0:.1f} s", flush=True)
    ring_flash, why = (None, "--no-ring-flash") if args.no_ring_flash else load_ring_flash()
    te_rows, te_why = [], ""
    with contextlib.ExitStack() as stack:
        if args.te_release == "none":
            te_why = "--te-release none"
        elif args.dtype == "fp32":
            te_why = "TE's fused attention takes fp16 / bf16: --dtype bf16"
        else:
            from megatron_2d_dev.te_context_parallel import te_context_parallel_on_cpu

            stack.enter_context(te_context_parallel_on_cpu(args.te_release, claim_cuda=False))
            te_rows = te_thd_rows(args.ranks, args.heads, args.te_release)
        cluster = stack.enter_context(bench_cluster(args, args.ranks, DTYPES[args.dtype]))
        setup = cluster.rank_setup if cluster else None
        t0 = time.perf_counter()
        results = run_on_ranks(
            args.ranks,
            bench_rank,
            args,
            cases,
            seq_case,
            ring_flash,
            te_rows,
            timeout_s=args.timeout,
            rank_setup=setup,
        )
    print(f"ranks done in {time.perf_counter() - t0:.1f} s", flush=True)
    print_tables(args, cases, results, why, te_rows, te_why)


def merged(results: list[dict], key) -> dict:
    """One row from the ranks: slowest wall, busiest CPU, busiest rank's bytes; stats are global already."""
    rows = [r[key] for r in results]
    m = dict(rows[0])
    m["ring"] = max(r["bytes"]["ring"] for r in rows)
    m["a2a"] = max(r["bytes"]["a2a"] for r in rows)
    if "layout_s" in m:
        m["layout_s"] = max(r["layout_s"] for r in rows)
    if m["ok"]:
        m["wall"] = max(r["wall"] for r in rows)
        m["cpu"] = max(r["cpu"] for r in rows)
    return m


def print_tables(args, cases: list[Case], results: list[dict], ring_flash_why: str, te_rows=(), te_why="") -> None:
    console = Console(width=190)
    seq = merged(results, ("*", "one sequence")) if ("*", "one sequence") in results[0] else None
    for case in cases:
        lengths = np.diff(case.cu_seqlens)
        table = Table(
            title=f"[{case.name}] {len(lengths)} documents (longest {int(lengths.max())}, median "
            f"{int(np.median(lengths))}), T={int(case.cu_seqlens[-1])}, fwd+bwd {args.dtype} causal, "
            f"{args.heads} heads d={args.dim}, N={args.ranks} CPU ranks = hp{args.hp} x "
            f"cp{args.ranks // args.hp} w{args.inner_ring_size or args.ranks // args.hp}"
        )
        for col in (
            "row",
            "check (rel err)",
            "wall ms",
            "vs zigzag",
            "cpu ms",
            "cpu vs zigzag",
            "ring MiB",
            "a2a MiB",
            "pairs max/mean",
            "tokens max/mean",
            "padding",
            "layout ms",
        ):
            table.add_column(col, justify="right")
        rows = {}
        te_names = [name for name, _, _ in te_rows]
        for name in (*PACKING_MODES, "ring-flash-attn", "ring-flash-attn fp64", *te_names):
            if (case.name, name) in results[0]:
                rows[name] = merged(results, (case.name, name))
        if seq is not None:
            rows["one sequence"] = seq
        base = rows.get("zigzag")
        for name in (*ROWS, *te_names, *([] if te_names else ["TE"])):
            if name not in rows:
                if name == "ring-flash-attn":
                    table.add_row(name, f"n/a: {ring_flash_why}", *[""] * 10)
                if name == "TE":
                    table.add_row(f"TE {args.te_release}", f"n/a: {te_why}", *[""] * 10)
                continue
            r = rows[name]
            check = f"ok {r['rel_err']:.1e}" if r["ok"] else f"FAIL {r['rel_err']:.1e}"
            timed = r["ok"] and base is not None and base["ok"]
            label = name if name != "documents" else f"documents ({r['long_documents']} long)"
            table.add_row(
                label,
                check,
                f"{r['wall'] * 1e3:.0f}" if r["ok"] else "not timed",
                f"{r['wall'] / base['wall']:.2f}" if timed else "",
                f"{r['cpu'] * 1e3:.0f}" if r["ok"] else "",
                f"{r['cpu'] / base['cpu']:.2f}" if timed else "",
                mib(r["ring"]),
                mib(r["a2a"]),
                f"{r['pairs']:.3f}",
                f"{r['tokens']:.3f}",
                f"{r['padding']:.3f}",
                f"{r['layout_s'] * 1e3:.1f}" if "layout_s" in r else "",
            )
        console.print(table)
        if te_names:
            console.print(
                f"TE rows: Transformer Engine {args.te_release}'s own THD context parallelism "
                "(attn_forward_func_with_cp, pad_between_seqs) on CPU ranks, its fused attention the cpu_flash "
                "kernel; every document padded to a multiple of 2 x CP by TE's rule; bytes counted as TE's code sent"
            )
        console.print(cost_table(case.cu_seqlens, results[0]["cost"], args.ranks // args.hp, args.hp))


def cost_table(cu_seqlens: np.ndarray, cost: PackingCost, cp: int, hp: int) -> Table:
    """What the documents mode's cost model predicted for this batch, k = the number of longest documents sharded:
    the k it chose (*) against its neighbours, none sharded beyond those that must be, and all sharded."""
    lengths = np.diff(cu_seqlens)
    chosen = shard_documents(cu_seqlens, cp, hp, cost=cost)
    k_min = int((lengths > cu_seqlens[-1] / cp).sum())
    ks = sorted(
        {
            k_min,
            max(k_min, len(chosen.long_docs) - 1),
            len(chosen.long_docs),
            min(len(lengths), len(chosen.long_docs) + 1),
            len(lengths),
        }
    )
    desc = np.sort(lengths)[::-1]
    ks = sorted(
        {
            len(
                shard_documents(
                    cu_seqlens, cp, hp, cost=cost, long_threshold=int(desc[k]) if k < len(desc) else 0
                ).long_docs
            )
            for k in ks
        }
    )  # equal lengths shard together
    table = Table(
        title=f"documents mode's cost model (measured: pair {cost.pair_s * 1e9:.2f} ns, call "
        f"{cost.call_s * 1e6:.0f} us, ring token-step {cost.ring_token_s * 1e6:.2f} us, ring step "
        f"{cost.ring_step_s * 1e6:.0f} us, overlap {cost.overlap:g})"
    )
    for col in ("k sharded", "predicted ms", "pairs max/mean", "ring prefix", "view slots"):
        table.add_column(col, justify="right")
    for k in ks:
        p = shard_documents(cu_seqlens, cp, hp, long_threshold=int(desc[k]) if k < len(desc) else 0, cost=cost)
        table.add_row(
            f"{len(p.long_docs)}{' *' if k == len(chosen.long_docs) else ''}",
            f"{p.predicted_s * 1e3:.1f}",
            f"{1 + p.pair_imbalance:.3f}",
            str(p.long_prefix),
            str(p.view_len),
        )
    return table


if __name__ == "__main__":
    main()
