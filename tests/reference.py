"""Single-process reference attention and tolerances shared by the distributed tests."""

from __future__ import annotations

import torch

# Relative tolerance (max |err| / max |ref|) against an fp64 reference, keyed by the dtype under test.
# bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): inputs rounded to bf16 plus a bf16 output give ~1e-2.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def reference_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """Plain softmax attention on full sequences, sbhd: q [S, b, hq, d], k/v [S, b, hkv, d] -> [S, b, hq, d]."""
    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    if causal:
        S = q.shape[0]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).abs().max() / expected.abs().max()).item()
