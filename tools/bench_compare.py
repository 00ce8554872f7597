#!/usr/bin/env python
"""Side-by-side fwd+bwd attention benchmark: every 2D layout of CP = N and the peers, same inputs, one run.

    python tools/bench_compare.py --ranks 4                  # CPU: N forked gloo ranks, bf16
    python tools/bench_compare.py --ranks 8 --json out.json  # also save the rows
    torchrun --nproc-per-node 8 tools/bench_compare.py --device cuda --seq 65536 --heads 32 --kv-heads 8 --dim 128

Implementations (rows)
    2D (ours)               attention_2d for every (hp, cp, w, placement) of CP = N, as tools/bench_attention.py
    ring-flash-attn zigzag  zigzag_ring_flash_attn_func of ring-flash-attn (pip); on CPU its flash_attn kernels are
                            the stand-in of megatron_2d.testing.flash_attn_cpu (never on GPU)
    TE p2p / a2a / a2a+p2p  Transformer Engine's DotProductAttention with its context parallelism, set up as stock
                            Megatron's TEDotProductAttention does (sbhd, causal, Megatron's zigzag shards; a2a+p2p
                            with [a2a group of A adjacent ranks, p2p group of ranks A apart]); --device cuda only
    yunchang (USP) is left out: on CPU its torch path has no backward.

Correctness gate: before any timing every implementation runs once on the same zigzag-sharded inputs, and its
out, dq, dk, dv are compared with an fp64 reference (exact causal softmax attention, computed blockwise on the
ranks). An implementation above the dtype's tolerance is reported as MISMATCH, one that raises as ERROR, one that
cannot run here as n/a; none of them is timed.

Columns
    time ms          median over --repeats rounds (after the check run and a warm-up round) of the slowest
                     rank; the rounds go round-robin over the implementations
    x vs <family>    time / the best time of that family in this run (2D (ours), each peer)
    vs ideal         ideal / time; ideal = single-process kernel fwd+bwd on the full problem / min(N, cores) on
                     CPU (one thread, as bench_attention.py; timed before and after the ranks, the smaller is
                     used and a drift is reported), / N on GPUs
    a2a, ring MiB    bytes one rank sends per fwd+bwd: ours measured (groups.comm_bytes), peers by closed form (f)
    err              max relative error, max |x - ref| / max |ref| over the whole tensor, of out/dq/dk/dv

Bytes per rank of the peers (closed forms). Nq = b*(S/N)*hq*d and Nkv = b*(S/N)*hkv*d are the elements of this
rank's local Q and K (V is the size of K), e is the input dtype's size, cp the ring length:
    ring-flash-attn zigzag  forward: K and V (cp-1) times in the input dtype; backward: K and V (cp-1) times in the
                            input dtype, and dK, dV cp times in fp32 (its accumulators; the last hop brings each
                            rank's own dK/dV home)                      ring = 2*Nkv*((cp-1)*2*e + cp*4)
                            Checked: the ranks also count what its RingComm actually sends (a mismatch is printed).
    TE p2p (not FP8)        forward K/V (cp-1) times; backward K/V (cp-1) times and dK/dV (cp-1) times, all in
                            the input dtype                             ring = 2*Nkv*e*3*(cp-1)
    TE a2a                  q, k, v, out forward and dout, dq, dk, dv backward, each sending (N-1)/N of itself
                                                                        a2a = 2*(2*Nq + 2*Nkv)*e*(N-1)/N
    TE a2a+p2p [A, P]       that all-to-all over A ranks, then the p2p ring over P = N/A ranks, whose K/V blocks
                            have Nkv elements again (A times the tokens, 1/A of the heads)
                                        a2a = 2*(2*Nq + 2*Nkv)*e*(A-1)/A, ring = 2*Nkv*e*3*(P-1)
    The TE forms are read off TE's context_parallel.py (AttnFuncWithCPAndKVP2P, AttnFuncWithCPAndQKVOA2A) and
    are not checked by running TE here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.testing.distributed import run_on_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_attention, when imported from elsewhere
from bench_attention import DTYPES as _BENCH_DTYPES, all_layouts, make_inputs, render_table, time_single_process  # noqa: E402

DTYPES = dict(_BENCH_DTYPES, fp64=torch.float64)

# Max relative error (max |err| / max |ref|) against the fp64 reference that still counts as correct. bf16 and
# fp16 match tests/reference.py; fp32 is looser than the unit tests (1e-5) because the sizes here are larger.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

OURS = "2D (ours)"
RING_FLASH = "ring-flash-attn zigzag"
TENSORS = ("out", "dq", "dk", "dv")

Tensors4 = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# -- implementations --------------------------------------------------------------------------------------------

class Runner:
    """One implementation, built on every rank. Inputs and outputs of ``to_native``/``from_native`` are this
    rank's zigzag shards in Megatron's sbhd layout; ``step`` (the timed part) works in the implementation's own."""

    bytes_source = "measured"

    def to_native(self, q, k, v, dout) -> tuple:
        """sbhd shards -> whatever ``step`` takes (not timed)."""
        return q, k, v, dout

    def step(self, q, k, v, dout) -> Tensors4:
        """Forward + backward; returns (out, dq, dk, dv) in the native layout."""
        raise NotImplementedError

    def from_native(self, out, dq, dk, dv) -> Tensors4:
        """Native results -> sbhd shards (not timed)."""
        return out, dq, dk, dv

    def bytes_sent(self) -> Dict[str, float]:
        """Bytes this rank sent in the last ``step``, by kind; the same keys on every rank ('a2a' and 'ring')."""
        raise NotImplementedError


@dataclass
class Impl:
    """A row of the comparison: ``build(rank, world, args)`` runs on every rank (collectively, in row order) and
    returns a :class:`Runner`; ``unavailable`` (decided before forking) puts an n/a row in instead."""

    name: str
    family: str
    build: Optional[Callable[[int, int, argparse.Namespace], Runner]] = None
    unavailable: str = ""
    layout: Optional[Dict[str, object]] = None


def _leaves(*xs: torch.Tensor) -> List[torch.Tensor]:
    """Fresh autograd leaves sharing the inputs' storage (no copy inside the timed region)."""
    return [x.detach().requires_grad_(True) for x in xs]


class Ours2D(Runner):
    """megatron_2d.attention_2d with one (hp, cp, w, placement) layout."""

    def __init__(self, layout, timeout: datetime.timedelta):
        self.groups = megatron_2d.build_2d_groups(layout.hp, layout.w, layout.placement, timeout=timeout)

    def step(self, q, k, v, dout):
        self.groups.comm_bytes.reset()
        q, k, v = _leaves(q, k, v)
        out = megatron_2d.attention_2d(q, k, v, self.groups, causal=True)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def bytes_sent(self):
        sent = self.groups.comm_bytes.as_dict()
        return {"a2a": sent["all_to_all"], "ring": sent["inner_ring"] + sent["outer_ring"],
                "inner_ring": sent["inner_ring"], "outer_ring": sent["outer_ring"]}


def ring_flash_bytes(kv_elements: int, cp: int, element_size: int) -> int:
    """ring-flash-attn zigzag's bytes per rank per fwd+bwd (see the module docstring): K and V (cp-1) times in
    each direction in the input dtype, dK and dV cp times in fp32."""
    return 2 * kv_elements * ((cp - 1) * 2 * element_size + cp * 4)


def _count_ring_comm_sends(module) -> Dict[str, int]:
    """Wrap the RingComm.send_recv of our private copy of ring-flash-attn to count the bytes it sends (idempotent)."""
    cls = module.RingComm
    if not hasattr(cls, "_bench_sent"):
        counter = {"bytes": 0}
        original = cls.send_recv

        def send_recv(self, to_send, recv_tensor=None):
            counter["bytes"] += to_send.numel() * to_send.element_size()
            return original(self, to_send, recv_tensor)

        cls.send_recv = send_recv
        cls._bench_sent = counter
    return cls._bench_sent


class RingFlashZigzag(Runner):
    """ring-flash-attn's zigzag ring over the default group; bshd inputs ([b, s_local, h, d], same zigzag shards)."""

    bytes_source = "closed form"

    def __init__(self, module):
        self.func = module.zigzag_ring_flash_attn_func
        self.counter = _count_ring_comm_sends(module)
        self.world = dist.get_world_size()
        self.kv_shape: Tuple[int, ...] = ()
        self.element_size = 0

    def to_native(self, q, k, v, dout):
        return tuple(x.transpose(0, 1).contiguous() for x in (q, k, v, dout))   # [s, b, h, d] -> [b, s, h, d]

    def step(self, q, k, v, dout):
        self.counter["bytes"] = 0
        self.kv_shape, self.element_size = tuple(k.shape), k.element_size()
        q, k, v = _leaves(q, k, v)
        out = self.func(q, k, v, causal=True, group=None)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        return tuple(x.transpose(0, 1) for x in (out, dq, dk, dv))           # [b, s, h, d] -> [s, b, h, d]

    def bytes_sent(self):
        formula = ring_flash_bytes(math.prod(self.kv_shape), self.world, self.element_size)
        return {"a2a": 0, "ring": formula, "ring_counted": self.counter["bytes"]}


def te_bytes(kind: str, q_elements: int, kv_elements: int, element_size: int, world: int, a2a_size: int) -> Dict[str, float]:
    """TE's bytes per rank per fwd+bwd for ``kind`` p2p / a2a / a2a+p2p (closed forms of the module docstring)."""
    a = {"p2p": 1, "a2a": world, "a2a+p2p": a2a_size}[kind]
    ring = world // a
    a2a = 2 * (2 * q_elements + 2 * kv_elements) * element_size * (a - 1) / a
    return {"a2a": a2a, "ring": 2 * kv_elements * element_size * 3 * (ring - 1)}


class TEContextParallel(Runner):
    """Transformer Engine's DotProductAttention with context parallelism ``kind`` over all ranks (CUDA only)."""

    bytes_source = "closed form"

    def __init__(self, kind: str, a2a_size: int, args, world: int, timeout: datetime.timedelta):
        import transformer_engine.pytorch as te                     # lazy: GPU-only dependency

        self.kind, self.a2a_size, self.world = kind, a2a_size, world
        ranks = list(range(world))
        if kind == "a2a+p2p":
            # Megatron's hierarchical CP groups: the a2a level on adjacent ranks, the p2p level A apart. Every rank
            # creates every group (new_group is collective), keeping its own.
            a2a_groups = [ranks[i:i + a2a_size] for i in range(0, world, a2a_size)]
            p2p_groups = [ranks[j::a2a_size] for j in range(a2a_size)]
            mine = []
            for lists in (a2a_groups, p2p_groups):
                for members in lists:
                    group = dist.new_group(members, timeout=timeout)
                    if dist.get_rank() in members:
                        mine.append(group)
            cp_group = mine
        else:
            cp_group = dist.new_group(ranks, timeout=timeout)
        self.attn = te.DotProductAttention(num_attention_heads=args.heads, kv_channels=args.dim,
                                           num_gqa_groups=args.kv_heads, attention_dropout=0.0,
                                           qkv_format="sbhd", attn_mask_type="causal")
        self.attn.set_context_parallel_group(cp_group, ranks, torch.cuda.Stream(), kind)
        self.q_elements = self.kv_elements = self.element_size = 0

    def to_native(self, q, k, v, dout):
        s, b, h, d = dout.shape
        return q, k, v, dout.reshape(s, b, h * d)                    # TE returns [s, b, h*d]

    def step(self, q, k, v, dout):
        self.q_elements, self.kv_elements, self.element_size = q.numel(), k.numel(), k.element_size()
        q, k, v = _leaves(q, k, v)
        out = self.attn(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        return out.view(dq.shape), dq, dk, dv

    def bytes_sent(self):
        return te_bytes(self.kind, self.q_elements, self.kv_elements, self.element_size, self.world, self.a2a_size)


def ours_impls(args) -> List[Impl]:
    """One row per 2D layout of CP = N whose hp divides the query heads."""
    timeout = datetime.timedelta(seconds=args.timeout)
    rows = []
    for layout in all_layouts(args.ranks):
        if args.heads % layout.hp:
            continue
        rows.append(Impl(layout.label, OURS, build=lambda rank, world, a, lay=layout: Ours2D(lay, timeout),
                         layout=asdict(layout)))
    return rows


def ring_flash_impl(args) -> Impl:
    """ring-flash-attn's zigzag ring: on CPU through the flash_attn stand-in, on GPU only with the real flash_attn.

    The module is loaded here, in the parent, so a missing package gives one clear n/a row; forked ranks inherit it.
    """
    from megatron_2d.testing.flash_attn_cpu import flash_attn_stand_in, load_ring_flash_attn_module

    try:
        if args.device == "cpu":
            with flash_attn_stand_in():
                module = load_ring_flash_attn_module("zigzag_ring_flash_attn")
        else:
            module = load_ring_flash_attn_module("zigzag_ring_flash_attn")   # needs the real flash_attn
    except ImportError as err:
        return Impl(RING_FLASH, RING_FLASH, unavailable=f"ring-flash-attn does not import: {err}")
    return Impl(RING_FLASH, RING_FLASH, build=lambda rank, world, a: RingFlashZigzag(module))


def te_impls(args) -> List[Impl]:
    """TE p2p, a2a and every a2a+p2p [A, N/A] (TE does not replicate K/V: A must divide hq and hkv)."""
    timeout = datetime.timedelta(seconds=args.timeout)
    n = args.ranks
    if args.device != "cuda":
        return [Impl("TE p2p / a2a / a2a+p2p", "TE", unavailable="Transformer Engine CP needs CUDA (--device cuda)")]
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        return [Impl(f"TE {kind}", f"TE {kind}", unavailable=f"transformer_engine does not import: {err}")
                for kind in ("p2p", "a2a", "a2a+p2p")]

    def impl(kind: str, a2a_size: int, name: str) -> Impl:
        return Impl(name, f"TE {kind}", build=lambda rank, world, a: TEContextParallel(kind, a2a_size, a, world,
                                                                                        timeout))

    rows = [impl("p2p", 1, "TE p2p")]
    if args.heads % n or args.kv_heads % n:
        rows.append(Impl("TE a2a", "TE a2a", unavailable=f"a2a needs CP={n} to divide hq={args.heads} and "
                                                         f"hkv={args.kv_heads}"))
    else:
        rows.append(impl("a2a", n, "TE a2a"))
    sizes = [a for a in range(2, n) if n % a == 0 and args.heads % a == 0 and args.kv_heads % a == 0]
    rows += [impl("a2a+p2p", a, f"TE a2a+p2p [{a}, {n // a}]") for a in sizes]
    if not sizes:
        rows.append(Impl("TE a2a+p2p", "TE a2a+p2p", unavailable=f"no a2a size 1 < A < {n} divides hq and hkv"))
    return rows


def all_impls(args) -> List[Impl]:
    """Every row of one run: ours, then the peers (unless --no-peers)."""
    rows = ours_impls(args)
    if args.peers:
        rows.append(ring_flash_impl(args))
        rows += te_impls(args)
    return rows


# -- fp64 reference ---------------------------------------------------------------------------------------------

def reference_on_rank(q, k, v, dout, rank: int, world: int, max_elements: int = 2 ** 24) -> Tensors4:
    """Exact causal attention in fp64: this rank's zigzag shards of out, dq, dk, dv from the FULL sbhd inputs.

    Each rank computes the rows of its own queries (blocks of consecutive positions, against the keys they can see)
    and its queries' share of dK/dV for all keys, which an all-reduce over the default group sums.

    Notation
        S tokens, b batch, hkv K/V heads, g = hq/hkv query heads per K/V head, d head dim
        n query rows of a block at positions p0..p0+n-1; m = p0+n keys visible to the block (causal)
        q, dout [S, b, hq, d] -> [S, b, hkv, g, d] (no K/V repeat: GQA groups stay a dimension)
        scores, p, dp, ds [b, hkv, g, n, m];   lse, delta [b, hkv, g, n, 1]
    """
    S, b, hq, d = q.shape
    hkv = k.shape[2]
    g, scale = hq // hkv, d ** -0.5
    f64 = lambda x: x.to(torch.float64)                                                  # noqa: E731
    q5, do5 = (f64(x).view(S, b, hkv, g, d) for x in (q, dout))                         # [S, b, hkv, g, d]
    k64, v64 = f64(k), f64(v)                                                           # [S, b, hkv, d]
    dk, dv = torch.zeros_like(k64), torch.zeros_like(v64)
    outs, dqs = [], []
    chunk = S // (2 * world)
    rows_per_block = max(1, min(chunk, max_elements // max(1, b * hq * S)))
    for c in megatron_2d.zigzag_chunks(rank, world):
        for p0 in range(c * chunk, (c + 1) * chunk, rows_per_block):
            p1 = min(p0 + rows_per_block, (c + 1) * chunk)
            qb, dob, kb, vb = q5[p0:p1], do5[p0:p1], k64[:p1], v64[:p1]
            scores = torch.einsum("nbhgd,mbhd->bhgnm", qb, kb) * scale
            rows = torch.arange(p0, p1, device=q.device)
            future = torch.arange(p1, device=q.device)[None, :] > rows[:, None]          # [n, m]
            scores.masked_fill_(future, float("-inf"))
            p = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
            out = torch.einsum("bhgnm,mbhd->nbhgd", p, vb)
            dp = torch.einsum("nbhgd,mbhd->bhgnm", dob, vb)
            delta = torch.einsum("nbhgd,nbhgd->bhgn", dob, out).unsqueeze(-1)
            ds = p * (dp - delta) * scale
            dqs.append(torch.einsum("bhgnm,mbhd->nbhgd", ds, kb))
            dk[:p1] += torch.einsum("bhgnm,nbhgd->mbhd", ds, qb)
            dv[:p1] += torch.einsum("bhgnm,nbhgd->mbhd", p, dob)
            outs.append(out)
    if world > 1:
        dist.all_reduce(dk)
        dist.all_reduce(dv)
    shard = lambda x: megatron_2d.shard_sequence(x, rank, world)                          # noqa: E731
    return (torch.cat(outs).view(-1, b, hq, d), torch.cat(dqs).view(-1, b, hq, d), shard(dk), shard(dv))


def error_parts(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> List[float]:
    """[max |x - ref|, max |ref|] for out, dq, dk, dv in turn (8 numbers), on this rank's shards."""
    parts = []
    for x, r in zip(got, ref):
        parts += [(x.to(torch.float64) - r).abs().max().item(), r.abs().max().item()]
    return parts


def relative_errors(parts: Sequence[float]) -> Dict[str, float]:
    """{'out': ..., 'dq': ..., 'dk': ..., 'dv': ...} from the (all-reduced) output of :func:`error_parts`;
    a NaN anywhere gives NaN (so it fails the tolerance)."""
    errs = {}
    for i, name in enumerate(TENSORS):
        diff, scale = parts[2 * i], parts[2 * i + 1]
        errs[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return errs


def passes(errors: Dict[str, float], dtype: torch.dtype) -> bool:
    """True when every relative error is finite and below the dtype's tolerance."""
    return all(math.isfinite(e) and e < TOLERANCE[dtype] for e in errors.values())


# -- one rank ---------------------------------------------------------------------------------------------------

def _all_max(values: Sequence[float], device: torch.device) -> List[float]:
    """Element-wise max over all ranks (NaN propagates)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    nan = torch.isnan(t).to(torch.float64)
    dist.all_reduce(nan, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [math.nan if n else x for x, n in zip(t.tolist(), nan.tolist())]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_once(runner: Runner, native: tuple, device: torch.device) -> float:
    """Seconds of one fwd+bwd on this rank, all ranks starting together and waiting for the slowest."""
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    runner.step(*native)
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def _check(impl: Impl, rank, world, args, shards, ref, device) -> Tuple[Dict[str, object], Optional[tuple]]:
    """Build one implementation and check it against the reference: (result, (runner, native inputs) or None).

    Every rank reaches the same verdict (the failure flag and the errors are all-reduced)."""
    result: Dict[str, object] = {"status": "ok", "seconds": None, "errors": None, "bytes": None}
    failure, built = "", None
    try:
        runner = impl.build(rank, world, args)
        native = runner.to_native(*shards)
        got = runner.from_native(*runner.step(*native))
        parts = error_parts(got, ref)
        built = (runner, native)
    except Exception as err:                           # reported as a row, the run goes on
        failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
        parts = [math.nan] * 8
    failed = _all_max([1.0 if failure else 0.0], device)[0]
    result["errors"] = relative_errors(_all_max(parts, device))
    if failed:
        result["status"] = f"ERROR: {failure}" if failure else "ERROR on another rank"
        return result, None
    if not passes(result["errors"], DTYPES[args.dtype]):
        result["status"] = "MISMATCH"
        return result, None
    return result, built


def compare_on_rank(rank: int, world: int, args, impls: Sequence[Impl], device: str = "cpu") -> List[Dict[str, object]]:
    """Every rank: the same inputs and fp64 reference; each implementation checked, then the correct ones timed.

    Timing goes round-robin (one fwd+bwd of each implementation per round, the first round a warm-up), so a slow
    phase of a shared machine hits every implementation alike; the time is the median over rounds of the slowest
    rank."""
    dev = torch.device(device)
    full = [x.to(dev) for x in make_inputs(args, DTYPES[args.dtype])]     # q, k, v, dout [S, b, h, d]
    shards = [megatron_2d.shard_sequence(x, rank, world).contiguous() for x in full]
    ref = reference_on_rank(*full, rank, world, max_elements=2 ** (27 if dev.type == "cuda" else 24))
    del full
    results, built = [], []
    for impl in impls:
        if impl.unavailable:
            results.append({"status": f"n/a: {impl.unavailable}", "seconds": None, "errors": None, "bytes": None})
            built.append(None)
        else:
            result, runner = _check(impl, rank, world, args, shards, ref, dev)
            results.append(result)
            built.append(runner)
    rounds = range(args.repeats + 1)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm
        rounds = tqdm(rounds, desc=f"{world} ranks, timing rounds", file=sys.stderr)
    times: Dict[int, List[float]] = {i: [] for i, b in enumerate(built) if b}
    for r in rounds:
        for i in times:
            t = _time_once(*built[i], dev)
            if r:
                times[i].append(t)
    for i, samples in times.items():
        runner = built[i][0]
        results[i]["seconds"] = _all_max([statistics.median(samples)], dev)[0]
        sent = runner.bytes_sent()
        keys = sorted(sent)
        results[i]["bytes"] = dict(zip(keys, _all_max([float(sent[k]) for k in keys], dev)))
        results[i]["bytes_source"] = runner.bytes_source
    return results


# -- the run ----------------------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    family: str
    status: str
    seconds: Optional[float]
    efficiency: Optional[float]
    errors: Optional[Dict[str, float]]
    bytes: Optional[Dict[str, float]]
    bytes_source: str = ""
    layout: Optional[Dict[str, object]] = None
    ratios: Dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    rows: List[Row]
    single_s: float
    ideal_s: float
    device: str
    single_runs_s: List[float] = field(default_factory=list)
    """CPU: the single-process time measured before and after the ranks ran; ``single_s`` is the smaller."""


def _run_cuda(args, impls: List[Impl]):
    """torchrun: one process per GPU, NCCL; returns (results, single-process seconds) on rank 0, (None, ..) elsewhere."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        try:
            single = time_single_process(args, DTYPES[args.dtype], "cuda")
        except (RuntimeError, ValueError) as err:      # e.g. out of memory without flash-attn: no ideal, go on
            print(f"rank {rank}: single-process timing failed ({type(err).__name__}); no 'vs ideal'", file=sys.stderr)
            single = math.nan
            torch.cuda.empty_cache()
        results = compare_on_rank(rank, world, args, impls, "cuda")
    finally:
        dist.destroy_process_group()
    return (results if rank == 0 else None), single


def _finish(args, impls: List[Impl], results, single: float) -> Report:
    """Rows from rank 0's results: efficiency vs ideal and the ratio to each family's best."""
    cores = os.cpu_count() or 1
    ideal = single / (min(args.ranks, cores) if args.device == "cpu" else args.ranks)
    rows = []
    for impl, r in zip(impls, results):
        seconds = r["seconds"]
        efficiency = ideal / seconds if seconds and math.isfinite(ideal) else None
        rows.append(Row(impl.name, impl.family, r["status"], seconds, efficiency,
                        r["errors"], r["bytes"], r.get("bytes_source", ""), impl.layout))
    best: Dict[str, float] = {}
    for row in rows:
        if row.seconds is not None:
            best[row.family] = min(best.get(row.family, math.inf), row.seconds)
    for row in rows:
        if row.seconds is not None:
            row.ratios = {family: row.seconds / t for family, t in best.items()}
    rows.sort(key=lambda r: (r.seconds is None, r.seconds or 0.0))
    return Report(rows, single, ideal, args.device)


def run_compare(args, extra_impls: Sequence[Impl] = ()) -> Optional[Report]:
    """Run every implementation (plus ``extra_impls``) once; the Report (None on CUDA ranks other than 0)."""
    if args.seq % (2 * args.ranks):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2*ranks = {2 * args.ranks}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    impls = all_impls(args) + list(extra_impls)
    if args.device == "cuda":
        results, single = _run_cuda(args, impls)
        return _finish(args, impls, results, single) if results is not None else None
    before = time_single_process(args, DTYPES[args.dtype])
    per_rank = run_on_ranks(args.ranks, compare_on_rank, args, impls, "cpu",
                            timeout_s=args.timeout * (4 + 2 * len(impls)))
    after = time_single_process(args, DTYPES[args.dtype])   # again: a shared machine's load drifts
    report = _finish(args, impls, per_rank[0], min(before, after))
    report.single_runs_s = [before, after]
    return report


# -- output -----------------------------------------------------------------------------------------------------

def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}"


def _short(family: str) -> str:
    return "best 2D" if family == OURS else family


def print_report(report: Report, args) -> None:
    """The table (fastest first; rows that were not timed last, their reasons below it)."""
    timed = [r.family for r in report.rows if r.seconds is not None]
    families = [f for f in dict.fromkeys([OURS] + timed) if f in timed]            # ours first
    where = f"{args.ranks} CPU ranks" if report.device == "cpu" else f"{args.ranks} GPUs"
    title = (f"attention fwd+bwd, {where}, S={args.seq} b={args.batch} hq={args.heads} hkv={args.kv_heads} "
             f"d={args.dim} {args.dtype} causal; single-process {report.single_s * 1e3:.0f} ms, "
             f"ideal {report.ideal_s * 1e3:.0f} ms; error tolerance {TOLERANCE[DTYPES[args.dtype]]:g}")
    header = (["implementation", "time ms"] + [f"x vs {_short(f)}" for f in families] +
              ["vs ideal", "a2a MiB", "ring MiB", "max rel err"])
    body, notes = [], []
    for r in report.rows:
        worst = max(TENSORS, key=lambda t: r.errors[t] if math.isfinite(r.errors[t]) else math.inf) if r.errors else ""
        err = f"{r.errors[worst]:.1e} {worst}" if r.errors else "-"
        if r.seconds is None:
            kind = r.status.split(":")[0]
            body.append([r.name, kind] + ["-"] * (len(families) + 3) + [err])
            if r.status != kind:
                notes.append(f"{r.name}: {r.status}")
            continue
        mark = " f" if r.bytes_source == "closed form" else ""
        body.append([r.name, f"{r.seconds * 1e3:.0f}"] + [f"{r.ratios[f]:.2f}" for f in families] +
                    [f"{100 * r.efficiency:.0f}%" if r.efficiency is not None else "-", _mib(r.bytes["a2a"]) + mark, _mib(r.bytes["ring"]) + mark, err])
        if r.bytes.get("ring_counted", r.bytes["ring"]) != r.bytes["ring"]:
            notes.append(f"warning: {r.name}: closed-form ring bytes {r.bytes['ring']:.0f} != counted "
                         f"{r.bytes['ring_counted']:.0f}")
    render_table(title, header, body, width=150)
    if any(r.status == "MISMATCH" for r in report.rows):
        notes.append(f"MISMATCH: a relative error above {TOLERANCE[DTYPES[args.dtype]]:g} against the fp64 reference "
                     f"(see the JSON for out/dq/dk/dv); such rows are not timed")
    if len(report.single_runs_s) == 2 and max(report.single_runs_s) > 1.25 * min(report.single_runs_s):
        before, after = (t * 1e3 for t in report.single_runs_s)
        notes.append(f"warning: the single-process time moved from {before:.0f} ms (before) to {after:.0f} ms (after): "
                     f"the machine's load changed during the run; 'vs ideal' uses the smaller, compare rows with care")
    if any(r.bytes_source == "closed form" for r in report.rows):
        notes.append("f: bytes from the closed forms in tools/bench_compare.py's docstring (ours are measured)")
    for note in notes:
        print(note)


def write_json(report: Report, args, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"args": vars(args), "device": report.device, "single_s": report.single_s,
                   "single_runs_s": report.single_runs_s,
                   "ideal_s": report.ideal_s, "tolerance": TOLERANCE[DTYPES[args.dtype]],
                   "rows": [asdict(r) for r in report.rows]}, f, indent=1)


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="CP size: forked CPU ranks (cuda: taken from WORLD_SIZE)")
    p.add_argument("--seq", type=int, default=4096, help="global sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8)")
    p.add_argument("--dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="default bf16 (ring-flash-attn's fp32 backward is wrong: a reused buffer is aliased)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per implementation after one warm-up (median)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: fork --ranks gloo ranks; cuda: run under torchrun (NCCL, one GPU per rank)")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="only our 2D layouts")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.causal = True                              # zigzag rings (ours and the peers) are causal
    if args.device == "cuda":
        args.ranks = int(os.environ.get("WORLD_SIZE", args.ranks))
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    report = run_compare(args)
    if report is None:
        return
    print_report(report, args)
    if args.json:
        write_json(report, args, args.json)


if __name__ == "__main__":
    main()
