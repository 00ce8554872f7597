"""Numerically stable merge of partial attention results through their log-sum-exp.

For one query row, blocks with partial results (o_1, lse_1) and (o_2, lse_2) combine as
    lse = log(exp(lse_1) + exp(lse_2))
    o   = exp(lse_1 - lse) * o_1 + exp(lse_2 - lse) * o_2
which equals attention over the union of the blocks' keys. An accumulator starts at lse = -inf, o = 0.
"""

from __future__ import annotations

import torch


def merge_attention_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> None:
    """Merge one block into the accumulators in place.

    out_acc [b, s, h, d] fp32, lse_acc [b, h, s] fp32 (views into larger buffers are fine);
    out_blk [b, s, h, d] any float dtype, lse_blk [b, h, s].
    """
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    # [b, h, s] -> [b, s, h, 1] to scale rows of out
    keep = torch.exp(lse_acc - new_lse).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(lse_blk - new_lse).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(keep).add_(out_blk.to(out_acc.dtype) * take)
    lse_acc.copy_(new_lse)
