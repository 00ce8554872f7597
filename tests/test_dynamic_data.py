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


# ---- MoE: the bridge's padding is kept out of the routers (router_padding_mask) -------------------------------------
def _params(padded, g, rank):
    cu = torch.tensor([0, padded], dtype=torch.int32)
    group = None if g == 1 else SimpleNamespace(rank=lambda: rank)
    return SimpleNamespace(cu_seqlens_q=cu, local_cp_size=g, cp_group=group)


@pytest.mark.parametrize(
    "length, g, rank, padded_at",
    [
        (13, 2, 0, [5, 6, 7]),  # 16 tokens in 4 chunks of 4: rank 0 holds chunks 0 and 3 (positions 0-3, 12-15)
        (13, 2, 1, []),  # chunks 1 and 2: positions 4-11, no padding
        (9, 4, 0, [2, 3]),  # 16 tokens in 8 chunks of 2: rank 0 holds chunks 0 and 7 (positions 0, 1, 14, 15)
        (9, 4, 3, [3]),  # chunks 3 and 4: positions 6, 7, 8, 9
        (5, 1, 0, [5]),  # one rank: 6 tokens, the last padded
    ],
)
def test_router_padding_mask_marks_this_ranks_padding_in_megatrons_zigzag(length, g, rank, padded_at):
    from megatron_2d.megatron.dynamic_data import router_padding_mask

    padded = padded_length(length, g)
    local = padded // g
    mask = router_padding_mask(_params(padded, g, rank), local, length)
    # the zigzag positions of this rank's tokens, the way get_batch_on_this_cp_rank cuts them
    chunk = padded // (2 * g)
    positions = [c * chunk + i for c in (rank, 2 * g - 1 - rank) for i in range(chunk)]
    assert mask.shape == (1, local) and mask.dtype == torch.bool
    assert [i for i, p in enumerate(positions) if p >= length] == padded_at == mask[0].nonzero().flatten().tolist()


def test_moe_forward_step_calls_the_model_with_the_bridges_padding_mask():
    """With MoE (``--num-experts``), the wrapped forward step calls the model with the padding mask of what the
    bridge padded; a given mask, a batch without PackedSeqParams or one without padding is left alone."""
    calls = []

    class Model(torch.nn.Module):
        def forward(self, tokens, packed_seq_params=None, padding_mask=None):
            calls.append(padding_mask)
            return tokens

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["tokens"], packed_seq_params=_params(batch["tokens"].shape[1], 1, 0))

    moe = SimpleNamespace(hybrid_context_parallel=True, num_experts=4)
    forward_step_2d(forward_step, moe)(iter([sub_sample(5, 1)]), Model())
    assert calls[-1].tolist() == [[False] * 5 + [True]]
    forward_step_2d(forward_step, moe)(iter([sub_sample(6, 1)]), Model())
    assert calls[-1] is None  # nothing padded
    forward_step_2d(forward_step, SimpleNamespace(hybrid_context_parallel=True))(iter([sub_sample(5, 1)]), Model())
    assert calls[-1] is None  # a dense model: no mask
    model = Model()
    forward_step_2d(forward_step, moe)(iter([sub_sample(5, 1)]), model)
    model(torch.zeros(1, 6), packed_seq_params=_params(6, 1, 0))
    assert calls[-1] is None and not model._forward_pre_hooks  # the hook lives for one forward step


# ---- QK-clip: the bridge's padding is kept out of the max attention logit (params_with_real_length) ------------------
def _megatron_params(padded, g, padded_cu=None):
    """pretrain_gpt.py's PackedSeqParams of a bridged hybrid micro-batch (cu_seqlens_q is the padded length)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, padded], dtype=torch.int32) if not isinstance(padded, list) else torch.tensor(padded)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded_cu,
        cu_seqlens_kv_padded=padded_cu,
        max_seqlen_q=int(cu[-1]),
        max_seqlen_kv=int(cu[-1]),
        local_cp_size=g,
    )


def test_params_with_real_length_tells_where_the_padding_starts():
    """cu_seqlens_q/kv [0, L] within cu_seqlens_*_padded [0, L'] (as Transformer Engine reads padded documents), on
    a copy; the params themselves when nothing was padded or they are not one bridged sequence."""
    from megatron_2d.megatron.dynamic_data import params_with_real_length

    params = _megatron_params(16, 2)
    told = params_with_real_length(params, 13)
    assert told is not params and params.cu_seqlens_q.tolist() == [0, 16]  # Megatron's params are left as they were
    assert told.cu_seqlens_q.tolist() == told.cu_seqlens_kv.tolist() == [0, 13]
    assert told.cu_seqlens_q_padded.tolist() == told.cu_seqlens_kv_padded.tolist() == [0, 16]
    assert told.cu_seqlens_q.dtype == torch.int32 and (told.local_cp_size, told.max_seqlen_q) == (2, 16)
    assert params_with_real_length(params, 16) is params  # nothing padded
    already = _megatron_params(16, 2, padded_cu=torch.tensor([0, 16], dtype=torch.int32))
    assert params_with_real_length(already, 13) is already  # padded lengths given: not the bridge's batch
    several = _megatron_params([0, 6, 16], 2)
    assert params_with_real_length(several, 13) is several


@pytest.mark.parametrize("moe", [False, True])
def test_qk_clip_forward_step_tells_the_model_the_real_length(moe):
    """With ``--qk-clip`` or ``--log-max-attention-logit``, the wrapped forward step calls the model with the
    PackedSeqParams that say where the bridge's padding starts (with MoE besides, the router's padding mask too,
    from the padded params); without them, or without padding, the params pass as they are."""
    calls = []

    class Model(torch.nn.Module):
        def forward(self, tokens, packed_seq_params=None, padding_mask=None):
            calls.append((packed_seq_params, padding_mask))
            return tokens

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["tokens"], packed_seq_params=_megatron_params(batch["tokens"].shape[1], 1))

    extra = {"num_experts": 4} if moe else {}
    for flag in ("qk_clip", "log_max_attention_logit"):
        args = SimpleNamespace(hybrid_context_parallel=True, **{flag: True}, **extra)
        forward_step_2d(forward_step, args)(iter([sub_sample(5, 1)]), Model())
        params, mask = calls[-1]
        assert params.cu_seqlens_q.tolist() == [0, 5] and params.cu_seqlens_q_padded.tolist() == [0, 6]
        assert (mask is not None) == moe and (not moe or mask.tolist() == [[False] * 5 + [True]])
        forward_step_2d(forward_step, args)(iter([sub_sample(6, 1)]), Model())
        assert calls[-1][0].cu_seqlens_q_padded is None and calls[-1][1] is None  # nothing padded
    forward_step_2d(forward_step, SimpleNamespace(hybrid_context_parallel=True, qk_clip=False, **extra))(
        iter([sub_sample(5, 1)]), Model()
    )
    assert calls[-1][0].cu_seqlens_q_padded is None  # without QK-clip Megatron's params pass unchanged
