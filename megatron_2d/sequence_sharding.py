"""Zigzag sequence sharding, identical to Megatron's ``get_batch_on_this_cp_rank``.

The global sequence of S tokens is cut into 2*CP chunks of c = S / (2*CP) tokens. CP rank i holds chunks i and
2*CP-1-i, concatenated in that order, so causal work is balanced across the ring.

    >>> zigzag_chunks(cp_index=1, cp_size=4)
    (1, 6)
    >>> import torch
    >>> x = torch.arange(8)
    >>> shard_sequence(x, cp_index=1, cp_size=2, seq_dim=0).tolist()
    [2, 3, 4, 5]
    >>> torch.equal(unshard_sequence([shard_sequence(x, i, 2, 0) for i in range(2)], seq_dim=0), x)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout.topology import zigzag_chunks


def check_divisible(seq_len: int, cp_size: int) -> None:
    """Raise a clear error unless the sequence splits into 2*CP equal chunks."""
    if seq_len % (2 * cp_size) != 0:
        lo = seq_len // (2 * cp_size) * (2 * cp_size)
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*CP = {2 * cp_size}; zigzag context parallelism needs "
            f"2*CP equal chunks: pad or trim to a multiple of {2 * cp_size} (e.g. {lo} or {lo + 2 * cp_size})"
        )


def shard_sequence(x: torch.Tensor, cp_index: int, cp_size: int, seq_dim: int = 0) -> torch.Tensor:
    """This CP rank's zigzag shard of the full-sequence tensor ``x`` (chunks i and 2*CP-1-i along ``seq_dim``)."""
    check_divisible(x.shape[seq_dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = zigzag_chunks(cp_index, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def unshard_sequence(shards: Sequence[torch.Tensor], seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from the shards of CP ranks 0..CP-1, in order."""
    cp_size = len(shards)
    chunks: list[torch.Tensor] = [None] * (2 * cp_size)  # type: ignore[list-item]
    for i, shard in enumerate(shards):
        first, second = zigzag_chunks(i, cp_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)
