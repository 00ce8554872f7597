"""The (out, lse) merge of attention blocks (megatron_2d.kernels.merge): exact against one softmax over all keys, in
place on row views, near-overflow logits, the empty accumulator."""

import pytest
import torch

from megatron_2d.kernels.merge import merge_attention_
from megatron_2d.testing.reference import attention_with_lse, rel_err


def test_merge_equals_full_softmax():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 12, 3, 8, dtype=torch.float64), torch.randn(2, 12, 3, 8, dtype=torch.float64)
    full, full_lse = attention_with_lse(q, k, v)
    out = torch.zeros(2, 5, 3, 8, dtype=torch.float64)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 5), slice(5, 12)):  # uneven blocks, any order
        o, l = attention_with_lse(q, k[:, part], v[:, part])
        merge_attention_(out, lse, o, l)
    assert rel_err(out, full) < 1e-12 and rel_err(lse, full_lse) < 1e-12


def test_merge_row_subsets_in_place():
    """Merging into row views of larger buffers (as the ring does) updates only those rows."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    out = torch.zeros(1, 6, 2, 4, dtype=torch.float64)
    lse = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
    o, l = attention_with_lse(q[:, 2:4], k, v)
    merge_attention_(out[:, 2:4], lse[:, :, 2:4], o, l)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])) and torch.isinf(lse[:, :, 4:]).all()
    assert rel_err(out[:, 2:4], o) < 1e-12


LARGE_LOGITS = [
    (torch.float32, 100.0),
    (torch.float32, -110.0),
    (torch.float64, 100.0),
    (torch.float64, -110.0),
    (torch.float64, 750.0),
]


@pytest.mark.parametrize("dtype, logit", LARGE_LOGITS, ids=[f"{str(dt)[6:]}-logit{lg:+.0f}" for dt, lg in LARGE_LOGITS])
def test_merge_large_logits(dtype, logit):
    """Blocks whose scores sit near +-100: merging in the accumulators' dtype must stay exact. exp(100) overflows
    fp32 and exp(-110) underflows it; exp(750) overflows fp64 (fp32's lse cannot even hold 750 to 1e-6)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for n in (3, 9, 9))
    # scores = logit + small spread: q . k * scale with q, k aligned
    scale = 1.0
    k = k * 0.1 + q.mean(1, keepdim=True)
    q = q * 0 + q[:, :1]
    base = torch.einsum("bqhd,bkhd->bhqk", q, k).mean()
    k_shift = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    k_shift[..., 0] = (logit - base) / q[0, 0, :, 0].unsqueeze(0)
    k = k + k_shift
    full, full_lse = attention_with_lse(q, k, v, scale=scale)
    assert (full_lse - logit).abs().max() < 20  # the logits really are near the target
    out = torch.zeros(1, 3, 2, 4, dtype=dtype)
    lse = torch.full((1, 2, 3), float("-inf"), dtype=dtype)
    for part in (slice(0, 2), slice(2, 7), slice(7, 9)):
        o, l = attention_with_lse(q, k[:, part], v[:, part], scale=scale)
        merge_attention_(out, lse, o.to(dtype), l.to(dtype))
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    assert rel_err(out, full) < tol and rel_err(lse, full_lse) < tol


def test_merge_keeps_accumulator_through_an_empty_start():
    """The accumulator starts at lse = -inf, out = 0: the first merge takes the block exactly."""
    g = torch.Generator().manual_seed(5)
    o, l = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 4, generator=g) * 50
    out, lse = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), float("-inf"))
    merge_attention_(out, lse, o, l)
    assert torch.equal(out, o) and torch.equal(lse, l)
