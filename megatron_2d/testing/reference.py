"""Single-process reference attention and the ONE dtype-keyed tolerance table the tests and tools compare against.

Two measures of error, both against an fp64 reference:
    rel_err(a, e)   max |a - e| / max |e|         end to end: the reference is computed from the UNROUNDED fp64
                                                   inputs, so the error includes rounding the inputs to the dtype
    norm_err(a, e)  ||a - e||_2 / ||e||_2         per output: the reference is computed from the inputs AFTER
                                                   rounding to the dtype, so only the computation's own error is
                                                   left (kernel, merge, accumulators, the final rounding)

``TOLERANCES[dtype]`` holds both: ``end_to_end`` for rel_err, and per output (out, lse, dq, dk, dv) for norm_err.
``TOLERANCE[dtype]`` is the end-to-end column alone, for callers that need one number per dtype. The benchmarks'
correctness gate uses ``TOLERANCES[dtype].gate``: the end-to-end bound, except fp32, looser (1e-4) at their sizes.

Two references: ``reference_attention`` (autograd on the whole problem, for tests) and ``reference_on_rank``
(blockwise fp64, causal, each rank its own shards, for the benchmarks' sizes).

How the per-output bounds were set (tests/test_attention_2d.py, CP 2..8, causal and full, MHA/GQA): bf16 out
stays at 2.6-2.7e-3 and dq at 3.1-3.2e-3 whatever the CP size, with fp32 accumulators; accumulating out or dq in
bf16 instead gives 3.8e-3 (CP 4) to 5.2e-3 (CP 8). fp16 is 8x tighter the same way (out 3.4e-4 vs 4.8-6.5e-4).
dk and dv sum over every query row (and over a GQA group): one 512-token bf16 block with 4 query heads per K/V
head reaches 5e-3 (tools/gpu_smoke.py --device cpu), hence their looser bounds. fp64 and fp32 compute in their own
precision, so their bounds are a few ulps of the dtype times the ring length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..sequence_layout import shard_sequence
from ..topology import zigzag_chunks


@dataclass(frozen=True)
class Tolerance:
    """Error bounds for one dtype: ``end_to_end`` (rel_err, unrounded reference) and per output (norm_err, the
    reference computed from the rounded inputs)."""

    end_to_end: float
    out: float
    lse: float
    dq: float
    dk: float
    dv: float
    benchmark: Optional[float] = None
    """rel_err bound of the benchmarks' correctness gate (tools/bench_compare.py), at their larger sizes; the
    end-to-end bound when None."""

    @property
    def gate(self) -> float:
        """The benchmarks' bound: ``benchmark``, else ``end_to_end``."""
        return self.end_to_end if self.benchmark is None else self.benchmark

    def of(self, output: str) -> float:
        """The bound of one output: 'out', 'lse', 'dq', 'dk' or 'dv'."""
        return getattr(self, output)


# bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): inputs rounded to bf16 plus a bf16 output give ~1e-2 end to end.
TOLERANCES = {
    torch.float64: Tolerance(end_to_end=1e-10, out=1e-12, lse=1e-12, dq=1e-12, dk=1e-12, dv=1e-12),
    torch.float32: Tolerance(end_to_end=1e-5, out=2e-6, lse=1e-6, dq=2e-6, dk=2e-6, dv=2e-6, benchmark=1e-4),
    torch.float16: Tolerance(end_to_end=5e-3, out=4.2e-4, lse=2e-5, dq=5.0e-4, dk=9e-4, dv=9e-4),
    torch.bfloat16: Tolerance(end_to_end=2e-2, out=3.3e-3, lse=2e-5, dq=3.7e-3, dk=7e-3, dv=7e-3),
}
# Relative tolerance (max |err| / max |ref|) against an fp64 reference of the unrounded inputs, keyed by dtype.
TOLERANCE = {dtype: t.end_to_end for dtype, t in TOLERANCES.items()}


def hidden_keys(offset: torch.Tensor, causal: bool, window: Tuple[int, int]) -> torch.Tensor:
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
    offset = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1)          # j - i
    scores = scores.masked_fill(hidden_keys(offset, causal, window).to(scores.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
        probs = scores.softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), torch.logsumexp(scores, -1)


def reference_attention(q, k, v, causal: bool, scale: float, window=(-1, -1), sinks=None) -> torch.Tensor:
    """Full-sequence attention in Megatron's sbhd: q [S, b, hq, d], k/v [S, b, hkv, d] -> [S, b, hq, d]."""
    out, _ = attention_with_lse(*(x.transpose(0, 1) for x in (q, k, v)), causal=causal, scale=scale,
                                window=window, sinks=sinks)
    return out.transpose(0, 1)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp64 (NaN or inf anywhere gives NaN or inf)."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).abs().max() / expected.abs().max()).item()


def norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_2 / ||expected||_2, in fp64 (NaN or inf anywhere gives NaN or inf)."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).norm() / expected.norm()).item()


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to fp64: the exact input a ``dtype`` run sees, for its reference."""
    return x.to(dtype).to(torch.float64)


def packed_reference_attention(q, k, v, cu_seqlens, causal: bool, scale: float, window=(-1, -1),
                               sinks=None) -> torch.Tensor:
    """Packed documents in THD: q [T, hq, d], k/v [T, hkv, d] -> [T, hq, d], each document attending only to
    itself (``cu_seqlens``: cumulative document lengths from 0; masks over positions within the document)."""
    bounds = [int(x) for x in cu_seqlens]
    outs = [reference_attention(*(x[a:b].unsqueeze(1) for x in (q, k, v)), causal=causal, scale=scale,
                                window=window, sinks=sinks).squeeze(1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=0)

def reference_on_rank(q, k, v, dout, rank: int, world: int, max_elements: int = 2 ** 24, causal: bool = True,
                      window: Tuple[int, int] = (-1, -1), scale: Optional[float] = None,
                      dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, ...]:
    """Exact attention in ``dtype`` (fp64 by default): this rank's zigzag shards of out, dq, dk, dv from the FULL
    sbhd inputs q [S, b, hq, dk], k [S, b, hkv, dk], v [S, b, hkv, dv], causal or not, with a sliding ``window``
    (left, right; -1 unbounded) as in :func:`attention_with_lse`.

    (Blockwise, so it fits at benchmark sizes where :func:`reference_attention`'s full score matrix would not.)
    Each rank computes the rows of its own queries (blocks of consecutive positions, against the keys they can see)
    and its queries' share of dK/dV for all keys, which an all-reduce over the default group sums.

    Notation
        S tokens, b batch, hkv K/V heads, g = hq/hkv query heads per K/V head, dk query/key and dv value head dims
        n query rows of a block at positions p0..p0+n-1; keys [lo, hi) visible to the block
        q, dout [S, b, hq, d] -> [S, b, hkv, g, d] (no K/V repeat: GQA groups stay a dimension)
        scores, p, dp, ds [b, hkv, g, n, m];   lse, delta [b, hkv, g, n, 1]
    """
    S, b, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    scale = dk ** -0.5 if scale is None else scale
    left, right = window
    cast = lambda x: x.to(dtype)                                                         # noqa: E731
    q5, do5 = cast(q).view(S, b, hkv, g, dk), cast(dout).view(S, b, hkv, g, dv)         # [S, b, hkv, g, d]
    kc, vc = cast(k), cast(v)                                                           # [S, b, hkv, d]
    dk_acc, dv_acc = torch.zeros_like(kc), torch.zeros_like(vc)
    outs, dqs = [], []
    chunk = S // (2 * world)
    rows_per_block = max(1, min(chunk, max_elements // max(1, b * hq * S)))
    for c in zigzag_chunks(rank, world):
        for p0 in range(c * chunk, (c + 1) * chunk, rows_per_block):
            p1 = min(p0 + rows_per_block, (c + 1) * chunk)
            lo = 0 if left == -1 else max(0, p0 - left)
            hi = p1 if causal else (S if right == -1 else min(S, p1 + right))
            qb, dob, kb, vb = q5[p0:p1], do5[p0:p1], kc[lo:hi], vc[lo:hi]
            scores = torch.einsum("nbhgd,mbhd->bhgnm", qb, kb) * scale
            offset = (torch.arange(lo, hi, device=q.device)[None, :]
                      - torch.arange(p0, p1, device=q.device)[:, None])                  # [n, m]: key - query
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
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(dk_acc)
        dist.all_reduce(dv_acc)
    shard = lambda x: shard_sequence(x, rank, world)                                      # noqa: E731
    return (torch.cat(outs).view(-1, b, hq, dv), torch.cat(dqs).view(-1, b, hq, dk), shard(dk_acc), shard(dv_acc))
