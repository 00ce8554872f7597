"""Megatron's per-sequence split of packed documents (``--dataloader-inter-document-masking``) under the 2d backend.

With that flag (and without --sft) pretrain_gpt.py splits each packed batch with
``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``: the whole sequence cut into 2*CP chunks, CP
rank i holding chunks i and 2*CP-1-i, whatever the documents; the PackedSeqParams keep the global cu_seqlens for
the masks. That is the "sequence" layout of :class:`megatron_2d.PackedSharding`, built from those cu_seqlens.

Megatron's THD RoPE, applied inside SelfAttention before core attention, assumes the per-document split (it cuts
the local tokens into cu_seqlens / CP pieces), so it cannot place these tokens. :class:`SelfAttention2D`, the
2d layer spec's self attention in such a launch, turns the batch's PackedSeqParams into the sequence layout's
:func:`megatron_2d.megatron.packed_data.layout_params` (built once per batch, shared by every layer) and the RoPE
table into each token's position within its document, the way the documents layout's data path does. Everything
else is Megatron's SelfAttention.

Hybrid (dynamic) CP batches (``packed_seq_params.local_cp_size`` set, :mod:`megatron_2d.megatron.dynamic`) are
Megatron's per-sequence split too, over the micro-batch's own CP group: :class:`SelfAttention2D` builds their
sequence layout on the 2D groups of that group, with the RoPE table laid out for the static CP group that
Megatron's THD RoPE splits by. Under sequence parallelism the layer's hidden states hold 1/TP of the micro-batch's
tokens on this rank; RoPE and core attention get them gathered by the QKV projection, and are laid out for those.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from ..layout.choices import PackingMode
from ..packed_sharding import PackedSharding
from .packed_data import PackedSeqParams2D, layout_params


def sequence_params(params, groups, device: torch.device, rope_group=None) -> PackedSeqParams2D:
    """The PackedSeqParams2D of the sequence layout of Megatron's ``params`` on ``groups`` (cached on ``params``:
    one build per batch, the first layer's; reading the batch's cu_seqlens from the GPU is its one device-to-host
    copy). ``rope_group``: the CP group Megatron's THD RoPE splits by, when it is not ``groups``' (hybrid CP)."""
    cache = params.__dict__.setdefault("_megatron_2d_sequence", {})
    rope_place = None if rope_group is None else (rope_group.size(), rope_group.rank())
    key = (groups.layout, groups.place, rope_place)
    if key not in cache:
        padded = params.cu_seqlens_q_padded
        if padded is not None and padded is not params.cu_seqlens_q:
            raise ValueError(
                "a per-sequence split batch (--dataloader-inter-document-masking) came with "
                "cu_seqlens_q_padded; Megatron's per-sequence split pads no document, so the 2d backend "
                "cannot tell where its tokens are: drop the padding or use --sft"
            )
        layout = PackedSharding(torch.as_tensor(params.cu_seqlens_q).cpu(), groups, mode=PackingMode.SEQUENCE)
        cache[key] = layout_params(layout, device, rope_place)
    return cache[key]


class SelfAttention2D(SelfAttention):
    """Megatron's SelfAttention; THD batches in Megatron's per-sequence split reach RoPE and core attention as the
    sequence layout (see the module docstring). Other batches pass unchanged."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        params = kwargs.get("packed_seq_params")
        groups = getattr(self.core_attention, "groups", None)
        dynamic = getattr(self.core_attention, "dynamic", None)
        derived = None
        if dynamic is not None and params is not None and getattr(params, "local_cp_size", None) is not None:
            # hybrid CP: the micro-batch's own group; Megatron's THD RoPE splits by the static CP group. Under
            # sequence parallelism hidden_states hold this rank's 1/TP of the tokens: the QKV projection gathers
            # them before RoPE and core attention, which see all t_local
            t_local = hidden_states.shape[0] * (self.tp_group.size() if self.config.sequence_parallel else 1)
            derived = dynamic.batch_params(params, self.pg_collection.cp, t_local, hidden_states.device)
        elif (
            params is not None
            and params.qkv_format == "thd"
            and groups is not None
            and groups.layout.cp_size > 1
            and getattr(params, "layout", None) is None
        ):
            derived = sequence_params(params, groups, hidden_states.device)
        if derived is not None:
            kwargs["packed_seq_params"] = derived
            emb = kwargs.get("rotary_pos_emb")  # [max document length, 1, 1, dim] (or a (q, k) pair)
            if emb is not None:  # -> [CP * t_local, 1, 1, dim] at document positions

                def pick(e: torch.Tensor) -> torch.Tensor:  # the table's rows at the tokens' document positions
                    return e.index_select(0, derived.rope_positions)

                kwargs["rotary_pos_emb"] = tuple(map(pick, emb)) if isinstance(emb, tuple) else pick(emb)
        return super().forward(hidden_states, attention_mask, **kwargs)
