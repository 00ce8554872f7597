"""Megatron's hybrid (dynamic) CP sub-samples as the batches pretrain_gpt.py's forward step reads.

megatron-core 0.19.2's ``HybridCPDataLoaderWrapper`` unpacks each packed sample into its sequences (1-D tensors
``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of L tokens, without ``cu_seqlens``), and its hybrid schedule
adds ``local_cp_size`` (a 0-d tensor) before handing each one to the forward step. pretrain_gpt.py's ``get_batch``
reads Megatron's batch schema instead: [1, L] tensors, ``cu_seqlens`` [1, 2], ``max_seqlen`` [1] and
``local_cp_size`` [1] (the bridge Megatron-LM lost in 0.19 and restored after it, #6820), and
``get_batch_on_this_cp_rank`` then cuts the sequence into 2 x g chunks, which needs L divisible by 2 x g; under
sequence parallelism GPTModel's embedding then scatters each rank's L / g tokens over TP, which needs L / g divisible
by TP (megatron-core 0.19.2 pads neither).

:func:`hybrid_sample_batch` is that bridge, and pads the sequence at its end to a multiple of both (g x lcm(2, TP)
under SP, 2 x g without; padding tokens 0, loss mask 0, positions continued). The padding is part of the sequence's
one document: under a causal mask no real token attends to it, and the loss mask drops it, so the result is the
unpadded sequence's (the 2d backend refuses other masks under hybrid CP). :func:`dynamic_forward_step` wraps
pretrain_gpt.py's ``forward_step`` with it; the patched pretrain_gpt.py and examples/pretrain_gpt_2d.py use it under
``--hybrid-context-parallel``.

MoE routers see every token of a micro-batch, padding included: megatron-core 0.19.2 adds the z-loss and the
expert-bias token counts of every token the model is given unless the model is called with a ``padding_mask``
(pretrain_gpt.py passes none). For a MoE model the wrapped forward step therefore calls the model with the mask of
the tokens the bridge padded (:func:`router_padding_mask`: True at this rank's share of them, in Megatron's 2 x g
zigzag), so that the bridge's padding changes nothing a CP = 1 step of the same sequence would compute (padding the
data itself brings, such as SFTDataset's, stays in, as it does in that step). Measured without it: z-loss (0.1)
gradients 76% off CP = 1 (docs/megatron.md).

QK-clip's max attention logit (``qk_clip`` / ``log_max_attention_logit``) takes every query row core attention is
given, padding rows included (they attend to the real tokens and to each other). Under either the wrapped forward
step calls the model with the micro-batch's PackedSeqParams saying where the padding starts
(:func:`params_with_real_length`: ``cu_seqlens_q/kv`` [0, L], ``cu_seqlens_*_padded`` [0, L'], as Transformer
Engine reads padded documents), and the 2d backend runs a padded sequence as that one padded document
(:func:`megatron_2d.megatron.dynamic.dynamic_params`), whose max leaves the padding out: the max logit and the clip
are CP = 1's. The real tokens' outputs and gradients are the same either way (padding rows' outputs become zero).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-token tensors of a sub-sample (each [L])."""


def padded_length(length: int, cp_size: int, sp_size: int = 1) -> int:
    """``length`` rounded up to a multiple of 2 x ``cp_size`` (Megatron's zigzag: two chunks per rank) whose
    ``cp_size``-th part splits over ``sp_size`` ranks (the TP size under sequence parallelism, else 1): a multiple of
    cp_size x lcm(2, sp_size).

    >>> padded_length(13, 4), padded_length(13, 1, sp_size=4), padded_length(18, 1, sp_size=2)
    (16, 16, 18)
    """
    granule = cp_size * math.lcm(2, sp_size)
    return -(-int(length) // granule) * granule


def hybrid_sample_batch(sample: dict[str, Any], sp_size: int = 1) -> dict[str, Any]:
    """One of Megatron's hybrid sub-samples (1-D per-token tensors and ``local_cp_size``) as pretrain_gpt.py's
    batch: [1, L'] tensors padded at the end to L' = :func:`padded_length` (``sp_size``: the TP size under
    sequence parallelism, else 1), ``cu_seqlens`` [[0, L']] (int32), ``max_seqlen`` [L'] and ``local_cp_size`` [g]
    (int32). Keys other than the per-token ones pass as they are. ValueError naming what is missing or
    malformed."""
    if "local_cp_size" not in sample:
        raise ValueError(
            f"a hybrid context-parallel sub-sample without local_cp_size (keys {sorted(sample)}): it should come "
            f"from megatron-core's hybrid schedule (hybrid_context_parallel_forward_backward), which sets it"
        )
    g = int(torch.as_tensor(sample["local_cp_size"]).reshape(-1)[0])
    missing = [key for key in SEQUENCE_KEYS if sample.get(key) is None]
    if missing:
        raise ValueError(f"a hybrid context-parallel sub-sample needs {list(SEQUENCE_KEYS)}; {missing} are missing")
    lengths = {key: tuple(sample[key].shape) for key in SEQUENCE_KEYS}
    if len(set(lengths.values())) != 1 or len(lengths["tokens"]) != 1:
        raise ValueError(f"a hybrid sub-sample's per-token tensors must be 1-D of one length, got {lengths}")
    length = lengths["tokens"][0]
    pad = padded_length(length, g, sp_size) - length
    batch = {key: value for key, value in sample.items() if key not in SEQUENCE_KEYS}
    for key in SEQUENCE_KEYS:
        value = sample[key]
        if pad:
            if key == "position_ids":
                start = value[-1] + 1 if length else 0
                tail = torch.arange(pad, dtype=value.dtype, device=value.device) + start
            else:
                tail = value.new_zeros(pad)
            value = torch.cat([value, tail])
        batch[key] = value.unsqueeze(0)  # [1, L']
    total = length + pad
    batch["cu_seqlens"] = torch.tensor([[0, total]], dtype=torch.int32)
    batch["max_seqlen"] = torch.tensor([total], dtype=torch.int32)
    batch["local_cp_size"] = torch.tensor([g], dtype=torch.int32)
    return batch


def router_padding_mask(params, tokens: int, real_length: int) -> torch.Tensor | None:
    """[1, tokens] bool, True at the tokens of this rank's share of a hybrid micro-batch (one sequence, Megatron's
    PackedSeqParams ``params``: cu_seqlens [0, L'], ``local_cp_size`` g, ``cp_group``) that lie at or past
    ``real_length``, the sequence's length before the bridge padded it to L' (:func:`hybrid_sample_batch`); None
    when it padded nothing. The layout is Megatron's 2 x g zigzag (``get_batch_on_this_cp_rank``'s hybrid split):
    this rank holds chunks r and 2g - 1 - r, r its rank in ``cp_group``.

    >>> from types import SimpleNamespace
    >>> params = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 8]), local_cp_size=1, cp_group=None)
    >>> router_padding_mask(params, 8, 6).int().tolist(), router_padding_mask(params, 8, 8)
    ([[0, 0, 0, 0, 0, 0, 1, 1]], None)
    """
    from .dynamic import zigzag_positions

    total = int(params.cu_seqlens_q[-1])
    if real_length >= total:
        return None
    g = int(params.local_cp_size or 1)
    rank = params.cp_group.rank() if g > 1 else 0
    positions = zigzag_positions(tokens, g, rank, params.cu_seqlens_q.device)  # [tokens]: index in the sequence
    return (positions >= real_length).unsqueeze(0)


def params_with_real_length(params, real_length: int):
    """Megatron's PackedSeqParams ``params`` of a hybrid micro-batch (one sequence padded by the bridge to L',
    cu_seqlens [0, L'] without padded ones, as pretrain_gpt.py builds them) with the sequence's real length
    ``real_length`` L told: cu_seqlens_q/kv [0, L] and cu_seqlens_q/kv_padded [0, L'] (a copy); ``params`` itself
    when nothing was padded or it is not such a micro-batch."""
    cu = params.cu_seqlens_q
    if cu is None or cu.shape[-1] != 2 or params.cu_seqlens_q_padded is not None:
        return params
    if real_length >= int(cu[-1]):
        return params
    real = torch.tensor([0, real_length], dtype=cu.dtype, device=cu.device)
    return dataclasses.replace(
        params, cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu
    )


def _bridge_padding_hook(real_length: int, moe: bool, max_logit: bool, module, args, kwargs):
    """Forward pre-hook (with kwargs) on the model of a hybrid micro-batch: with ``moe``, ``padding_mask`` of the
    bridge's padding (:func:`router_padding_mask`) unless the caller gave one; with ``max_logit``, the
    PackedSeqParams with the real length told (:func:`params_with_real_length`)."""
    params = kwargs.get("packed_seq_params")
    if params is None or getattr(params, "local_cp_size", None) is None:
        return None
    changed = {}
    if moe and kwargs.get("padding_mask") is None:
        input_ids = args[0] if args else kwargs["input_ids"]
        mask = router_padding_mask(params, input_ids.shape[-1], real_length)
        if mask is not None:
            changed["padding_mask"] = mask.to(input_ids.device)
    if max_logit:
        told = params_with_real_length(params, real_length)
        if told is not params:
            changed["packed_seq_params"] = told
    return (args, {**kwargs, **changed}) if changed else None


def _real_length_on_every_tp_rank(length: int | None) -> int:
    """The sub-sample's length before padding, which only the first TP rank reads (the hybrid schedule gives the
    others no data), broadcast over the TP group (collective over it; every TP rank runs every micro-batch)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():  # one process, no parallel state: nothing to share
        return int(length)
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return int(length)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    value = torch.tensor([-1 if length is None else int(length)], dtype=torch.int64, device=device)
    dist.broadcast(value, parallel_state.get_tensor_model_parallel_src_rank(), group=group)
    return int(value.item())


def dynamic_forward_step(
    forward_step: Callable, sp_size: int = 1, moe: bool = False, max_logit: bool = False
) -> Callable:
    """pretrain_gpt.py's ``forward_step(data_iterator, model, ...)`` reading Megatron's hybrid sub-samples
    (:func:`hybrid_sample_batch`, padded for ``sp_size``); ranks without a data iterator (TP ranks but the first)
    pass None as before. ``moe``: the model has MoE layers, which it then calls with the padding mask of the
    bridge's padding; ``max_logit``: the model keeps the max attention logit (QK-clip), which it then calls with
    PackedSeqParams that say where that padding starts (module docstring; the length is broadcast over TP)."""

    @functools.wraps(forward_step)
    def wrapped(data_iterator, model, *args, **kwargs):
        length = None
        if data_iterator is not None:
            sample = next(data_iterator)
            length = None if sample.get("tokens") is None else int(sample["tokens"].shape[0])
            data_iterator = iter([hybrid_sample_batch(sample, sp_size)])
        if not (moe or max_logit):
            return forward_step(data_iterator, model, *args, **kwargs)
        hook = functools.partial(_bridge_padding_hook, _real_length_on_every_tp_rank(length), moe, max_logit)
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return forward_step(data_iterator, model, *args, **kwargs)
        finally:
            handle.remove()

    return wrapped


def forward_step_2d(forward_step: Callable, args) -> Callable:
    """The forward step a 2d launch trains with: ``forward_step`` itself, wrapped by :func:`dynamic_forward_step`
    under ``--hybrid-context-parallel`` (``args``: megatron.training's parsed arguments; with
    ``--sequence-parallel`` each sequence is padded for its TP split too; with ``--num-experts`` the MoE routers
    leave the padding out, with ``--qk-clip`` or ``--log-max-attention-logit`` the max attention logit)."""
    if getattr(args, "hybrid_context_parallel", False):
        return dynamic_forward_step(
            forward_step,
            sequence_parallel_size(args),
            moe=bool(getattr(args, "num_experts", None)),
            max_logit=keeps_max_logit(args),
        )
    return forward_step


def keeps_max_logit(config) -> bool:
    """Whether the model keeps the max attention logit: QK-clip or its log (``qk_clip``,
    ``log_max_attention_logit``; a TransformerConfig or megatron.training's args)."""
    return bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))


def sequence_parallel_size(config) -> int:
    """The ranks a CP rank's tokens are split over in the layers' sequence-parallel regions: the TP size under
    sequence parallelism, else 1 (``config``: a TransformerConfig or megatron.training's args)."""
    if not getattr(config, "sequence_parallel", False):
        return 1
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)
