"""Single-process reference attention and the ONE dtype-keyed tolerance table the tests and tools compare against.

Two measures of error, both against an fp64 reference:
    rel_err(a, e)   max |a - e| / max |e|         end to end: the reference is computed from the UNROUNDED fp64
                                                   inputs, so the error includes rounding the inputs to the dtype
    norm_err(a, e)  ||a - e||_2 / ||e||_2         per output: the reference is computed from the inputs AFTER
                                                   rounding to the dtype, so only the computation's own error is
                                                   left (kernel, merge, accumulators, the final rounding)

``TOLERANCES[dtype]`` holds both: ``end_to_end`` for rel_err, and per output (out, lse, dq, dk, dv) for norm_err;
``dsinks`` is the sinks gradient's bound under a third measure, sink_err (below); ``stock_cp`` holds Transformer
Engine's own bounds for its context parallelism (norm_err per output), measured on its code, labelled as TE's.
Callers that need one number per dtype read ``TOLERANCES[dtype].end_to_end`` (the one table). The benchmarks'
correctness gate uses ``TOLERANCES[dtype].gate``: the end-to-end bound, except fp32, looser (1e-4) at their sizes.

Two references: ``reference_attention`` (autograd on the whole problem, for tests; ``packed_reference_attention``
is it per document of ``cu_seqlens``) and ``blockwise_reference`` (fp64 with its gradients, one block of query rows
at a time, for the benchmarks' sizes; over ``cu_seqlens``, a plain sequence being one document [0, S];
``reference_on_rank`` is it on one rank's zigzag shards).

The sinks gradient of a head is one scalar, a sum over every query row of signed terms -p_sink * (dout . out), which
nearly cancels (the sum is often 100-500 times smaller than the sum of the terms' magnitudes). Its rounding scales
with the terms, not with the sum, so its measure is
    sink_err(a, e, s)  max over heads |a - e| / s      s: the head's sum over query rows of |p_sink * (dout . out)|
                                                       (sink_terms), from the inputs rounded to the dtype
and ``TOLERANCES[dtype].dsinks`` bounds it (docs/testing.md, generated cases, has the measurements).

How the per-output bounds were set (tests/test_attention_2d.py, CP 2..8, causal and full, MHA/GQA): bf16 out
stays at 2.6-2.7e-3 and dq at 3.1-3.2e-3 whatever the CP size, with fp32 accumulators; accumulating out or dq in
bf16 instead gives 3.8e-3 (CP 4) to 5.2e-3 (CP 8). fp16 is 8x tighter the same way (out 3.4e-4 vs 4.8-6.5e-4).
dk and dv sum over every query row (and over a GQA group): one 512-token bf16 block with 4 query heads per K/V
head reaches 5e-3 (tools/gpu_smoke.py --device cpu), hence their looser bounds. fp64 and fp32 compute in their own
precision, so their bounds are a few ulps of the dtype times the ring length.

The training bounds (``TOLERANCES[dtype].training``) are for whole models trained three Adam iterations on another
layout than the reference's, where every reduction runs in another order; each draw's bounds are floored by its
perturbed twin's spread (``config_runs.compare``). Their measured margins are in docs/testing.md ("Generated Megatron
configurations"). In short: fp32 losses stay at rounding level; gradient norms
after an update move further (Mamba / GDN layers, whose CP paths are Megatron's own, most); a gradient that is a sum
over every token with cancellations (norm biases and weights, sinks) loses the most relative accuracy, most of all
in bf16, so the bf16 gradient bound is loose and the fp32 runs carry exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layout.topology import zigzag_chunks
from ..sequence_sharding import shard_sequence


@dataclass(frozen=True)
class TrainingTolerance:
    """Bounds for a few iterations of Megatron training on another layout than the reference's (the generated
    configurations, tests/test_generated_configs.py), relative to the reference: ``loss`` per iteration and
    ``grad_norm`` at iteration 1 (|a - e| / |e|), ``grad`` per gradient tensor after iteration 1's reduction
    (rel_err), ``later_grad_norm`` for the gradient norms after an update (the updates carry iteration 1's rounding
    into the weights: bf16 weights round the fp32 main weights' small differences to whole bf16 ulps)."""

    loss: float
    grad_norm: float
    grad: float
    later_grad_norm: float
    weights: float
    """rel_err per weight after the last iteration (QK-clip's draws: the clip rescales W_q and W_k in every step)."""


@dataclass(frozen=True)
class StockCPTolerance:
    """Transformer Engine's OWN bounds, not the project's: its context parallelism (stock Megatron CP, every comm
    type, sbhd and THD, CP 2 and 4, each installed release) against the fp64 reference of the rounded inputs, per
    output (norm_err), as measured on TE's real code (tests/test_te_context_parallel.py; docs/testing.md has the
    figures: the largest of 1056 generated cases, x 1.2). TE merges partial outputs, corrects THD gradients and moves
    dK/dV in the input dtype, so they exceed the project's own per-output bounds where the project keeps fp32 (bf16
    p2p at CP 4: out 3.8e-3 on 2.20.2; THD p2p with small documents: dk 5.1e-3)."""

    out: float
    dq: float
    dk: float
    dv: float

    def of(self, output: str) -> float:
        return getattr(self, output)


@dataclass(frozen=True)
class Tolerance:
    """Error bounds for one dtype: ``end_to_end`` (rel_err, unrounded reference) and per output (norm_err, the
    reference computed from the rounded inputs); ``training`` for whole Megatron training runs."""

    end_to_end: float
    out: float
    lse: float
    dq: float
    dk: float
    dv: float
    dsinks: float
    """sink_err bound of the sinks gradient: relative to the sum of its per-row terms' magnitudes."""
    max_logit: float
    """rel_err bound of the max logit (``return_max_logit``) against the fp64 max over the allowed pairs of the
    inputs rounded to the dtype: the scores' accumulation in fp32 (fp64 for fp64) and, on CUDA and from Transformer
    Engine, the max rounded once to the dtype (up to 2^-8 relative in bf16, 2^-11 in fp16)."""
    benchmark: float | None = None
    """rel_err bound of the benchmarks' correctness gate (tools/bench_compare.py), at their larger sizes; the
    end-to-end bound when None."""
    training: TrainingTolerance | None = None
    """Bounds of the generated Megatron configurations against CP = 1 (None: no training runs in this dtype)."""
    stock_cp: StockCPTolerance | None = None
    """Transformer Engine's own measured bounds for its context parallelism (None: TE's fused attention does not
    run this dtype)."""

    @property
    def gate(self) -> float:
        """The benchmarks' bound: ``benchmark``, else ``end_to_end``."""
        return self.end_to_end if self.benchmark is None else self.benchmark

    def of(self, output: str) -> float:
        """The bound of one output: 'out', 'lse', 'dq', 'dk', 'dv' or 'dsinks'."""
        return getattr(self, output)


# bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): inputs rounded to bf16 plus a bf16 output give ~1e-2 end to end.
TOLERANCES = {
    torch.float64: Tolerance(
        end_to_end=1e-10, out=1e-12, lse=1e-12, dq=1e-12, dk=1e-12, dv=1e-12, dsinks=1e-12, max_logit=1e-12
    ),
    torch.float32: Tolerance(
        end_to_end=1e-5,
        out=2e-6,
        lse=1e-6,
        dq=2e-6,
        dk=2e-6,
        dv=2e-6,
        dsinks=2e-6,
        max_logit=2e-6,
        benchmark=1e-4,
        training=TrainingTolerance(loss=1e-5, grad_norm=1e-5, grad=1e-4, later_grad_norm=1e-4, weights=1e-5),
    ),
    torch.float16: Tolerance(
        end_to_end=5e-3,
        out=4.2e-4,
        lse=2e-5,
        dq=5.0e-4,
        dk=9e-4,
        dv=9e-4,
        dsinks=6e-4,
        max_logit=5e-4,
        stock_cp=StockCPTolerance(out=5.7e-4, dq=7.2e-4, dk=7.1e-4, dv=5.7e-4),
    ),
    torch.bfloat16: Tolerance(
        end_to_end=2e-2,
        out=3.3e-3,
        lse=2e-5,
        dq=3.7e-3,
        dk=7e-3,
        dv=7e-3,
        dsinks=5e-3,
        max_logit=4e-3,
        training=TrainingTolerance(loss=5e-3, grad_norm=1e-2, grad=1e-1, later_grad_norm=2e-1, weights=1e-2),
        stock_cp=StockCPTolerance(out=4.6e-3, dq=5.7e-3, dk=6.2e-3, dv=4.4e-3),
    ),
}


def hidden_keys(offset: torch.Tensor, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """Where query i must not see key j, from ``offset`` = j - i: after it (``causal``), or outside the sliding
    ``window`` (left, right; -1 unbounded)."""
    left, right = window
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if causal:
        hidden |= offset > 0
    if left != -1:
        hidden |= offset < -left
    if right != -1:
        hidden |= offset > right
    return hidden


def attention_with_lse(q, k, v, causal: bool = False, scale: float = 1.0, window=(-1, -1), sinks=None):
    """Plain softmax attention on [b, s, h, d] blocks (K/V heads repeated for GQA): (out [b, sq, hq, d],
    lse [b, hq, sq]). ``causal`` masks keys after each query (square blocks); ``window`` (left, right), -1 =
    unbounded, keeps keys i - left <= j <= i + right; ``sinks`` [hq] adds one logit per head to every row's
    softmax denominator (lse then includes it)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = scores.shape[-2:]
    offset = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1)  # j - i
    scores = scores.masked_fill(hidden_keys(offset, causal, window).to(scores.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
        probs = scores.softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), torch.logsumexp(scores, -1)


# (s_q, s_k, causal, window, softcap) of flash-attn's conventions: causal aligned bottom-right with more keys than
# queries and with fewer (the first rows see nothing), a causal window, a two-sided window, softcap
FLASH_CONVENTION_CASES = [
    (8, 8, True, (-1, -1), 0.0),
    (6, 10, True, (-1, -1), 0.0),
    (10, 6, True, (-1, -1), 0.0),
    (12, 12, True, (3, -1), 0.0),
    (8, 12, False, (2, 1), 0.0),
    (8, 8, False, (-1, -1), 5.0),
]


def flash_reference(q, k, v, dout, scale: float, causal: bool = False, window=(-1, -1), softcap: float = 0.0):
    """fp64 attention in flash-attn's own conventions, with its gradients: (out, lse, dq, dk, dv) for q [b, s_q,
    hq, d], k/v [b, s_k, hkv, d]. Masks align to the bottom-right corner: query i sees key j when
    i + s_k - s_q - left <= j <= i + s_k - s_q + right (-1 = unbounded; causal sets right = 0); ``softcap`` > 0
    caps the scores as softcap * tanh(s / softcap); a row that sees no key gets out 0 and lse +inf."""
    sq, sk = q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    offset = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1) - (sk - sq)  # j - aligned i
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64.repeat_interleave(rep, dim=2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum(
        "bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0), v64.repeat_interleave(rep, dim=2)
    )
    out.backward(dout.double())
    lse = lse.detach().masked_fill(~visible.any(1), float("inf"))
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def reference_attention(q, k, v, causal: bool, scale: float, window=(-1, -1), sinks=None) -> torch.Tensor:
    """Full-sequence attention in Megatron's sbhd: q [S, b, hq, d], k/v [S, b, hkv, d] -> [S, b, hq, d]."""
    out, _ = attention_with_lse(
        *(x.transpose(0, 1) for x in (q, k, v)), causal=causal, scale=scale, window=window, sinks=sinks
    )
    return out.transpose(0, 1)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp64 (NaN or inf anywhere gives NaN or inf)."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).abs().max() / expected.abs().max()).item()


def norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_2 / ||expected||_2, in fp64 (NaN or inf anywhere gives NaN or inf)."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).norm() / expected.norm()).item()


def sink_err(actual: torch.Tensor, expected: torch.Tensor, term_scale: torch.Tensor) -> float:
    """max over heads |actual - expected| / term_scale, in fp64: the sinks gradient's error against the scale of
    its per-row terms (:func:`sink_terms`, their magnitudes summed), not against itself, which cancels."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).abs() / term_scale.to(torch.float64)).max().item()


def sink_terms(q, k, v, dout, sinks, cu_seqlens, causal: bool, scale: float, window=(-1, -1)) -> torch.Tensor:
    """[T, hq]: the per-row terms -p_sink * (dout . out) whose sum over rows is each head's sinks gradient
    (p_sink = exp(sink - lse), the sink's share of the row), in fp64, per document of ``cu_seqlens`` as in
    :func:`packed_reference_attention`; q [T, hq, d], k/v [T, hkv, d], dout [T, hq, dv]. Their magnitudes summed
    are the scale of :func:`sink_err`."""
    bounds = [int(x) for x in cu_seqlens]
    terms = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        doc = [x[a:b].unsqueeze(0).double() for x in (q, k, v)]  # [1, s, h, d]
        out, lse = attention_with_lse(*doc, causal=causal, scale=scale, window=window, sinks=sinks.double())
        p_sink = torch.exp(sinks.double() - lse[0].transpose(0, 1))  # [s, hq]
        terms.append(-p_sink * (dout[a:b].double() * out[0]).sum(-1))
    return torch.cat(terms)


def max_logit_reference(q, k, cu_seqlens, causal: bool, scale: float, window=(-1, -1)) -> torch.Tensor:
    """[hq]: the brute-force fp64 max of ``scale`` * q . k over every (query, key) pair of the same document of
    ``cu_seqlens`` that the mask lets see (``causal``, the sliding ``window`` over positions within the document), for
    q [T, hq, d], k [T, hkv, d] (or with a batch dim, [T, b, h, d]: every batch row a sequence of those documents);
    -inf for a head that sees nothing."""
    if q.dim() == 3:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    best = torch.full((q.shape[2],), float("-inf"), dtype=torch.float64)
    bounds = [int(x) for x in cu_seqlens]
    for a, e in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qbhd,kbhd->bhqk", q[a:e], k[a:e]) * scale
        offset = torch.arange(e - a).view(1, -1) - torch.arange(e - a).view(-1, 1)  # j - i
        scores = scores.masked_fill(hidden_keys(offset, causal, window), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to fp64: the exact input a ``dtype`` run sees, for its reference."""
    return x.to(dtype).to(torch.float64)


def packed_reference_attention(
    q, k, v, cu_seqlens, causal: bool, scale: float, window=(-1, -1), sinks=None
) -> torch.Tensor:
    """Packed documents in THD: q [T, hq, d], k/v [T, hkv, d] -> [T, hq, d], each document attending only to
    itself (``cu_seqlens``: cumulative document lengths from 0; masks over positions within the document)."""
    bounds = [int(x) for x in cu_seqlens]
    outs = [
        reference_attention(
            *(x[a:b].unsqueeze(1) for x in (q, k, v)), causal=causal, scale=scale, window=window, sinks=sinks
        ).squeeze(1)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=0)


def blockwise_reference(
    q,
    k,
    v,
    dout,
    cu_seqlens=None,
    *,
    rows: Sequence[tuple[int, int]] | None = None,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    max_elements: int = 2**24,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, ...]:
    """Exact attention and its gradients in ``dtype`` (fp64 by default), one block of query rows at a time: the
    one blockwise reference (the benchmarks' sizes, where :func:`reference_attention`'s full score matrix would not
    fit).

    q [S, b, hq, dk], k [S, b, hkv, dk], v [S, b, hkv, dv], dout [S, b, hq, dv] (sbhd), or packed THD [T, h, d]
    (no batch dimension; the results come back the same way). ``cu_seqlens``: cumulative document lengths from 0;
    each query sees keys of its own document only (a plain sequence is one document, the default [0, S]), causal or
    not, within a sliding ``window`` (left, right; -1 unbounded) as in :func:`attention_with_lse`. ``rows``: the
    query positions to compute, as ranges [p0, p1) (default all S); out and dq come back for those rows, in that
    order, and dK, dV for every key: those rows' share (a sum over the rows of all ranks gives the whole).

    Notation
        S tokens, b batch, hkv K/V heads, g = hq/hkv query heads per K/V head, dk query/key and dv value head dims
        n query rows of a block at positions p0..p0+n-1, all in one document [a, e); keys [lo, hi) visible to it
        q, dout [S, b, hq, d] -> [S, b, hkv, g, d] (no K/V repeat: GQA groups stay a dimension)
        scores, p, dp, ds [b, hkv, g, n, m];   lse, delta [b, hkv, g, n, 1]
        a block holds at most max(1, max_elements / (b hq (e - a))) rows
    """
    if q.dim() == 3:  # packed THD: one batch entry
        results = blockwise_reference(
            *(x.unsqueeze(1) for x in (q, k, v, dout)),
            cu_seqlens,
            rows=rows,
            causal=causal,
            window=window,
            scale=scale,
            max_elements=max_elements,
            dtype=dtype,
        )
        return tuple(x.squeeze(1) for x in results)
    S, b, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    scale = dk**-0.5 if scale is None else scale
    left, right = window
    bounds = [0, S] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    documents = list(zip(bounds[:-1], bounds[1:]))
    q5, do5 = q.to(dtype).view(S, b, hkv, g, dk), dout.to(dtype).view(S, b, hkv, g, dv)  # [S, b, hkv, g, d]
    kc, vc = k.to(dtype), v.to(dtype)  # [S, b, hkv, d]
    dk_acc, dv_acc = torch.zeros_like(kc), torch.zeros_like(vc)
    outs, dqs = [], []
    for r0, r1 in [(0, S)] if rows is None else rows:
        for a, e in documents:
            s0, s1 = max(r0, a), min(r1, e)
            if s0 >= s1:
                continue
            rows_per_block = max(1, min(s1 - s0, max_elements // max(1, b * hq * (e - a))))
            for p0 in range(s0, s1, rows_per_block):
                p1 = min(p0 + rows_per_block, s1)
                lo = a if left == -1 else max(a, p0 - left)
                hi = p1 if causal else (e if right == -1 else min(e, p1 + right))
                qb, dob, kb, vb = q5[p0:p1], do5[p0:p1], kc[lo:hi], vc[lo:hi]
                scores = torch.einsum("nbhgd,mbhd->bhgnm", qb, kb) * scale
                offset = (
                    torch.arange(lo, hi, device=q.device)[None, :] - torch.arange(p0, p1, device=q.device)[:, None]
                )  # [n, m]: key - query
                scores.masked_fill_(hidden_keys(offset, causal, window), float("-inf"))
                p = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
                out = torch.einsum("bhgnm,mbhd->nbhgd", p, vb)
                dp = torch.einsum("nbhgd,mbhd->bhgnm", dob, vb)
                delta = torch.einsum("nbhgd,nbhgd->bhgn", dob, out).unsqueeze(-1)
                ds = p * (dp - delta) * scale
                dqs.append(torch.einsum("bhgnm,mbhd->nbhgd", ds, kb))
                dk_acc[lo:hi] += torch.einsum("bhgnm,nbhgd->mbhd", ds, qb)
                dv_acc[lo:hi] += torch.einsum("bhgnm,nbhgd->mbhd", p, dob)
                outs.append(out)
    out = torch.cat(outs).view(-1, b, hq, dv) if outs else q5.new_zeros(0, b, hq, dv)
    dq = torch.cat(dqs).view(-1, b, hq, dk) if dqs else q5.new_zeros(0, b, hq, dk)
    return out, dq, dk_acc, dv_acc


def reference_on_rank(
    q,
    k,
    v,
    dout,
    rank: int,
    world: int,
    max_elements: int = 2**24,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, ...]:
    """Exact attention in ``dtype`` (fp64 by default): this rank's zigzag shards of out, dq, dk, dv from the FULL
    sbhd inputs q [S, b, hq, dk], k [S, b, hkv, dk], v [S, b, hkv, dv], causal or not, with a sliding ``window``
    (left, right; -1 unbounded) as in :func:`attention_with_lse`.

    :func:`blockwise_reference` over the rows of this rank's own queries (its two zigzag chunks); their share of
    dK/dV for all keys is summed over the ranks by an all-reduce over the default group.
    """
    chunk = q.shape[0] // (2 * world)
    rows = [(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(rank, world)]
    out, dq, dk_acc, dv_acc = blockwise_reference(
        q, k, v, dout, rows=rows, causal=causal, window=window, scale=scale, max_elements=max_elements, dtype=dtype
    )
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(dk_acc)
        dist.all_reduce(dv_acc)
    return out, dq, shard_sequence(dk_acc, rank, world), shard_sequence(dv_acc, rank, world)
