"""The implementations bench_compare runs side by side, each a :class:`Runner` built on every rank.

Implementations (rows)
    2D (ours)               attention_2d for every (hp, cp, w, placement) of CP = N, as tools/bench_attention.py
    2D send first           (--send-first) the same layouts with the transport posting its sends before its receives,
                            as before issue 41 (megatron_2d_dev.bench.send_first): before/after in the same rounds
    ring-flash-attn zigzag  zigzag_ring_flash_attn_func of ring-flash-attn (pip); on CPU its flash_attn kernels are
                            the stand-in of megatron_2d_dev.flash_attn_cpu (never on GPU)
    TE p2p / a2a / a2a+p2p  Transformer Engine's DotProductAttention with its context parallelism, set up as stock
    / all_gather            Megatron's TEDotProductAttention does (sbhd, causal, Megatron's zigzag shards; a2a+p2p
                            with [a2a group of A adjacent ranks, p2p group of ranks A apart]). On CUDA the installed
                            TE; on CPU ranks TE --te-release's own code in its CPU context
                            (megatron_2d_dev.te_context_parallel), its fused attention the cpu_flash kernel
    USP ulysses U x ring R  yunchang 0.6.4's LongContextAttention(ring_impl_type="zigzag") over its own groups
                            (set_seq_parallel_pg(U, R, ...): Ulysses groups of U adjacent ranks), inputs by its
                            zigzag_extract_local; one row per U | N that divides hq and hkv (else n/a: its
                            all_to_all_4D cannot split fewer heads than U), and, where hkv < N, Ulysses N with K/V
                            repeated to N heads by the caller (inside the timed step, autograd sums the gradients).
                            On CPU over the flash_attn stand-in with __version__ 2.7.4 (yunchang calls the pre-2.6.3
                            API below 2.6.3). Adapted: in a ring of one rank (U = N) its backward's last hop (dK/dV
                            home) is a local copy, since gloo cannot send to itself (runners.count_ring_comm_sends).
    torch CP allgather /    PyTorch's context parallelism as torchtitan wires it: _ContextParallel (SDPA) on the
    alltoall                attention module by parallelize_module, inputs by _context_parallel_shard with the
                            head-tail load balancer (torch's zigzag), torch's CP dispatcher; K/V rotation by
                            set_rotate_method. GQA by SDPA's enable_gqa (K/V heads stay hkv). On CPU the SDPA op has
                            no CP rule in torch: megatron_2d_dev.bench.torch_cp_cpu registers one that runs torch's
                            _templated_ring_attention(_backward) with our cpu_flash kernel per block.

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
    TE all_gather           K and V all-gathered in forward and again in backward, dK and dV reduce-scattered, all
                            in the input dtype                          ring = 2*Nkv*e*3*(N-1)
    The TE forms are read off TE's context_parallel.py (AttnFuncWithCPAndKVP2P, AttnFuncWithCPAndQKVOA2A,
    AttnFuncWithCPAndKVAllGather) and checked on CPU ranks against what TE's code sends (isend, all_to_all_single,
    all_gather_into_tensor, reduce_scatter_tensor counted: count_collective_sends; a mismatch is printed).
    USP [U, R]              Ulysses: q, k, v, out forward and dout, dq, dk, dv backward, each sending (U-1)/U of
                            itself; then ring-flash-attn's zigzag ring over R ranks on K/V of Nkv elements again
                            (U times the tokens, 1/U of the heads); Nkv after the caller's repeat where K/V are
                            repeated (hkv -> N heads)
                                        a2a = 2*(2*Nq + 2*Nkv)*e*(U-1)/U, ring = 2*Nkv*((R-1)*2*e + R*4) (0 for R = 1:
                                        the hop home is a local copy)
                            Checked: the ranks count what its RingComm sends (a mismatch is printed).
    torch CP (both)         forward: K and V (N-1) times in the input dtype (all-gather: each rank's K/V to the N-1
                            others once; all-to-all: one hop per step); backward: the same again, and dK, dV N times
                            in fp32 (_cp_options.convert_to_f32; always all-to-all, the last hop brings them home)
                                                                        ring = 2*Nkv*((N-1)*2*e + N*4)
                            Read off torch 2.13's _context_parallel/_attention.py; not counted.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import datetime
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2d.attention import attention_2d
from megatron_2d.groups import build_groups_for_layout
from megatron_2d.layout.topology import Layout2D, divisors
from megatron_2d.sequence_sharding import shard_sequence, unshard_sequence

from .harness import bench_layouts, label, layout_record

OURS = "2D (ours)"
SEND_FIRST = "2D send first"
"""Our rows with the transport's posting order of before issue 41 (``--send-first``)."""
RING_FLASH = "ring-flash-attn zigzag"
USP = "USP (yunchang)"
TORCH_CP = "torch CP"
PEERS = ("ring-flash-attn", "usp", "torch-cp", "te")
"""The names --peers takes (or 'all')."""
YUNCHANG_VERSION = "0.6.4"

Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Runner(abc.ABC):
    """One implementation, built on every rank. Inputs and outputs of ``to_native``/``from_native`` are this
    rank's zigzag shards in Megatron's sbhd layout; ``step`` (the timed part) works in the implementation's own."""

    bytes_source = "measured"

    def to_native(self, q, k, v, dout) -> tuple:
        """sbhd shards -> whatever ``step`` takes (not timed)."""
        return q, k, v, dout

    @abc.abstractmethod
    def step(self, q, k, v, dout) -> Tensors4:
        """Forward + backward; returns (out, dq, dk, dv) in the native layout."""

    def from_native(self, out, dq, dk, dv) -> Tensors4:
        """Native results -> sbhd shards (not timed)."""
        return out, dq, dk, dv

    def bytes_sent(self) -> dict[str, float]:
        """Bytes this rank sent in the last ``step``, by kind; the same keys on every rank ('a2a' and 'ring').
        Every runner that reaches the byte count overrides it (a runner whose step fails never asks)."""
        raise NotImplementedError(f"{type(self).__name__} does not report the bytes it sends")


@dataclass
class Impl:
    """A row of the comparison: ``build(rank, world, args)`` runs on every rank (collectively, in row order) and
    returns a :class:`Runner`; ``unavailable`` (decided before forking) puts an n/a row in instead."""

    name: str
    family: str
    build: Callable[[int, int, argparse.Namespace], Runner] | None = None
    unavailable: str = ""
    layout: dict[str, object] | None = None
    context: tuple[str, Callable[[], contextlib.AbstractContextManager]] | None = None
    """(key, factory) of a context the parent enters around the forked run, once per key (TE's CPU context)."""


def _leaves(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Fresh autograd leaves sharing the inputs' storage (no copy inside the timed region)."""
    return [x.detach().requires_grad_(True) for x in xs]


class Ours2D(Runner):
    """megatron_2d.attention_2d with one 2D layout (over all ranks); dK/dV riders in ``dkv_comm_dtype``;
    ``send_first``: with the transport's posting order of before issue 41 (:mod:`megatron_2d_dev.bench.send_first`)."""

    def __init__(
        self,
        layout: Layout2D,
        timeout: datetime.timedelta,
        send_first: bool = False,
        dkv_comm_dtype: str = "accumulator",
    ):
        self.groups = build_groups_for_layout(layout, [list(range(dist.get_world_size()))], timeout=timeout)
        self.dkv_comm_dtype = dkv_comm_dtype
        self.order = contextlib.nullcontext
        if send_first:
            from .send_first import send_first as order

            self.order = order

    def step(self, q, k, v, dout):
        self.groups.comm_bytes.reset()
        q, k, v = _leaves(q, k, v)
        with self.order():
            out = attention_2d(q, k, v, self.groups, causal=True, dkv_comm_dtype=self.dkv_comm_dtype)
            out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def bytes_sent(self):
        sent = self.groups.comm_bytes.as_dict()
        return {
            "a2a": sent["all_to_all"],
            "ring": sent["inner_ring"] + sent["outer_ring"],
            "inner_ring": sent["inner_ring"],
            "outer_ring": sent["outer_ring"],
        }


def ring_flash_bytes(kv_elements: int, cp: int, element_size: int) -> int:
    """ring-flash-attn zigzag's bytes per rank per fwd+bwd (see the module docstring): K and V (cp-1) times in
    each direction in the input dtype, dK and dV cp times in fp32."""
    return 2 * kv_elements * ((cp - 1) * 2 * element_size + cp * 4)


def count_ring_comm_sends(module) -> dict[str, int]:
    """Give a ring module of ring-flash-attn (our private copy) or of yunchang (whose RingComm is ring-flash-attn's)
    a RingComm that counts the bytes it sends and, in a ring of one rank, hands a tensor to itself by a local copy
    (the backward sends dK/dV one hop home; gloo cannot send to itself). Idempotent; returns the counter."""
    base = module.RingComm
    if hasattr(base, "_bench_sent"):
        return base._bench_sent
    counter = {"bytes": 0}

    class BenchRingComm(base):
        _bench_sent = counter

        def send_recv(self, to_send, recv_tensor=None):
            if self.world_size > 1:
                counter["bytes"] += to_send.numel() * to_send.element_size()
                return super().send_recv(to_send, recv_tensor)
            res = torch.empty_like(to_send) if recv_tensor is None else recv_tensor
            self._ops.append((to_send, res))
            return res

        def commit(self):
            if self.world_size > 1:
                return super().commit()
            for to_send, res in self._ops:
                res.copy_(to_send)  # what the send would deliver, read when the send would start

        def wait(self):
            if self.world_size > 1:
                return super().wait()
            self._ops = []

    module.RingComm = BenchRingComm
    return counter


class RingFlashZigzag(Runner):
    """ring-flash-attn's zigzag ring over the default group; bshd inputs ([b, s_local, h, d], same zigzag shards)."""

    bytes_source = "closed form"

    def __init__(self, module):
        self.func = module.zigzag_ring_flash_attn_func
        self.counter = count_ring_comm_sends(module)
        self.world = dist.get_world_size()
        self.kv_shape: tuple[int, ...] = ()
        self.element_size = 0

    def to_native(self, q, k, v, dout):
        return tuple(x.transpose(0, 1).contiguous() for x in (q, k, v, dout))  # [s, b, h, d] -> [b, s, h, d]

    def step(self, q, k, v, dout):
        self.counter["bytes"] = 0
        self.kv_shape, self.element_size = tuple(k.shape), k.element_size()
        q, k, v = _leaves(q, k, v)
        out = self.func(q, k, v, causal=True, group=None)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        return tuple(x.transpose(0, 1) for x in (out, dq, dk, dv))  # [b, s, h, d] -> [s, b, h, d]

    def bytes_sent(self):
        formula = ring_flash_bytes(math.prod(self.kv_shape), self.world, self.element_size)
        return {"a2a": 0, "ring": formula, "ring_counted": self.counter["bytes"]}


def te_bytes(
    kind: str, q_elements: int, kv_elements: int, element_size: int, world: int, a2a_size: int
) -> dict[str, float]:
    """TE's bytes per rank per fwd+bwd for ``kind`` p2p / a2a / a2a+p2p / all_gather (closed forms of the module
    docstring; all_gather's K/V gather and dK/dV reduce-scatter under "ring", the CP level)."""
    if kind == "all_gather":  # K, V gathered in forward and again in backward; dK, dV reduce-scattered
        return {"a2a": 0, "ring": 2 * kv_elements * element_size * 3 * (world - 1)}
    a = {"p2p": 1, "a2a": world, "a2a+p2p": a2a_size}[kind]
    ring = world // a
    a2a = 2 * (2 * q_elements + 2 * kv_elements) * element_size * (a - 1) / a
    return {"a2a": a2a, "ring": 2 * kv_elements * element_size * 3 * (ring - 1)}


_COUNTED = {  # torch.distributed function -> (counter key, bytes one rank sends, from its input's bytes and n ranks)
    "isend": ("p2p", lambda nbytes, n: nbytes),
    "all_to_all_single": ("a2a", lambda nbytes, n: nbytes * (n - 1) / n),
    "all_gather_into_tensor": ("all_gather", lambda nbytes, n: nbytes * (n - 1)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda nbytes, n: nbytes * (n - 1) / n),
}
_ARGS = {
    "isend": (0, 2),
    "all_to_all_single": (1, 4),
    "all_gather_into_tensor": (1, 2),
    "reduce_scatter_tensor": (1, 3),
}
"""Positions of (input tensor, group) in each function's signature."""


@contextlib.contextmanager
def count_collective_sends(counter: dict[str, float]) -> Iterator[None]:
    """Inside: the bytes this rank sends through torch.distributed's isend, all_to_all_single,
    all_gather_into_tensor and reduce_scatter_tensor are added to ``counter`` (:data:`_COUNTED`'s keys; a
    collective's as a ring algorithm sends them: (n-1)/n of its input, (n-1) inputs for an all-gather), each call
    once (a torch function mode that passes the call on re-enters it). For runners whose code calls
    torch.distributed by attribute (TE's context_parallel.py)."""
    c10d = dist.distributed_c10d
    saved = {name: getattr(dist, name) for name in _COUNTED}
    saved_c10d_isend = c10d.isend
    depth = [0]

    def counting(name: str):
        key, sent = _COUNTED[name]
        original = saved[name]

        def call(*args, **kwargs):
            if depth[0] == 0:
                at, group_at = _ARGS[name]
                tensor = args[at] if len(args) > at else kwargs.get("tensor", kwargs.get("input"))
                group = args[group_at] if len(args) > group_at else kwargs.get("group")
                nbytes = tensor.numel() * tensor.element_size()
                counter[key] = counter.get(key, 0) + sent(nbytes, dist.get_world_size(group))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        call.__name__ = call.__qualname__ = name
        return call

    try:
        for name in _COUNTED:
            setattr(dist, name, counting(name))
        c10d.isend = dist.isend  # P2POp accepts only distributed_c10d's own isend
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        c10d.isend = saved_c10d_isend


class TEContextParallel(Runner):
    """Transformer Engine's DotProductAttention with context parallelism ``kind`` over all ranks, set up as
    megatron-core's TEDotProductAttention sets it up. On CUDA the installed TE; on CPU ranks the release of TE's CPU
    context that the parent entered (megatron_2d_dev.te_context_parallel), whose fused attention is the CPU
    stand-in's (the cpu_flash kernel, as our rows run), and whose sends are counted beside the closed forms."""

    bytes_source = "closed form"

    def __init__(self, kind: str, a2a_size: int, args, world: int, timeout: datetime.timedelta):
        import transformer_engine.pytorch as te  # lazy: GPU-only dependency (on CPU: the context's release)

        self.kind, self.a2a_size, self.world = kind, a2a_size, world
        self.claim, self.counted = contextlib.nullcontext, None
        if args.device == "cpu":
            from megatron_2d_dev.te_context_parallel import active

            context = active()
            if context is None:
                raise RuntimeError(
                    "TE rows on CPU ranks run inside te_context_parallel_on_cpu (bench_compare enters it)"
                )
            self.claim, self.counted = context.claiming, {}
        ranks = list(range(world))
        if kind == "a2a+p2p":
            # Megatron's hierarchical CP groups: the a2a level on adjacent ranks, the p2p level A apart. Every rank
            # creates every group (new_group is collective), keeping its own.
            a2a_groups = [ranks[i : i + a2a_size] for i in range(0, world, a2a_size)]
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
        with self.claim():  # TE's base module asserts a CUDA device in __init__
            self.attn = te.DotProductAttention(
                num_attention_heads=args.heads,
                kv_channels=args.dim,
                num_gqa_groups=args.kv_heads,
                attention_dropout=0.0,
                qkv_format="sbhd",
                attn_mask_type="causal",
            )
        self.attn.set_context_parallel_group(cp_group, ranks, torch.cuda.Stream(), kind)
        self.q_elements = self.kv_elements = self.element_size = 0

    def to_native(self, q, k, v, dout):
        s, b, h, d = dout.shape
        return q, k, v, dout.reshape(s, b, h * d)  # TE returns [s, b, h*d]

    def step(self, q, k, v, dout):
        self.q_elements, self.kv_elements, self.element_size = q.numel(), k.numel(), k.element_size()
        q, k, v = _leaves(q, k, v)
        counting = contextlib.nullcontext() if self.counted is None else count_collective_sends(self.counted)
        if self.counted is not None:
            self.counted.clear()
        with counting:
            with self.claim():  # TE checks q, k, v are CUDA tensors in forward (on CPU: claimed to those checks)
                out = self.attn(q, k, v)
            out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        return out.view(dq.shape), dq, dk, dv

    def bytes_sent(self):
        sent = te_bytes(self.kind, self.q_elements, self.kv_elements, self.element_size, self.world, self.a2a_size)
        if self.counted is not None:  # what TE's code sent, by the same split: head all-to-all vs the CP level
            c = self.counted
            sent["a2a_counted"] = c.get("a2a", 0)
            sent["ring_counted"] = c.get("p2p", 0) + c.get("all_gather", 0) + c.get("reduce_scatter", 0)
        return sent


def full_from_zigzag(x: torch.Tensor) -> torch.Tensor:
    """This rank's zigzag shard [s, b, h, d] -> the full [S, b, h, d] (all-gather over the default group; the
    peers' input resharding, not timed)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return unshard_sequence(parts)


def full_from_positions(x: torch.Tensor, positions: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Every rank's ``x`` holds the tokens at ``positions`` (1-D, this rank's) along ``seq_dim``: the full tensor
    (all-gather over the default group, not timed)."""
    world = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    where = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(where, positions.contiguous())
    shape = list(x.shape)
    shape[seq_dim] *= world
    full = x.new_empty(shape)
    full.index_copy_(seq_dim, torch.cat(where), torch.cat(parts, dim=seq_dim))
    return full


# -- USP: yunchang's LongContextAttention --------------------------------------------------------------------------


def usp_bytes(q_elements: int, kv_elements: int, element_size: int, ulysses: int, ring: int) -> dict[str, float]:
    """yunchang USP's bytes per rank per fwd+bwd (closed forms of the module docstring); ``kv_elements``: K as
    LongContextAttention is given it (after the caller's repeat, if any)."""
    a2a = 2 * (2 * q_elements + 2 * kv_elements) * element_size * (ulysses - 1) / ulysses
    return {"a2a": a2a, "ring": ring_flash_bytes(kv_elements, ring, element_size) if ring > 1 else 0}


def load_yunchang(device: str):
    """Import yunchang (the pip package): on CPU with the flash_attn stand-in installed as flash-attn 2.7 (yunchang
    picks its call convention by ``flash_attn.__version__``); raises ImportError naming the problem."""
    from megatron_2d_dev.flash_attn_cpu import FLASH_ATTN_2_7_VERSION, flash_attn_stand_in

    if "yunchang" not in sys.modules and device == "cpu":
        with flash_attn_stand_in(version=FLASH_ATTN_2_7_VERSION):
            import yunchang
    else:
        import yunchang
    from yunchang.kernels import attention

    if not attention.HAS_FLASH_ATTN:
        raise ImportError("yunchang was imported without flash_attn (import it through runners.load_yunchang)")
    if attention.flash_attn.__version__ < "2.6.3":
        raise ImportError(f"yunchang sees flash_attn {attention.flash_attn.__version__} < 2.6.3 (the old API)")
    return yunchang


class YunchangUSP(Runner):
    """yunchang's LongContextAttention (Ulysses x zigzag ring) over its own process groups (set_seq_parallel_pg),
    inputs sharded by its zigzag_extract_local ([b, s_local, h, d]); ``kv_repeat`` > 1: the caller repeats each K/V
    head that many times first (inside the timed step)."""

    bytes_source = "closed form"

    def __init__(self, module, ulysses: int, ring: int, kv_repeat: int = 1):
        import yunchang.ring.zigzag_ring_flash_attn as zigzag
        from yunchang.globals import PROCESS_GROUP

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ulysses, self.ring, self.kv_repeat = ulysses, ring, kv_repeat
        module.set_seq_parallel_pg(ulysses, ring, self.rank, self.world)
        self.groups = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
        self.attn = module.LongContextAttention(ring_impl_type="zigzag")
        self.extract = module.EXTRACT_FUNC_DICT["zigzag"]
        self.counter = count_ring_comm_sends(zigzag)
        self.positions = torch.empty(0)
        self.sizes = (0, 0, 0)
        self.counted = 0

    def _set_groups(self) -> None:
        from yunchang.globals import PROCESS_GROUP

        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = self.groups  # what zigzag_extract_local reads

    def to_native(self, q, k, v, dout):
        self._set_groups()
        full = [full_from_zigzag(x).transpose(0, 1) for x in (q, k, v, dout)]  # [S, b, h, d] -> [b, S, h, d]
        seq = full[0].shape[1]
        self.positions = self.extract(torch.arange(seq).unsqueeze(0), self.rank, self.world, self.ring, self.ulysses)[0]
        return tuple(self.extract(x, self.rank, self.world, self.ring, self.ulysses) for x in full)

    def step(self, q, k, v, dout):
        self.counter["bytes"] = 0
        q, k, v = _leaves(q, k, v)
        k_in, v_in = (x.repeat_interleave(self.kv_repeat, dim=2) if self.kv_repeat > 1 else x for x in (k, v))
        self.sizes = (q.numel(), k_in.numel(), k.element_size())
        out = self.attn(q, k_in, v_in, causal=True)
        out.backward(dout)
        self.counted = self.counter["bytes"]  # the counter is shared by every USP row
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        rank, world = self.rank, self.world
        return tuple(  # [b, s_local, h, d] in yunchang's order -> full [b, S, h, d] -> our zigzag [s, b, h, d]
            shard_sequence(full_from_positions(x, self.positions, 1).transpose(0, 1), rank, world)
            for x in (out, dq, dk, dv)
        )

    def bytes_sent(self):
        q_elements, kv_elements, element_size = self.sizes
        sent = usp_bytes(q_elements, kv_elements, element_size, self.ulysses, self.ring)
        return {**sent, "ring_counted": self.counted}


# -- PyTorch's context parallelism ------------------------------------------------------------------------------


def torch_cp_bytes(kv_elements: int, world: int, element_size: int) -> dict[str, float]:
    """torch CP's bytes per rank per fwd+bwd, either rotation (closed form of the module docstring)."""
    return {"a2a": 0, "ring": ring_flash_bytes(kv_elements, world, element_size)}


class _SDPA(torch.nn.Module):
    """The attention module torch CP wraps: causal SDPA, [b, h, s, d], GQA by SDPA's enable_gqa."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class TorchContextParallel(Runner):
    """PyTorch's context parallelism as torchtitan wires it: ``_ContextParallel`` (SDPA) applied to the attention
    module by parallelize_module over a 1-D mesh of all ranks, inputs sharded by ``_context_parallel_shard`` with
    the head-tail load balancer, torch's CP dispatcher enabled; K/V rotation ``rotate`` ('allgather' or
    'alltoall', set_rotate_method). On CPU the SDPA op runs torch's templated ring through
    :mod:`megatron_2d_dev.bench.torch_cp_cpu`."""

    bytes_source = "closed form"

    def __init__(self, rotate: str, args, world: int, device: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
        from torch.distributed.tensor.parallel import parallelize_module

        if device == "cpu":
            from .torch_cp_cpu import enable_in_this_process

            enable_in_this_process()
        else:
            cp._enable_context_parallel_dispatcher()
        self.cp, self.rotate, self.rank, self.world = cp, rotate, dist.get_rank(), world
        self.mesh = init_device_mesh(device, (world,))
        self.module = parallelize_module(
            _SDPA(), self.mesh, cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.SDPA)
        )
        self.balancer = _HeadTailLoadBalancer(args.seq, world, device)
        self.sizes = (0, 0)

    def to_native(self, q, k, v, dout):
        full = [full_from_zigzag(x).permute(1, 2, 0, 3).contiguous() for x in (q, k, v, dout)]  # -> [b, h, S, d]
        return tuple(self.cp._context_parallel_shard(self.mesh, full, [2] * 4, load_balancer=self.balancer))

    def step(self, q, k, v, dout):
        self.cp.set_rotate_method(self.rotate)  # torch's options are global: set them for this row
        self.cp._cp_options.enable_load_balance = True
        self.sizes = (k.numel(), k.element_size())
        q, k, v = _leaves(q, k, v)
        out = self.module(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def from_native(self, out, dq, dk, dv):
        full = self.cp.context_parallel_unshard(self.mesh, [out, dq, dk, dv], [2] * 4, load_balancer=self.balancer)
        return tuple(shard_sequence(x.permute(2, 0, 1, 3), self.rank, self.world) for x in full)  # -> [s, b, h, d]

    def bytes_sent(self):
        kv_elements, element_size = self.sizes
        return torch_cp_bytes(kv_elements, self.world, element_size)


def ours_impls(args) -> list[Impl]:
    """One row per 2D layout of CP = N whose hp divides the query heads, per dK/dV rider dtype of
    ``args.dkv_comm_dtype`` ("accumulator", "input" or "both"; rows with "input" are named "... dK/dV in <dtype>");
    with ``args.send_first`` each fp32-rider row again with the posting order of before issue 41 (family
    :data:`SEND_FIRST`)."""
    timeout = datetime.timedelta(seconds=args.timeout)
    which = getattr(args, "dkv_comm_dtype", "accumulator")
    kinds = ["accumulator", "input"] if which == "both" else [which]
    orders = (False, True) if getattr(args, "send_first", False) else (False,)
    return [
        Impl(
            label(layout)
            + (f"  dK/dV in {args.dtype}" if kind == "input" else "")
            + (" (send first)" if first else ""),
            SEND_FIRST if first else OURS,
            build=lambda rank, world, a, lay=layout, first=first, kind=kind: Ours2D(lay, timeout, first, kind),
            layout={**layout_record(layout), "dkv": kind},
        )
        for kind in kinds
        for layout in bench_layouts(args.ranks, args.heads)
        for first in orders
        if not (first and kind == "input")
    ]


def ring_flash_impl(args) -> Impl:
    """ring-flash-attn's zigzag ring: on CPU through the flash_attn stand-in, on GPU only with the real flash_attn.

    The module is loaded here, in the parent, so a missing package gives one clear n/a row; forked ranks inherit it.
    """
    from megatron_2d_dev.flash_attn_cpu import flash_attn_stand_in, load_ring_flash_attn_module

    try:
        if args.device == "cpu":
            with flash_attn_stand_in():
                module = load_ring_flash_attn_module("zigzag_ring_flash_attn")
        else:
            module = load_ring_flash_attn_module("zigzag_ring_flash_attn")  # needs the real flash_attn
    except ImportError as err:
        return Impl(RING_FLASH, RING_FLASH, unavailable=f"ring-flash-attn does not import: {err}")
    return Impl(RING_FLASH, RING_FLASH, build=lambda rank, world, a: RingFlashZigzag(module))


TE_RELEASE = "2.20.2"
"""The Transformer Engine release of the TE rows on CPU ranks (--te-release)."""


def te_impls(args) -> list[Impl]:
    """TE p2p, a2a, every a2a+p2p [A, N/A] with both levels > 1 ([1, N] and [N, 1] are TE's p2p and a2a), and
    all_gather (TE does not replicate K/V: the a2a level must divide hq and hkv). On CPU ranks: TE ``args.te_release``
    in its CPU context, which the parent enters around the forked run (``Impl.context``)."""
    timeout = datetime.timedelta(seconds=args.timeout)
    n = args.ranks
    context = None
    if args.device == "cpu":
        from megatron_2d_dev import te_package
        from megatron_2d_dev.te_context_parallel import te_context_parallel_on_cpu

        release = getattr(args, "te_release", TE_RELEASE)
        if not te_package.is_installed(release):
            where = f"{te_package.releases_dir()} (python -m megatron_2d_dev.te_package install)"
            return [
                Impl(f"TE {release}", "TE", unavailable=f"Transformer Engine {release} is not installed under {where}")
            ]
        # the CUDA claim only around TE's own forward: the mode's per-op cost stays off the other rows
        context = (f"TE {release}", lambda: te_context_parallel_on_cpu(release, claim_cuda=False))
    else:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as err:
            return [
                Impl(f"TE {kind}", f"TE {kind}", unavailable=f"transformer_engine does not import: {err}")
                for kind in ("p2p", "a2a", "a2a+p2p", "all_gather")
            ]

    def impl(kind: str, a2a_size: int, name: str) -> Impl:
        return Impl(
            name,
            f"TE {kind}",
            build=lambda rank, world, a: TEContextParallel(kind, a2a_size, a, world, timeout),
            context=context,
        )

    rows = [impl("p2p", 1, "TE p2p")]
    if args.heads % n or args.kv_heads % n:
        rows.append(
            Impl("TE a2a", "TE a2a", unavailable=f"a2a needs CP={n} to divide hq={args.heads} and hkv={args.kv_heads}")
        )
    else:
        rows.append(impl("a2a", n, "TE a2a"))
    sizes = [a for a in divisors(n)[1:-1] if args.heads % a == 0 and args.kv_heads % a == 0]
    rows += [impl("a2a+p2p", a, f"TE a2a+p2p [{a}, {n // a}]") for a in sizes]
    if not sizes:
        rows.append(Impl("TE a2a+p2p", "TE a2a+p2p", unavailable=f"no a2a size 1 < A < {n} divides hq and hkv"))
    rows.append(impl("all_gather", 1, "TE all_gather"))
    return rows


def usp_impls(args) -> list[Impl]:
    """One row per (Ulysses degree U, ring degree N/U) yunchang accepts (U divides hq and hkv; otherwise an n/a row
    with the reason), and, where hkv < N, Ulysses N with K/V repeated to N heads by the caller."""
    n, hq, hkv = args.ranks, args.heads, args.kv_heads
    try:
        module = load_yunchang(args.device)
    except ImportError as err:
        return [
            Impl(USP, USP, unavailable=f"yunchang does not import (pip install yunchang=={YUNCHANG_VERSION}): {err}")
        ]

    def impl(name: str, ulysses: int, kv_repeat: int = 1) -> Impl:
        return Impl(
            name,
            USP,
            build=lambda rank, world, a: YunchangUSP(module, ulysses, n // ulysses, kv_repeat),
            layout={"hp": ulysses, "cp": n // ulysses},
        )

    rows = []
    for u in divisors(n):
        name = f"USP ulysses{u} x ring{n // u}"
        if hq % u or hkv % u:
            reason = (
                f"yunchang's Ulysses all-to-all splits the heads over U={u} ranks: U must divide hq={hq} and "
                f"hkv={hkv} (its all_to_all_4D raises otherwise)"
            )
            rows.append(Impl(name, USP, unavailable=reason))
        else:
            rows.append(impl(name, u))
    if hkv < n and n % hkv == 0 and hq % n == 0:
        rows.append(impl(f"USP ulysses{n} x ring1, K/V repeated by the caller", n, kv_repeat=n // hkv))
    return rows


def torch_cp_impls(args) -> list[Impl]:
    """torch CP with its head-tail load balancer, one row per K/V rotation (all-gather, all-to-all)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: F401
    except ImportError as err:
        return [Impl(TORCH_CP, TORCH_CP, unavailable=f"torch {torch.__version__} has no context parallelism: {err}")]
    return [
        Impl(
            f"{TORCH_CP} {rotate}",
            TORCH_CP,
            build=lambda rank, world, a, r=rotate: TorchContextParallel(r, a, world, a.device),
        )
        for rotate in ("allgather", "alltoall")
    ]


def all_impls(args) -> list[Impl]:
    """Every row of one run: ours, then the peers ``args.peers`` names (see :data:`PEERS`)."""
    rows = ours_impls(args)
    peers = set(args.peers)
    if "ring-flash-attn" in peers:
        rows.append(ring_flash_impl(args))
    if "usp" in peers:
        rows += usp_impls(args)
    if "torch-cp" in peers:
        rows += torch_cp_impls(args)
    if "te" in peers:
        rows += te_impls(args)
    return rows
