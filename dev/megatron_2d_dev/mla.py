"""Tiny multi-latent-attention (MLA) GPT models on CPU ranks, and the CP=1 reference core attention they need.

megatron-core's local DotProductAttention does not take MLA's ``k_channels`` / ``v_channels`` (its local MLA spec
cannot be built), so the CP=1 reference of the MLA parity tests is :class:`ReferenceMLACoreAttention`: plain
softmax attention in the inputs' dtype (fp32), written independently of the 2d op, for CP = 1 only.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_2d.layout.choices import MlaRing
from megatron_2d.megatron import MLATransformerConfig2D
from megatron_2d.testing.reference import reference_attention

from .tiny_gpt import TinyGPTConfig, local_spec_with_core_attention

# small MLA dims: q/k head dim 12 + 8 (rope) = 20, v head dim 10, latent 16 + 8
MLA_DIMS: dict[str, Any] = dict(
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=12,
    qk_pos_emb_head_dim=8,
    v_head_dim=10,
    rope_type="rope",
)


class ReferenceMLACoreAttention(torch.nn.Module):
    """Megatron's core-attention interface at CP = 1: causal softmax attention of q/k [s, b, h, dk] and
    v [s, b, h, dv] -> [s, b, h * dv], with the softmax scale MLA passes."""

    def __init__(
        self,
        *,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
        k_channels=None,
        v_channels=None,
    ) -> None:
        super().__init__()
        if pg_collection is not None and pg_collection.cp is not None and pg_collection.cp.size() > 1:
            raise ValueError("ReferenceMLACoreAttention is the CP=1 reference; it does not split the sequence")
        self.softmax_scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        out = reference_attention(query, key, value, True, self.softmax_scale)  # [s, b, h, dv]
        return out.reshape(out.shape[0], out.shape[1], -1)


def reference_mla_spec():
    """Megatron's local MLA layer spec with :class:`ReferenceMLACoreAttention`."""
    return local_spec_with_core_attention(ReferenceMLACoreAttention, multi_latent_attention=True)


def mla_spec_2d(ring: str = MlaRing.EXPANDED, **spec_kwargs):
    """The 2d GPT layer spec for an MLA model whose config asks for ``ring`` (local layers)."""
    from megatron_2d.megatron import get_gpt_layer_spec_2d

    config = types.SimpleNamespace(multi_latent_attention=True, cp_2d_mla_ring=ring, qk_layernorm=False)
    return get_gpt_layer_spec_2d(config, use_transformer_engine=False, **spec_kwargs)


def tiny_mla_config(settings: tuple | None = None, ring: str = MlaRing.EXPANDED, **overrides) -> TinyGPTConfig:
    """A tiny MLA GPT (2 layers, hidden 64, 8 heads, seq 64); with 2D ``settings`` (hp, w, placement) an
    MLATransformerConfig2D with cp_comm_type '2d' and ``cp_2d_mla_ring=ring``; ``overrides`` are config fields."""
    cfg = TinyGPTConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64, config_class=MLATransformerConfig
    )
    cfg.config_overrides = {**MLA_DIMS, **overrides}
    if settings is not None:
        hp, w, placement = settings
        cfg.config_class, cfg.cp_comm_type = MLATransformerConfig2D, "2d"
        cfg.config_overrides.update(
            cp_2d_head_parallel_size=hp, cp_2d_inner_ring_size=w, cp_2d_placement=placement, cp_2d_mla_ring=ring
        )
    return cfg
