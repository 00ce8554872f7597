"""gpu-check's distributed part: one torchrun rank (NCCL on GPUs, gloo in the dry run) running every case.

    python -m torch.distributed.run --standalone --nproc-per-node=N -m megatron_2d_dev.gpu_check_distributed \
        --device cuda --resume-at 0           (started by gpu_check, which keeps each case's time)

Cases, each forward + backward of attention_2d against the single-process reference, sharded as users shard:
    head all-to-all hpH b1, b2   the automatic kernel, batch 1 and 2
    Double-Ring cpN wN         the whole world one context ring
    sliding window cpN         the neighbour exchange from cp 4
    2D hp2 x cpN/2 w2          with 4 ranks or more
    packed ..., KERNEL         packed documents for each CUDA kernel: zigzag mode causal, documents mode with a
                               causal sliding window, zigzag mode with a two-sided window (non-causal: the tall
                               trimmed bands of issue 29, item 2), over the ring (hp 1) or 2D (hp 2 from 4 ranks)
    stock TE KIND cpN          stock Megatron CP beside them: Transformer Engine's own DotProductAttention and
                               context_parallel.py (the installed TE on GPUs, no shims; the dry run: TE 2.20.2 in its
                               CPU context) for each comm type at CP = N (p2p, a2a, a2a+p2p at every split with both
                               levels > 1, all_gather; causal, sbhd) and THD p2p, within TE's own bounds
                               (TOLERANCES[bf16].stock_cp), sharded as Megatron shards (megatron_2d_dev.stock_cp)
Every rank computes each case; its error (or failure) is gathered, so a case that fails on one rank fails its row on
rank 0, which reports (gpu_check_runner's protocol).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.reference import TOLERANCES, packed_reference_attention, reference_attention

from . import stock_cp
from .gpu_check import DOCS, DRY_RUN_TE, DTYPE, SIZES, kernels_here, seeded, worst
from .gpu_check_runner import Item, NotRun, run_worker
from .stock_cp import OUTPUTS, StockCPCase, StockCPGroups, expected_refusal, installed_te


@dataclass(frozen=True)
class Case:
    name: str
    hp: int
    w: int = 1
    placement: str = "head_first"
    batch: int = 1
    window: int | None = None  # the sliding window's side, as a fraction 1/window of the sequence
    causal: bool = True
    packing: str | None = None  # PackedSharding mode
    kernel: str | None = None  # None: the automatic kernel


def distributed_cases(world: int, kernels: list[str]) -> list[Case]:
    """The cases for ``world`` ranks, packed ones for each of ``kernels``."""
    hp = max(h for h in (1, 2, 4, 8) if world % h == 0)
    cases = [
        Case(f"head all-to-all hp{hp} b1", hp),
        Case(f"head all-to-all hp{hp} b2", hp, batch=2),
        Case(f"Double-Ring cp{world} w{world}", 1, w=world),
        Case(f"sliding window cp{world}", 1, window=4 * world),  # neighbour exchange from cp 4
    ]
    if world >= 4 and world % 4 == 0:
        cases.append(Case(f"2D hp2 x cp{world // 2} w2", 2, w=2, placement="context_first"))
    packed_hp = 2 if world >= 4 and world % 2 == 0 else 1
    for kernel in kernels:
        cases += [
            Case(f"packed zigzag, {kernel}", packed_hp, packing="zigzag", kernel=kernel),
            Case(f"packed documents, window, {kernel}", packed_hp, packing="documents", window=16, kernel=kernel),
            Case(
                f"packed zigzag, two-sided window, {kernel}",
                packed_hp,
                packing="zigzag",
                window=16,
                causal=False,
                kernel=kernel,
            ),
        ]
    return cases


def run_case(case: Case, device: torch.device, rank: int, world: int) -> tuple[float, str]:
    """This rank's worst error / bound for ``case`` and the transport it took."""
    seq, d = SIZES[device.type].dist_seq, 64
    groups = megatron_2d.build_2d_groups(case.hp, case.w, case.placement)
    win = (-1, -1)
    if case.window is not None:
        side = seq // case.window
        win = (side, 0) if case.causal else (side, side)
    heads = (8, 2, 2, 8)
    if case.packing is None:
        q, k, v, dout = (seeded(seq, case.batch, h, d, device=device, seed=i) for i, h in enumerate(heads))
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = reference_attention(*leaves, case.causal, d**-0.5, window=win)
        ref.backward(dout)
        layout, cache = None, groups.op_cache

        def shard(x: torch.Tensor) -> torch.Tensor:
            return megatron_2d.shard_sequence(x.detach(), rank, world)

    else:
        q, k, v, dout = (seeded(seq, h, d, device=device, seed=i) for i, h in enumerate(heads))
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        cu = torch.tensor([0] + [x for x in itertools.accumulate(DOCS) if x < seq] + [seq])
        layout = megatron_2d.PackedSharding(cu, groups, mode=case.packing)
        ref = packed_reference_attention(*leaves, cu, case.causal, d**-0.5, window=win)
        ref.backward(dout)
        cache = layout.op_cache

        def shard(x: torch.Tensor) -> torch.Tensor:
            return layout.shard(x.detach())

    local = [shard(x).to(DTYPE).requires_grad_(True) for x in (q, k, v)]
    out = megatron_2d.attention_2d(
        *local, groups, causal=case.causal, sliding_window=win, kernel=case.kernel, packing=layout
    )
    out.backward(shard(dout).to(DTYPE))
    err = worst(
        zip(
            ("out", "dq", "dk", "dv"),
            (out, *(x.grad for x in local)),
            (shard(ref), *(shard(x.grad) for x in leaves)),
        ),
        kernel=case.kernel,
    )
    return err, transport_of(cache)


def transport_of(cache: dict) -> str:
    """Which head all-to-all and K/V transport the op's cached setup took."""
    exchange, rc = next(iter(cache.values()))
    path = "no head all-to-all" if exchange.group is None else "head all-to-all"
    return f"{path}, {type(rc.transport).__name__}"


def case_item(case: Case, device: torch.device, rank: int, world: int) -> Item:
    """The row of ``case``: every rank runs it and the ranks' results are gathered (no rank waits on one that
    raised before the gather)."""

    def run():
        try:
            result = (*run_case(case, device, rank, world), None)
        except Exception as exc:  # noqa: BLE001  (reported by rank 0, below)
            result = (float("nan"), "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        failures = [(r, why) for r, (_, _, why) in enumerate(gathered) if why]
        if failures:
            raise RuntimeError("; ".join(f"rank {r}: {why}" for r, why in failures[:2]))
        return max(err for err, _, _ in gathered), gathered[0][1]

    return Item(f"distributed {world} ranks", case.name, run)


def stock_cases(world: int, seq: int, te_version: str) -> list[StockCPCase]:
    """Stock CP at CP = ``world``: each comm type TE runs there (heads the a2a levels divide: MHA with max(8, N)
    heads for a2a and a2a+p2p, GQA 8 / 2 otherwise), causal sbhd bf16 d 64, and THD p2p over gpu_check's documents."""
    chunk = seq // (2 * world)
    heads = max(8, world)
    kinds = [("p2p", 1, 8, 2), ("all_gather", 1, 8, 2)]
    if heads % world == 0:
        kinds.append(("a2a", world, heads, heads))
    kinds += [("a2a+p2p", a, heads, heads) for a in range(2, world) if world % a == 0 and heads % a == 0]
    cases = [
        StockCPCase(world, comm, a2a, True, "sbhd", DTYPE, 1, hq, hkv, 64, 64, chunk, seed=i)
        for i, (comm, a2a, hq, hkv) in enumerate(kinds)
    ]
    documents = [d for d in itertools.accumulate(DOCS) if d < seq]
    lengths = [b - a for a, b in zip([0, *documents], [*documents, seq])]
    thd = StockCPCase(world, "p2p", 1, True, "thd", DTYPE, 1, 8, 2, 64, 64, seq, tuple(lengths), seed=len(kinds))
    return [c for c in [*cases, thd] if expected_refusal(te_version, c) is None]


def stock_items(te, device: torch.device, rank: int, world: int) -> list[Item]:
    """The stock rows (``te``: TE as stock_cp.run_case takes it, or the reason it is not here)."""
    if isinstance(te, str):
        return [Item(f"stock TE, {world} ranks", "p2p / a2a / a2a+p2p / all_gather", lambda: _not_run(te))]
    cases = stock_cases(world, SIZES[device.type].dist_seq, te.version)
    groups = StockCPGroups(world, cases)
    bounds = TOLERANCES[DTYPE].stock_cp

    def run(case):
        try:
            result = stock_cp.run_case(te, case, groups, route="module", rank=rank, device=device)
            errors = result.get("errors")
            value = max(errors[o] / bounds.of(o) for o in OUTPUTS) if errors else 0.0  # measured on CP rank 0
            why = f"TE refused it: {result['refused']}" if "refused" in result else None
        except Exception as exc:  # noqa: BLE001  (reported by rank 0, below)
            value, why = float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (value, why))
        failures = [(r, w) for r, (_, w) in enumerate(gathered) if w]
        if failures:
            raise RuntimeError("; ".join(f"rank {r}: {w}" for r, w in failures[:2]))
        return max(v for v, _ in gathered), f"TE {te.version}, TE's bounds"

    names = {
        c: f"{c.comm}{f' [{c.a2a}, {c.cp // c.a2a}]' if c.comm == 'a2a+p2p' else ''} cp{c.cp} {c.qkv_format}"
        for c in cases
    }
    return [Item(f"stock TE, {world} ranks", names[c], lambda c=c: run(c)) for c in cases]


def _not_run(why: str):
    raise NotRun(why)


def stock_te_here(device: torch.device, stack: contextlib.ExitStack):
    """TE for the stock rows: on CUDA the installed one (no shims), in the dry run TE's CPU context (entered on
    ``stack``; the dry run's te_fused stand-in loaded the release); or why there is none."""
    if device.type == "cuda":
        try:
            return installed_te()
        except ImportError as err:
            return f"transformer_engine does not import: {err}"
    from .te_context_parallel import te_context_parallel_on_cpu
    from .te_package import is_installed

    if not is_installed(DRY_RUN_TE):
        return f"Transformer Engine {DRY_RUN_TE} is not installed (python -m megatron_2d_dev.te_package install)"
    return stack.enter_context(te_context_parallel_on_cpu(DRY_RUN_TE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="gpu-check's distributed cases: one torchrun rank")
    p.add_argument("--device", default="cuda")
    p.add_argument("--resume-at", type=int, default=0, help="the first case to run")
    p.add_argument("--hang", action="append", default=[], help="test hook: the cases whose name contains this sleep")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    with contextlib.ExitStack() as stack:
        kernels = kernels_here(device, stack)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
        rank, world = dist.get_rank(), dist.get_world_size()
        items = [case_item(c, device, rank, world) for c in distributed_cases(world, kernels)]
        items += stock_items(stock_te_here(device, stack), device, rank, world)
        # the hook makes the other ranks sleep: rank 0 then waits in the case's first collective, as in a real hang
        run_worker(items, args.resume_at, report=rank == 0, hang=args.hang if rank else ())
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
