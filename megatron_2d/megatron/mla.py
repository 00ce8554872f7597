"""Multi-latent attention (MLA, DeepSeek-V2/V3) under the 2d backend.

Megatron's own MLASelfAttention with CoreAttention2D as core attention. Its query and key have head dim
qk_head_dim + qk_pos_emb_head_dim (e.g. 192), its value v_head_dim (e.g. 128); the op sends K and V side by side,
unpadded, through the head all-to-all and the ring.
"""

from __future__ import annotations

from typing import Any, Dict


def uses_mla(config) -> bool:
    return bool(getattr(config, "multi_latent_attention", False))


def mla_layer_options(config, use_transformer_engine: bool) -> Dict[str, Any]:
    """The MLA options of Megatron's GPT layer specs for ``config`` (none without MLA)."""
    if not uses_mla(config):
        return {}
    options: Dict[str, Any] = {"multi_latent_attention": True}
    if use_transformer_engine:
        options["mla_down_proj_fusion"] = bool(getattr(config, "mla_down_proj_fusion", False))
    return options
