"""Megatron's hybrid CP sub-samples in pretrain_gpt.py's batch schema (megatron_2d.megatron.dynamic_data): padding,
shapes and dtypes as get_batch_on_this_tp_rank and get_batch_on_this_cp_rank read them, and the errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_2d.megatron.dynamic_data import (
    dynamic_forward_step,
    forward_step_2d,
    hybrid_sample_batch,
    padded_length,
    sequence_parallel_size,
)

pytestmark = pytest.mark.megatron


def sub_sample(length, g):
    return {
        "tokens": torch.arange(length) + 5,
        "labels": torch.arange(length) + 6,
        "loss_mask": torch.ones(length),
        "position_ids": torch.arange(length) + 3,
        "local_cp_size": torch.tensor(g, dtype=torch.int32),  # as the hybrid schedule sets it (0-d)
    }


@pytest.mark.parametrize("length, g, padded", [(13, 4, 16), (16, 4, 16), (1, 1, 2), (9, 8, 16)])
def test_padded_to_2g_at_the_end(length, g, padded):
    batch = hybrid_sample_batch(sub_sample(length, g))
    assert padded_length(length, g) == padded and batch["tokens"].shape == (1, padded)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key].shape == (1, padded) and batch[key].dtype == sub_sample(length, g)[key].dtype
        assert torch.equal(batch[key][0, :length], sub_sample(length, g)[key])
    assert (batch["loss_mask"][0, length:] == 0).all() and (batch["tokens"][0, length:] == 0).all()
    assert batch["position_ids"][0].tolist() == list(range(3, 3 + padded))  # positions continue
    assert batch["cu_seqlens"].tolist() == [[0, padded]] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"].tolist() == [padded] and batch["local_cp_size"].tolist() == [g]
    assert batch["local_cp_size"].dtype == torch.int32 and batch["max_seqlen"].dtype == torch.int32


@pytest.mark.parametrize(
    "length, g, tp, padded", [(9, 1, 2, 10), (9, 1, 4, 12), (13, 2, 4, 16), (13, 4, 4, 16), (17, 2, 3, 24)]
)
def test_padded_for_the_tp_split_under_sequence_parallelism(length, g, tp, padded):
    """Under SP each of the g ranks' L / g tokens split over TP: L a multiple of g x lcm(2, TP) (9 tokens at TP 4 on
    one rank: 12, where 2 x g alone gives 10, which GPTModel's embedding cannot scatter over 4 ranks)."""
    batch = hybrid_sample_batch(sub_sample(length, g), sp_size=tp)
    assert padded_length(length, g, tp) == padded and batch["tokens"].shape == (1, padded)
    assert padded % (2 * g) == 0 and (padded // g) % tp == 0
    assert batch["cu_seqlens"].tolist() == [[0, padded]] and (batch["loss_mask"][0, length:] == 0).all()


def test_megatrons_cp_split_takes_it():
    """get_batch_on_this_cp_rank (hybrid branch) cuts the padded sequence into 2 x g chunks over the group."""
    from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing as split

    batch = hybrid_sample_batch(sub_sample(13, 4))

    class Group:
        def __init__(self, rank):
            self.r = rank

    import torch.distributed as dist

    saved = dist.get_world_size, dist.get_rank
    try:
        dist.get_world_size, dist.get_rank = (lambda group: 4), (lambda group: group.r)
        parts = [split(dict(batch), Group(r))["tokens"] for r in range(4)]
    finally:
        dist.get_world_size, dist.get_rank = saved
    assert [p.shape for p in parts] == [(1, 4)] * 4
    chunks = batch["tokens"].view(8, 2)
    assert torch.equal(parts[1][0], torch.cat([chunks[1], chunks[6]]))  # rank r: chunks r and 2g - 1 - r


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="without local_cp_size"):
        hybrid_sample_batch({k: v for k, v in sub_sample(4, 2).items() if k != "local_cp_size"})
    with pytest.raises(ValueError, match=r"\['position_ids'\] are missing"):
        hybrid_sample_batch({k: v for k, v in sub_sample(4, 2).items() if k != "position_ids"})
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        hybrid_sample_batch({**sub_sample(4, 2), "labels": torch.zeros(5, dtype=torch.long)})


def test_forward_step_is_wrapped_only_under_hybrid_cp():
    seen = []

    def forward_step(data_iterator, model):
        seen.append(None if data_iterator is None else next(data_iterator))
        return model

    assert forward_step_2d(forward_step, SimpleNamespace(hybrid_context_parallel=False)) is forward_step
    wrapped = forward_step_2d(forward_step, SimpleNamespace(hybrid_context_parallel=True))
    assert wrapped(iter([sub_sample(3, 2)]), "m") == "m" and seen[-1]["tokens"].shape == (1, 4)
    sp = SimpleNamespace(hybrid_context_parallel=True, sequence_parallel=True, tensor_model_parallel_size=4)
    assert sequence_parallel_size(sp) == 4 and sequence_parallel_size(SimpleNamespace(sequence_parallel=False)) == 1
    assert forward_step_2d(forward_step, sp)(iter([sub_sample(3, 2)]), "m") == "m"
    assert seen[-1]["tokens"].shape == (1, 8)  # 2 x lcm(2, 4): each of the 2 CP ranks' 4 tokens over 4 TP ranks
    assert dynamic_forward_step(forward_step)(None, "m") == "m" and seen[-1] is None  # TP ranks but the first
