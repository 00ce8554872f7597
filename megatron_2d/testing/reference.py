"""Single-process reference attention and the dtype-keyed tolerances the tests and tools compare against."""

from __future__ import annotations

import torch

# Relative tolerance (max |err| / max |ref|) against an fp64 reference, keyed by the dtype under test.
# bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): inputs rounded to bf16 plus a bf16 output give ~1e-2.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


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
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        hidden |= offset > 0
    if left != -1:
        hidden |= offset < -left
    if right != -1:
        hidden |= offset > right
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
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
    """max |actual - expected| / max |expected|, in fp64."""
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).abs().max() / expected.abs().max()).item()
