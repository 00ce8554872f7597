"""Generated exactness cases for ``attention_2d``: one seeded generator, one fp64 per-document oracle.

A *batch* fixes what every rank must agree on before any tensor moves: the world size and the 2D layout (hp, w,
placement, and the CP group's rank order, ``cp_rank_lists``, not always ascending). Its *draws* then vary everything
else: unpacked (sbhd, one document per batch row) or packed in each of :data:`megatron_2d.layout.choices.PACKING_MODES`,
value head dims below the query/key dim (MLA), document lengths (one-token documents, lengths that divide nothing,
one giant document among tiny ones, hundreds of tiny ones, padding at the end of the stream), GQA ratios with K/V
replication, causal or full attention, sliding windows, sinks, batch size, kernel, dK/dV dtype and whether the op
also returns the max logit (QK-clip: checked against a brute-force fp64 max over the allowed pairs, on every rank,
forward only; out and the gradients of such a draw are checked as any other's). The kernels are
the CPU ones in fp32, and the CUDA ones in bf16 through their CPU stand-ins: ``flash_attn2`` through a real
flash-attn release (one per batch, :mod:`megatron_2d_dev.flash_attn_package`), ``torch_flash`` through
PyTorch's flash ops on CPU (:mod:`megatron_2d_dev.torch_flash_cpu`), both of which run windows as flash-attn's
C++ does, and ``torch_cudnn`` through PyTorch's cuDNN ops on CPU (:mod:`megatron_2d_dev.torch_cudnn_cpu`); a
draw's CUDA kernel rotates with its index, so each reaches every kind of plan. Every draw is checked against
:func:`megatron_2d.testing.reference.packed_reference_attention` in fp64 (a plain sequence is one document): out,
dq, dk, dv and d sinks, with padding slots exactly zero and everything finite (padding slots of q, k, v hold
:data:`PADDING_VALUE`, not zeros, so that anything that reads them shows).

The bound is the tolerance of the draw's dtype (``TOLERANCES[dtype].end_to_end``, max |error| / max |reference|; a bf16
draw's inputs are bf16 numbers, so its bound covers the kernels' and the outputs' rounding), except where an fp32 draw
is so ill-conditioned that plain fp32 attention on one process (the same oracle run in fp32) misses it: tiny problems
whose gradients cancel (a 2-token document's dq, d sinks summed over a few tokens) are off by ~1e-5 in fp32 whatever
computes them. There an output may be at most :data:`FP32_FLOOR_FACTOR` times as far off as that single-process fp32
result; a real bug (a missed block, a wrong merge) is off by orders of magnitude more.

d sinks is measured otherwise (:func:`megatron_2d.testing.reference.sink_err`): each head's gradient is one sum over
every query row of signed terms that nearly cancel, so its error is taken against the sum of the terms' magnitudes
(the scale its rounding has) and bounded by ``TOLERANCES[dtype].dsinks``, the fp32 floor applying to it alike.

Each batch and draw is a pure function of its seed, so every rank builds the same draws and a failure replays
from ``(batch seed, draw index)`` alone:

    python tools/fuzz_attention.py --replay 1234:5

Inside the ranks every ``torch.empty``-like allocation made from Python is filled with NaN
(:class:`PoisonedEmpty`), so a read of memory nobody wrote shows up as NaN on every run, instead of as whatever
the allocator happened to hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch._dynamo  # noqa: F401  a dispatch mode imports it on first use: once here, not in every forked rank
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_2d.layout.choices import DkvCommDtype, Kernel, PackingMode
from megatron_2d.layout.topology import PLACEMENTS, divisors
from megatron_2d.testing.distributed import GROUP_TIMEOUT
from megatron_2d.testing.reference import (
    TOLERANCES,
    max_logit_reference,
    packed_reference_attention,
    rel_err,
    rounded,
    sink_err,
    sink_terms,
)

from .flash_attn_package import RELEASES

_ATEN = torch.ops.aten
_EMPTY_OPS = (
    _ATEN.empty.memory_format,
    _ATEN.empty_like.default,
    _ATEN.new_empty.default,
    _ATEN.empty_strided.default,
    _ATEN.new_empty_strided.default,
)


class PoisonedEmpty(TorchDispatchMode):
    """Fill every floating-point tensor that an empty-like op returns with NaN (allocations made from Python and
    from composite ops; a compiled kernel's internal buffers are out of its reach)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless told not to: nothing here is
        # compiled, and that wrapper cost more than the op itself on most of a draw's ~15000 dispatches
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY_OPS and out.is_floating_point():
            out.fill_(float("nan"))
        return out


@dataclass(frozen=True)
class Batch:
    """What every rank of one fork agrees on: the world and its 2D layout."""

    seed: int
    world: int
    hp: int
    w: int
    placement: str
    rank_order: tuple[int, ...]  # the CP group's global ranks by CP rank (cp_rank_lists; not always ascending)
    flash_attn: str  # the flash-attn release its flash_attn2 draws run through (one release per process)

    @property
    def cp(self) -> int:
        return self.world // self.hp


@dataclass(frozen=True)
class Draw:
    """One case on a batch's layout. ``mode`` None: the unpacked sbhd op, ``lengths`` = (S,) per batch row."""

    batch_seed: int
    index: int
    mode: str | None
    lengths: tuple[int, ...]
    end_padding: int  # zigzag: extra padded slots after the last document (Megatron's padded stream)
    batch: int
    hq: int
    hkv: int
    d: int  # query/key head dim
    dv: int  # value head dim (MLA: smaller than d)
    causal: bool
    window: tuple[int, int]
    sinks: bool
    kernel: str
    dkv_comm_dtype: str
    dtype: str = "float32"  # "bfloat16" for the CUDA kernels (FLASH_KERNELS), which take fp16/bf16 only
    max_logit: bool = False  # return_max_logit (drawn from a stream of its own: the other fields stay as they were)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        fields = asdict(self)
        lengths = fields.pop("lengths")
        shown = lengths if len(lengths) <= 12 else f"{list(lengths[:12])}... ({len(lengths)} documents)"
        return ", ".join(f"{k}={v}" for k, v in fields.items()) + f", lengths={shown}"


def layouts(max_world: int = 8) -> list[tuple[int, int, int, str]]:
    """Every (world, hp, w, placement) up to ``max_world``: hp | world, w | cp."""
    return [
        (world, hp, w, placement)
        for world in range(1, max_world + 1)
        for hp in divisors(world)
        for w in divisors(world // hp)
        for placement in PLACEMENTS
    ]


def draw_batch(seed: int, max_world: int = 8) -> Batch:
    """The layout of batch ``seed``: uniform over :func:`layouts` (so larger worlds, with more layouts, come up
    more often), and one batch in five a 2D layout with a double ring (hp > 1, 1 < w < cp), the rarest kind."""
    rng = np.random.default_rng([seed, 0])
    every = layouts(max_world)
    double_ring_2d = [x for x in every if x[1] > 1 and 1 < x[2] < x[0] // x[1]]
    pool = double_ring_2d if double_ring_2d and rng.random() < 0.2 else every
    world, hp, w, placement = pool[int(rng.integers(len(pool)))]
    order = tuple(int(r) for r in rng.permutation(world)) if rng.random() < 0.25 else tuple(range(world))
    return Batch(seed, world, hp, w, placement, order, str(rng.choice(RELEASES)))


def _document_lengths(rng: np.random.Generator) -> list[int]:
    """Lengths from one of the mixes that hand-picked tests miss."""
    mix = rng.choice(["ones", "small", "giant", "tiny_many", "awkward", "single", "lognormal"])
    if mix == "ones":  # mostly one-token documents (trailing EODs, empty turns) and a few longer ones
        lengths = [1] * int(rng.integers(1, 60)) + rng.integers(2, 20, size=int(rng.integers(0, 4))).tolist()
    elif mix == "small":
        lengths = rng.integers(1, 24, size=int(rng.integers(1, 30))).tolist()
    elif mix == "giant":  # one document longer than all the others together
        lengths = rng.integers(1, 6, size=int(rng.integers(0, 12))).tolist() + [int(rng.integers(80, 400))]
    elif mix == "tiny_many":  # hundreds of one- to three-token documents
        lengths = rng.integers(1, 4, size=int(rng.integers(100, 300))).tolist()
    elif mix == "awkward":  # primes: divisible by nothing the layout uses
        lengths = rng.choice(
            [1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 97], size=int(rng.integers(1, 14))
        ).tolist()
    elif mix == "single":
        lengths = [int(rng.integers(1, 300))]
    else:
        lengths = np.maximum(1, rng.lognormal(2.5, 1.2, size=int(rng.integers(2, 30))).astype(int)).tolist()
    order = rng.permutation(len(lengths))
    return [int(lengths[i]) for i in order]


def _window(rng: np.random.Generator, causal: bool, longest: int) -> tuple[int, int]:
    """No window, or one from a single key to wider than the longest document."""
    if rng.random() < 0.4:
        return (-1, -1)
    reach = lambda: int(rng.choice([0, 1, 2, 3, max(1, longest // 4), max(1, longest // 2), longest + 5]))  # noqa
    if causal:
        return (max(1, reach()), 0)
    left, right = reach(), reach()
    unbounded = rng.integers(0, 3)  # 0: both bounded, 1: left unbounded, 2: right unbounded
    return (-1 if unbounded == 1 else left, -1 if unbounded == 2 else right)


FLASH_KERNELS = (Kernel.FLASH_ATTN2, Kernel.TORCH_FLASH, Kernel.TORCH_CUDNN)
"""The CUDA kernels, drawn in bf16 through their CPU stand-ins (see the module). te_fused is not drawn: its CPU
stand-in needs a Transformer Engine release imported into the process (tests/test_te_releases.py runs it)."""
FLASH_SHARE = 0.3
"""The share of draws that run a CUDA kernel (drawn from a stream of their own, so the other draws stay as
they were). Of their packed draws, :data:`FLASH_NON_CAUSAL` turn non-causal with a window of their own: the
calls on blocks of more queries than keys, whose windows flash-attn's C++ would change."""
FLASH_NON_CAUSAL = 0.4
MAX_LOGIT_SHARE = 0.5
"""The share of draws that ask the op for the max logit too."""


def draw_case(batch: Batch, index: int, modes: Sequence[str]) -> Draw:
    """Draw ``index`` of ``batch``: a pure function of (batch.seed, index)."""
    rng = np.random.default_rng([batch.seed, 1, index])
    mode = None if rng.random() < 0.3 else str(rng.choice(list(modes)))
    hq = batch.hp * int(rng.choice([1, 2]))
    hkv = int(rng.choice(divisors(hq)))  # hkv < hp replicates K/V heads
    causal = bool(rng.random() < 0.7)
    if mode is None:
        chunk = int(rng.integers(1, 10))
        lengths = (2 * batch.world * chunk,)
        batch_size = int(rng.choice([1, 2]))
        end_padding = 0
    else:
        lengths = tuple(_document_lengths(rng))
        if mode == PackingMode.SEQUENCE:  # Megatron's per-sequence split: 2*CP divides the stream
            lengths += ((-sum(lengths)) % (2 * batch.world),) if sum(lengths) % (2 * batch.world) else ()
        batch_size = 1
        end_padding = (
            2 * batch.world * int(rng.integers(1, 3)) if mode == PackingMode.ZIGZAG and rng.random() < 0.3 else 0
        )
    d = int(rng.choice([8, 16]))
    dv = d // 2 if rng.random() < 0.25 else d
    draw = Draw(
        batch.seed,
        index,
        mode,
        lengths,
        end_padding,
        batch_size,
        hq,
        hkv,
        d,
        dv,
        causal,
        _window(rng, causal, max(lengths)),
        bool(rng.random() < 0.3),
        Kernel.TORCH_MATH if rng.random() < 0.15 else Kernel.CPU_FLASH,
        DkvCommDtype.INPUT if rng.random() < 0.2 else DkvCommDtype.ACCUMULATOR,
    )
    draw = replace(draw, max_logit=bool(np.random.default_rng([batch.seed, 3, index]).random() < MAX_LOGIT_SHARE))
    flash = np.random.default_rng([batch.seed, 2, index])
    if flash.random() >= FLASH_SHARE:
        return draw
    draw = replace(draw, kernel=FLASH_KERNELS[(batch.seed + index) % len(FLASH_KERNELS)], dtype="bfloat16")
    if mode is not None and flash.random() < FLASH_NON_CAUSAL:
        draw = replace(draw, causal=False, window=_window(flash, False, max(lengths)))
    return draw


def _inputs(draw: Draw) -> tuple[torch.Tensor, ...]:
    """fp64 q [T, b, hq, d], k [T, b, hkv, d], v [T, b, hkv, dv], dout [T, b, hq, dv] rounded to the draw's
    dtype, sinks [hq] (or None) rounded to fp32."""
    g = torch.Generator().manual_seed(draw.batch_seed * 100_003 + draw.index)
    total = sum(draw.lengths)
    q, k, v, dout = (
        rounded(torch.randn(total, draw.batch, h, dim, generator=g, dtype=torch.float64), draw.torch_dtype)
        for h, dim in ((draw.hq, draw.d), (draw.hkv, draw.d), (draw.hkv, draw.dv), (draw.hq, draw.dv))
    )
    sinks = rounded(torch.randn(draw.hq, generator=g, dtype=torch.float64), torch.float32) if draw.sinks else None
    return q, k, v, dout, sinks


FP32_FLOOR_FACTOR = 4.0
"""How many times the single-process fp32 oracle's own error an output may reach, where that error exceeds the
fp32 tolerance (see the module)."""
FP32_FLOOR_CAP = 1e-3
"""No bound is looser than this, however ill-conditioned the draw: a draw plain fp32 cannot get within 2.5e-4 of
its fp64 answer fails rather than judging the op by a bound that would hide a bug."""

OUTPUTS = ("out", "dq", "dk", "dv", "dsinks")
PADDING_VALUE = 4.0
"""What the padding slots of q, k and v hold: a q . k of 16 d between two of them, above every real logit, so that a
max logit (or an output) that reached a padding slot shows."""


def _oracle(draw: Draw, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    """(out, dq, dk, dv, d sinks or None) of the per-document oracle in ``dtype``, every batch row on its own."""
    q, k, v, dout, sinks = (None if x is None else x.to(dtype) for x in _inputs(draw))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.clone().requires_grad_(True)
    cu = np.concatenate([[0], np.cumsum(draw.lengths)])
    out = torch.stack(
        [
            packed_reference_attention(
                *(x[:, i] for x in leaves), cu, draw.causal, draw.d**-0.5, window=draw.window, sinks=sink_leaf
            )
            for i in range(draw.batch)
        ],
        dim=1,
    )  # [T, b, hq, d]
    out.backward(dout)
    return (out.detach(), *(x.grad for x in leaves), None if sink_leaf is None else sink_leaf.grad)


def sink_scale(draw: Draw) -> torch.Tensor | None:
    """[hq]: the magnitudes of d sinks' per-row terms (:func:`draw_sink_terms`) summed, the scale its error is
    measured against (None without sinks)."""
    return draw_sink_terms(draw).abs().sum((0, 1)) if draw.sinks else None


def draw_sink_terms(draw: Draw) -> torch.Tensor:
    """[T, b, hq]: the fp64 per-row terms whose sum is d sinks, every batch row's adding up as its gradient does."""
    q, k, v, dout, sinks = _inputs(draw)
    cu = np.concatenate([[0], np.cumsum(draw.lengths)])
    return torch.stack(
        [
            sink_terms(*(x[:, i] for x in (q, k, v, dout)), sinks, cu, draw.causal, draw.d**-0.5, draw.window)
            for i in range(draw.batch)
        ],
        dim=1,
    )


def output_error(name: str, actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None) -> float:
    """An output's error: rel_err, except d sinks' sink_err against ``scale`` (:func:`sink_scale`)."""
    return sink_err(actual, expected, scale) if name == "dsinks" else rel_err(actual, expected)


def expected_max_logit(draw: Draw) -> torch.Tensor | None:
    """[hq]: the brute-force fp64 max logit over the draw's allowed pairs (its inputs rounded to its dtype), or None
    when the draw does not ask for it."""
    if not draw.max_logit:
        return None
    q, k, *_ = _inputs(draw)
    cu = np.concatenate([[0], np.cumsum(draw.lengths)])
    return max_logit_reference(q, k, cu, draw.causal, draw.d**-0.5, draw.window)


def expected_results(draw: Draw):
    """(out, dq, dk, dv, d sinks) of the per-document fp64 oracle, d sinks' scale (:func:`sink_scale`), the max
    logit (:func:`expected_max_logit`) and, last, each output's bound (a dict by :data:`OUTPUTS`, and "max_logit"):
    the dtype's tolerance (``dsinks``' and ``max_logit``'s own), or for fp32 :data:`FP32_FLOOR_FACTOR` times the
    fp32 oracle's own error where that is larger. Computed once, in the parent, before the ranks fork."""
    expected = _oracle(draw, torch.float64)
    scale = sink_scale(draw)
    max_logit = expected_max_logit(draw)
    logit_bound = {} if max_logit is None else {"max_logit": TOLERANCES[draw.torch_dtype].max_logit}
    tolerance = {name: TOLERANCES[draw.torch_dtype].end_to_end for name in OUTPUTS} | {
        "dsinks": TOLERANCES[draw.torch_dtype].dsinks
    }
    if draw.torch_dtype != torch.float32:
        bounds = {name: tolerance[name] for name, e in zip(OUTPUTS, expected) if e is not None}
        return (*expected, scale, max_logit, bounds | logit_bound)
    in_fp32 = _oracle(draw, torch.float32)
    bounds = {
        name: min(FP32_FLOOR_CAP, max(tolerance[name], FP32_FLOOR_FACTOR * output_error(name, got, want, scale)))
        for name, got, want in zip(OUTPUTS, in_fp32, expected)
        if want is not None
    }
    return (*expected, scale, max_logit, bounds | logit_bound)


def run_draw(draw: Draw, expected, groups, cp_rank: int, cp_size: int) -> dict[str, object]:
    """Run one draw on this rank: errors of its slots (max |error| / max |reference| of the whole tensor) against
    ``expected`` (from :func:`expected_results`), the padding and finiteness checks, and this rank's share of
    d sinks."""
    import megatron_2d

    q, k, v, dout, sinks = _inputs(draw)
    if draw.mode is None:

        def shard(x: torch.Tensor) -> torch.Tensor:
            return megatron_2d.shard_sequence(x, cp_rank, cp_size)

        pad = torch.zeros(q.shape[0] // cp_size, dtype=torch.bool)
        packing = None
    else:
        cu = np.concatenate([[0], np.cumsum(draw.lengths)])
        padded = None
        if draw.end_padding:
            padded = np.diff(cu)
            padded = -(-padded // (2 * cp_size)) * (2 * cp_size)
            padded[-1] += draw.end_padding
            padded = np.concatenate([[0], np.cumsum(padded)])
        packing = megatron_2d.PackedSharding(torch.from_numpy(cu), groups, mode=draw.mode, cu_seqlens_padded=padded)

        def shard(x: torch.Tensor) -> torch.Tensor:  # [T, 1, h, d] -> [t_local, h, d]
            return packing.shard(x[:, 0])

        pad = packing.local_indices() < 0
    local = [shard(x).to(draw.torch_dtype) for x in (q, k, v)]
    for x in local:  # padding holds whatever its tokens carry (Megatron's pad tokens): here values no pair may see
        x[pad] = PADDING_VALUE
    local = [x.requires_grad_(True) for x in local]
    local_sinks = None if sinks is None else sinks.float().requires_grad_(True)
    with PoisonedEmpty():
        out = megatron_2d.attention_2d(
            *local,
            groups,
            causal=draw.causal,
            sliding_window=draw.window,
            sinks=local_sinks,
            kernel=draw.kernel,
            dkv_comm_dtype=draw.dkv_comm_dtype,
            packing=packing,
            return_max_logit=draw.max_logit,
        )
        out, max_logit = out if draw.max_logit else (out, None)
        out.backward(shard(dout).to(draw.torch_dtype))
    actual = (out.detach(), *(x.grad for x in local))
    result: dict[str, object] = {}
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        scale = e.abs().max().item()
        result[name] = (a.double() - shard(e)).abs().max().item() / (scale if scale > 0 else 1.0)
    result["finite"] = all(bool(torch.isfinite(a).all()) for a in actual)
    result["padding_zero"] = all(bool((a[pad] == 0).all()) for a in actual)
    result["dsinks"] = None if local_sinks is None else local_sinks.grad.double()
    result["dsinks_expected"], result["dsinks_scale"] = expected[4], expected[5]
    result["max_logit"] = None if max_logit is None else max_logit.double()
    return result


def cuda_kernels_on_cpu(batch: Batch, draws: Sequence[Draw]) -> contextlib.ExitStack:
    """The CPU stand-ins the draws' CUDA kernels need, entered: the batch's flash-attn release (imported once into
    this process) for flash_attn2, PyTorch's flash ops on CPU for torch_flash, its cuDNN ops for torch_cudnn."""
    from megatron_2d.kernels import FlashAttn2Kernel

    from . import flash_attn_package
    from .torch_cudnn_cpu import torch_cudnn_on_cpu
    from .torch_flash_cpu import kernel_on_cpu, torch_flash_on_cpu

    stack = contextlib.ExitStack()
    kernels = {d.kernel for d in draws}
    if "flash_attn2" in kernels:
        flash_attn_package.load_release(batch.flash_attn)
        stack.enter_context(kernel_on_cpu(FlashAttn2Kernel))
    if "torch_flash" in kernels:
        stack.enter_context(torch_flash_on_cpu())
    if "torch_cudnn" in kernels:
        stack.enter_context(torch_cudnn_on_cpu())
    return stack


def run_batch(rank: int, world: int, batch: Batch, draws: Sequence[Draw], expected: Sequence[tuple]):
    """On every rank of a fork: build the batch's groups once, then run its draws."""
    import megatron_2d

    groups = megatron_2d.build_2d_groups(
        batch.hp, batch.w, batch.placement, cp_rank_lists=[batch.rank_order], timeout=GROUP_TIMEOUT
    )
    cp_rank = batch.rank_order.index(rank)
    with cuda_kernels_on_cpu(batch, draws):
        return [run_draw(draw, e, groups, cp_rank, world) for draw, e in zip(draws, expected)]


def failures(
    batch: Batch,
    draws: Sequence[Draw],
    per_rank: Sequence[Sequence[dict[str, object]]],
    bounds: Sequence[dict[str, float]],
    expected_logits: Sequence[torch.Tensor | None] = (),
) -> list[str]:
    """What went wrong in each draw of a batch (empty when every check held), with the replay command.
    ``bounds``: each draw's bound per output (the last item of :func:`expected_results`); ``expected_logits``: each
    draw's max logit (its item before; needed when a draw asks for it)."""
    found = []
    for j, draw in enumerate(draws):
        results, bound = [r[j] for r in per_rank], bounds[j]
        problems = [
            f"{name} error {max(r[name] for r in results):.2e} (bound {bound[name]:.2e})"
            for name in ("out", "dq", "dk", "dv")
            if not max(r[name] for r in results) < bound[name]
        ]
        if not all(r["finite"] for r in results):
            problems.append("non-finite values")
        if draw.max_logit:
            got = [r["max_logit"] for r in results]
            err = max(rel_err(m, expected_logits[j]) for m in got)
            if not err < bound["max_logit"]:
                problems.append(f"max_logit error {err:.2e} (bound {bound['max_logit']:.2e})")
            if not all(torch.equal(m, got[0]) for m in got):
                problems.append("max_logit differs between ranks")
        if not all(r["padding_zero"] for r in results):
            problems.append("padding slots not zero")
        if draw.sinks:
            total = sum(r["dsinks"] for r in results)
            err = output_error("dsinks", total, results[0]["dsinks_expected"], results[0]["dsinks_scale"])
            if not err < bound["dsinks"]:
                problems.append(f"dsinks error {err:.2e} of its terms' scale (bound {bound['dsinks']:.2e})")
        if problems:
            found.append(
                f"{'; '.join(problems)} | world={batch.world} hp={batch.hp} cp={batch.cp} w={batch.w} "
                f"{batch.placement} ranks={list(batch.rank_order)} flash-attn {batch.flash_attn} | "
                f"{draw.describe()} | "
                f"replay: python tools/fuzz_attention.py "
                f"--replay {batch.seed}:{draw.index}"
            )
    return found
