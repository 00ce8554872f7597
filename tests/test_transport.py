"""The dK/dV transport's partial blocks (megatron_2d.transport.base): gathered and added into one key buffer."""

import pytest
import torch


@pytest.mark.parametrize(
    "ranges, first_key",
    [
        ([(0, 8)], 0),  # one partial covering every key: a copy
        ([(2, 5)], 0),  # one partial inside: zeros on both sides
        ([(0, 3), (5, 8)], 0),  # disjoint, a gap between them
        ([(5, 8), (0, 3)], 0),  # the same, out of order
        ([(0, 5), (3, 8)], 0),  # overlapping: summed
        ([(10, 13), (14, 18)], 10),  # keys counted from first_key
        ([], 0),  # nothing visible: all zeros
    ],
)
def test_gather_partials_writes_every_key(ranges, first_key):
    from megatron_2d.transport.base import add_partials, gather_partials

    gen = torch.Generator().manual_seed(0)
    # dK (width 3) and dV (width 2) side by side in the block format [b, keys, g, dk + dv]
    partials = [
        (
            lo,
            hi,
            (
                torch.randn(1, hi - lo, 2, 3, generator=gen, dtype=torch.bfloat16),
                torch.randn(1, hi - lo, 2, 2, generator=gen, dtype=torch.bfloat16),
            ),
        )
        for lo, hi in ranges
    ]
    buffer = torch.full((1, 8, 2, 5), float("nan"))  # uninitialised memory may hold anything
    expected = torch.zeros(1, 8, 2, 5)
    for lo, hi, (dk, dv) in partials:
        expected[:, lo - first_key : hi - first_key, :, :3] += dk.float()
        expected[:, lo - first_key : hi - first_key, :, 3:] += dv.float()
    assert gather_partials(buffer, partials, first_key) is buffer
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)
    add_partials(buffer, partials, first_key)
    torch.testing.assert_close(buffer, 2 * expected, rtol=0, atol=0)
