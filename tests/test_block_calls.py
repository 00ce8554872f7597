"""The block calls (megatron_2d.layout.block_calls): which query/key ranges of a zigzag block pair are computed."""

import torch

from megatron_2d.layout.band import Band
from megatron_2d.layout.block_calls import BlockCall, block_pair_calls


def test_plan_zigzag_half_blocks():
    # CP=4, hp=1: context rank 1 holds chunks (1, 6).
    assert block_pair_calls([1, 6], [1, 6], 4, causal=True) == [BlockCall(0, 8, 0, 8, Band(None, 0))]
    assert block_pair_calls([1, 6], [0, 7], 4, causal=True) == [BlockCall(0, 8, 0, 4, None)]  # all Q, first half K
    assert block_pair_calls([1, 6], [3, 4], 4, causal=True) == [BlockCall(4, 8, 0, 8, None)]  # second half Q, all K
    assert block_pair_calls([1, 6], [3, 4], 4, causal=False) == [BlockCall(0, 8, 0, 8, None)]


def test_plan_matches_token_mask():
    """Every pair's calls, for arbitrary disjoint chunk sets, reproduces the token-level causal mask exactly."""
    c = 2
    for q_chunks, kv_chunks in [([0, 3, 4, 7], [1, 2, 5, 6]), ([1, 2, 5, 6], [0, 3, 4, 7]), ([2, 9], [0, 1, 10, 11])]:
        mask = torch.zeros(len(q_chunks) * c, len(kv_chunks) * c, dtype=torch.bool)
        for call in block_pair_calls(q_chunks, kv_chunks, c, causal=True):
            assert call.band is None
            mask[call.q_start : call.q_end, call.k_start : call.k_end] = True
        qpos = torch.tensor([x * c + t for x in q_chunks for t in range(c)])
        kpos = torch.tensor([y * c + t for y in kv_chunks for t in range(c)])
        assert torch.equal(mask, kpos[None, :] < qpos[:, None])
