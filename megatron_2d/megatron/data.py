"""The CP split of a batch, with a clear error where Megatron's own split would fail obscurely or truncate."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.utils import get_batch_on_this_cp_rank

from ..sequence_sharding import check_divisible


def get_batch_on_this_cp_rank_2d(batch: dict[str, Any], cp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Megatron's zigzag split of ``batch`` ([b, s] tensors; attention_mask [b, 1, s, s]) for this CP rank,
    after checking that every sequence divides into 2*CP chunks."""
    cp = cp_group.size() if cp_group is not None else 1
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            seq_dim = 2 if key == "attention_mask" else 1
            try:
                check_divisible(value.shape[seq_dim], cp)
            except ValueError as err:
                raise ValueError(f"batch[{key!r}]: {err}") from None
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)
