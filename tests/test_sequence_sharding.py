"""Sequence sharding (megatron_2d.sequence_sharding): the zigzag split and its inverse, as Megatron splits."""

import pytest
import torch

from megatron_2d.sequence_sharding import shard_sequence, unshard_sequence


def test_shard_round_trip_matches_megatron():
    x = torch.arange(2 * 48).view(2, 48)
    for cp in (1, 2, 3, 4):
        shards = [shard_sequence(x, r, cp, seq_dim=1) for r in range(cp)]
        assert torch.equal(unshard_sequence(shards, seq_dim=1), x)
        # the index formula of Megatron's get_batch_on_this_cp_rank
        for r in range(cp):
            v = x.view(2, 2 * cp, 48 // (2 * cp))
            idx = torch.tensor([r, 2 * cp - r - 1])
            assert torch.equal(shards[r], v.index_select(1, idx).reshape(2, -1))


def test_shard_rejects_indivisible_sequence():
    with pytest.raises(
        ValueError, match=r"sequence length 10 is not divisible by 2\*CP = 4.*multiple of 4 \(e.g. 8 or 12\)"
    ):
        shard_sequence(torch.zeros(10), 0, 2)
