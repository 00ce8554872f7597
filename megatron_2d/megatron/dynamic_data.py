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
"""

from __future__ import annotations

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


def dynamic_forward_step(forward_step: Callable, sp_size: int = 1) -> Callable:
    """pretrain_gpt.py's ``forward_step(data_iterator, model, ...)`` reading Megatron's hybrid sub-samples
    (:func:`hybrid_sample_batch`, padded for ``sp_size``); ranks without a data iterator (TP ranks but the first)
    pass None as before."""

    @functools.wraps(forward_step)
    def wrapped(data_iterator, model, *args, **kwargs):
        if data_iterator is not None:
            data_iterator = iter([hybrid_sample_batch(next(data_iterator), sp_size)])
        return forward_step(data_iterator, model, *args, **kwargs)

    return wrapped


def forward_step_2d(forward_step: Callable, args) -> Callable:
    """The forward step a 2d launch trains with: ``forward_step`` itself, wrapped by :func:`dynamic_forward_step`
    under ``--hybrid-context-parallel`` (``args``: megatron.training's parsed arguments; with
    ``--sequence-parallel`` each sequence is padded for its TP split too)."""
    if getattr(args, "hybrid_context_parallel", False):
        return dynamic_forward_step(forward_step, sequence_parallel_size(args))
    return forward_step


def sequence_parallel_size(config) -> int:
    """The ranks a CP rank's tokens are split over in the layers' sequence-parallel regions: the TP size under
    sequence parallelism, else 1 (``config``: a TransformerConfig or megatron.training's args)."""
    if not getattr(config, "sequence_parallel", False):
        return 1
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)
