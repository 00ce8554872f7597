"""Packed-document (THD) batches for the 2d backend: Megatron's zigzag split without Transformer Engine, and the
documents layout's own data path.

zigzag     Megatron's ``get_batch_on_this_cp_rank`` splits THD batches with TE's ``thd_get_partitioned_indices``
           (and fails without TE). :func:`get_thd_batch_on_this_cp_rank_2d` does the same split in numpy/torch,
           so CPU and TE-less runs get the layout CoreAttention2D expects; Megatron builds ``PackedSeqParams`` as
           usual and RoPE stays Megatron's.
documents  :func:`documents_batch_on_this_cp_rank` gives each rank the tokens of a
           :class:`megatron_2d.PackedSharding` in documents mode and a :class:`PackedSeqParams2D` carrying that
           layout; :func:`use_document_positions` makes the model's RoPE use each token's position within its
           document (Megatron's THD RoPE assumes the zigzag split).
sequence   Megatron splits the batch itself (per sequence, ``--dataloader-inter-document-masking``); the 2d layer
           spec's attention turns its PackedSeqParams into :func:`layout_params` of the sequence layout
           (:mod:`megatron_2d.megatron.per_sequence`).

Batches are Megatron's: tokens, labels, loss_mask, position_ids [1, T] (one packed sequence; micro-batches
flattened first, as Megatron does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..groups import Groups2D
from ..layout.choices import PackingMode
from ..packed_sharding import PackedSharding
from ..transport.comm import to_device

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Transformer Engine's ``thd_get_partitioned_indices`` without TE: LongTensor [total_tokens / CP] of the
    padded-stream tokens CP rank ``cp_rank`` holds (chunks r and 2*CP-1-r of every document), computed on
    ``cu_seqlens_padded``'s device with tensor ops only (no host-device synchronisation): local token j lies in
    the document whose local part [cu / CP) holds it, in the first half (chunk r) or the second (chunk 2CP-1-r)."""
    cu = torch.as_tensor(cu_seqlens_padded).reshape(-1).to(torch.int64)
    if cu.device.type == "cpu" and int(cu[-1]) != int(total_tokens):  # checkable without a device read
        raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])} but the batch holds {total_tokens} tokens")
    local = cu // cp_size  # [D + 1] local part of each document
    j = torch.arange(int(total_tokens) // cp_size, device=cu.device)
    doc = torch.searchsorted(local, j, right=True) - 1
    offset = j - local[doc]
    half = (local[doc + 1] - local[doc]) // 2  # chunk = padded length / 2CP
    chunk = torch.where(offset < half, cp_rank, 2 * cp_size - 2 - cp_rank)
    return cu[doc] + offset + half * chunk


def get_thd_batch_on_this_cp_rank_2d(batch: dict[str, Any], cp_group) -> dict[str, Any]:
    """Megatron's per-document THD split of ``batch`` for this CP rank (``cu_seqlens_padded`` if present, else
    ``cu_seqlens``, each document a multiple of 2*CP), with TE's partitioning done here. cu_seqlens stay global."""
    cp = cp_group.size() if cp_group is not None else 1
    if cp == 1:
        return dict(batch)
    cu = batch.get("cu_seqlens_padded")
    cu = batch["cu_seqlens"] if cu is None else cu
    total = batch["tokens"].shape[1]
    index = thd_partitioned_indices(torch.as_tensor(cu).to(batch["tokens"].device), total, cp, cp_group.rank())
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if batch.get(key) is not None:
            out[key] = batch[key].index_select(1, index)
    return out


@dataclass
class PackedSeqParams2D(PackedSeqParams):
    """PackedSeqParams of the documents layout: ``layout`` says which tokens this rank holds (CoreAttention2D
    reads it) and ``rope_positions`` each token's position in its document, arranged for Megatron's THD RoPE
    (see :func:`documents_batch_on_this_cp_rank`)."""

    layout: PackedSharding | None = None
    rope_positions: torch.Tensor | None = None


def rope_table(positions: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[CP * t_local] positions such that Megatron's THD RoPE, given one sequence of CP * t_local tokens and a
    frequency table of that length, reads ``positions`` [t_local] for this rank: it takes rows
    [r * t/2, (r+1) * t/2) then [CP*t - (r+1) * t/2, CP*t - r * t/2) (its zigzag), so they are put there."""
    t = positions.shape[0]
    half = t // 2
    table = torch.zeros(cp_size * t, dtype=torch.long, device=positions.device)
    table[cp_rank * half : (cp_rank + 1) * half] = positions[:half]
    table[cp_size * t - (cp_rank + 1) * half : cp_size * t - cp_rank * half] = positions[half:]
    return table


def documents_batch_on_this_cp_rank(
    batch: dict[str, Any], groups: Groups2D, cu_seqlens, **layout_options
) -> tuple[dict[str, Any], PackedSeqParams2D]:
    """This rank's tokens of ``batch`` ([1, T], real documents only) under the documents layout, and the
    PackedSeqParams to pass to the model. Padding slots get token 0, label 0, loss_mask 0, position 0, and
    ``padding`` ([1, t] bool) marks them: give it to a MoE model as ``padding_mask``, or its router counts them in
    its z-loss and load-balancing losses (which a CP = 1 step of the documents does not have). Collective over the
    CP group (it builds the layout)."""
    layout = PackedSharding(cu_seqlens, groups, mode=PackingMode.DOCUMENTS, **layout_options)
    device = batch["tokens"].device
    idx = layout.device_tensor("local_indices", device)  # copied once, non-blocking
    gather, pad = idx.clamp(min=0), idx < 0
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask"):
        if batch.get(key) is not None:
            if batch[key].shape[1] != layout.total_tokens:
                raise ValueError(
                    f"batch[{key!r}] holds {batch[key].shape[1]} tokens, cu_seqlens says {layout.total_tokens}"
                )
            out[key] = batch[key].index_select(1, gather).masked_fill(pad, 0)
    params = layout_params(layout, device)
    out["position_ids"] = to_device(layout.position_ids(), device).unsqueeze(0)
    out["padding"] = pad.reshape(1, -1)  # [1, t]
    return out, params


def layout_params(
    layout: PackedSharding, device: torch.device, rope_place: tuple[int, int] | None = None
) -> PackedSeqParams2D:
    """PackedSeqParams2D of a batch laid out by ``layout`` (carried, for CoreAttention2D): Megatron's THD RoPE sees
    one sequence of CP * t_local tokens, and ``rope_positions`` puts each local token's position in its document
    where that RoPE reads this rank's rows (:func:`rope_table`); index tensors copied pinned and non-blocking.
    ``rope_place``: (size, rank) of the CP group Megatron's RoPE splits by, when it is not the layout's (hybrid
    CP: RoPE reads the static CP group, the layout is the micro-batch's own group)."""
    cp_size, t_local = layout.groups.layout.cp_size, layout.local_tokens
    rope_size, rope_rank = (cp_size, layout.groups.place.cp_index) if rope_place is None else rope_place
    rope_cu = to_device(np.array([0, rope_size * t_local], dtype=np.int32), device)
    cu = to_device(layout.cu_seqlens.astype(np.int32), device)
    table = rope_table(layout.position_ids(), rope_size, rope_rank)
    return PackedSeqParams2D(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=rope_cu,
        cu_seqlens_kv_padded=rope_cu,
        max_seqlen_q=rope_size * t_local,
        max_seqlen_kv=rope_size * t_local,
        layout=layout,
        rope_positions=to_device(table, device),
    )


def token_weighted_loss(loss_func: Callable, cp_group, per_token_loss: bool) -> Callable:
    """pretrain_gpt's ``loss_func`` (returning loss sum, token count, report) for documents-layout batches.

    Without --calculate-per-token-loss Megatron's schedule divides each CP rank's loss sum by that rank's own
    token count; the gradient is the mean over tokens only when every CP rank holds as many, as Megatron's splits
    give, but the documents layout does not. The wrapped loss is rescaled by count / (CP-group count / CP), so each
    token weighs 1 / (CP-group count) as in the CP=1 run (one scalar all-reduce over the CP group, on the device;
    the report keeps the true sum). With per-token loss Megatron already divides by the global count."""

    def wrapped(*args, **kwargs):
        loss, num_tokens, report = loss_func(*args, **kwargs)
        if per_token_loss or cp_group is None or cp_group.size() == 1:
            return loss, num_tokens, report
        total = num_tokens.detach().to(loss.dtype).clone()
        torch.distributed.all_reduce(total, group=cp_group)
        return loss * (num_tokens.to(loss.dtype) * cp_group.size() / total.clamp(min=1)), num_tokens, report

    return wrapped


class DocumentRotaryEmbedding(torch.nn.Module):
    """The model's RotaryEmbedding (or YarnRotaryEmbedding), reading each token's position in its document from
    PackedSeqParams2D.

    GPTModel asks ``get_rotary_seq_len(..., packed_seq_params)`` and then calls the module for the table; with
    ``rope_positions`` present the table is the base embedding at those positions (laid out as
    :func:`rope_table` says), otherwise the base module answers unchanged. The positions are kept between
    the two calls of one forward only."""

    def __init__(self, base: torch.nn.Module, config) -> None:
        super().__init__()
        if getattr(config, "apply_rope_fusion", False):
            raise ValueError(
                "the documents layout's RoPE needs apply_rope_fusion=False (--no-rope-fusion): "
                "Transformer Engine's fused THD RoPE assumes the zigzag split"
            )
        self.base = base
        self._positions: torch.Tensor | None = None

    def get_rotary_seq_len(
        self, inference_context, transformer, transformer_input, transformer_config, packed_seq_params=None, **kwargs
    ) -> int:
        self._positions = getattr(packed_seq_params, "rope_positions", None)
        return self.base.get_rotary_seq_len(
            inference_context, transformer, transformer_input, transformer_config, packed_seq_params, **kwargs
        )

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        positions, self._positions = self._positions, None
        if positions is None:
            return self.base(max_seq_len, offset, packed_seq, cp_group)
        # positions < the longest document <= T <= max_seq_len (= CP * t_local): no read of the positions needed
        emb = self.base.get_emb(max_seq_len)  # [max_seq_len, 1, 1, dim]; YaRN: (that table, its mscale)
        if isinstance(emb, tuple):
            table, mscale = emb
            return table.index_select(0, positions.to(table.device)), mscale
        return emb.index_select(0, positions.to(emb.device))  # [CP * t_local, 1, 1, dim]


ROTARY_TYPES = ("rope", "yarn")
"""The position embeddings whose tables :class:`DocumentRotaryEmbedding` reads at document positions."""


def use_document_positions(model) -> Any:
    """Make ``model`` (a GPTModel or HybridModel with RoPE or YaRN) apply its rotary embedding at document positions
    for PackedSeqParams2D batches."""
    if not hasattr(model, "rotary_pos_emb") or getattr(model, "position_embedding_type", None) not in ROTARY_TYPES:
        raise ValueError(
            f"the documents layout's data path supports rotary models (position_embedding_type one of "
            f"{list(ROTARY_TYPES)}), not {getattr(model, 'position_embedding_type', None)!r}; learned absolute "
            f"positions would read position_ids, which it also provides"
        )
    if not isinstance(model.rotary_pos_emb, DocumentRotaryEmbedding):
        model.rotary_pos_emb = DocumentRotaryEmbedding(model.rotary_pos_emb, model.config)
    return model


def groups_of_model(model) -> Groups2D:
    """The Groups2D of the model's 2d core attention (the documents layout must be built for them): the one module
    that holds Groups2D, found without importing core_attention (which imports this module's users)."""
    for module in model.modules():
        if isinstance(getattr(module, "groups", None), Groups2D):
            return module.groups
    raise ValueError("the model has no 2d core attention (CoreAttention2D); build it with the 2d layer spec")
