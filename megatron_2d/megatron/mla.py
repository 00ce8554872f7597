"""Multi-latent attention (MLA, DeepSeek-V2/V3) under the 2d backend; ``cp_2d_mla_ring`` chooses what travels.

"expanded": Megatron's own MLASelfAttention with CoreAttention2D as core attention. Its query and key have head dim
    qk_head_dim + qk_pos_emb_head_dim (e.g. 192), its value v_head_dim (e.g. 128); the op sends K and V side by
    side, unpadded, through the head all-to-all and the ring.
"latent": :class:`MLASelfAttention2D` (or :class:`FusedMLASelfAttention2D`), Megatron's class with the same
    parameters and checkpoint keys, whose forward stops before the K/V up-projection: it computes the queries as
    Megatron does, the latent (kv_compressed after kv_layernorm) and the rope key (after RoPE at each token's true
    position) on this rank's tokens, and hands them with linear_kv_up_proj's weight to
    :func:`megatron_2d.latent_attention_2d` (a call of its core attention with ``latent=``): the ring carries
    kv_lora_rank + rope dim values per token instead of heads x (qk + v head dims), and each rank up-projects
    every block it receives for its own heads.

The latent enters the up-projection as Megatron's column-parallel linear_kv_up_proj takes it: its gradient is summed
over TP (all-gathered over the sequence and reduce-scattered under sequence parallelism); the rope key's is not, as
in Megatron. The up-projection weight's gradient comes from the ring (each rank: its heads, its queries), and
Megatron's reduction over the data-parallel x CP group sums the shares.

Megatron's DDP waits for a parameter's all-gather (distributed optimizer with --overlap-param-gather) in the forward
pre-hook of the module owning it. The latent ring calls its core attention as a module (softmax_offset) and reads
linear_kv_up_proj's weight only after that module's forward pre-hooks ran (:func:`after_forward_pre_hooks`), since
the weight is consumed inside the ring, not by the module's forward.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention, MLASelfAttention
from megatron.core.utils import get_pg_size
from torch.nn.modules.module import _global_forward_pre_hooks

from ..layout.choices import MlaRing, check_mla_ring
from .core_attention import LatentDims
from .fields import fields_2d
from .launch_checks import mla_packing_problem


def uses_mla(config) -> bool:
    return bool(getattr(config, "multi_latent_attention", False))


def mla_ring(config) -> str:
    """What the ring carries for ``config``'s MLA layers: "expanded" (the default) or "latent"."""
    return fields_2d(config).cp_2d_mla_ring


def check_mla_settings(config) -> None:
    """Refuse, with ValueError, MLA settings of ``config`` (a TransformerConfig) the 2d backend cannot honour: an
    unknown ``cp_2d_mla_ring``, a latent ring without MLA (it would be ignored), and MLA with Megatron's
    per-sequence split of packed documents or with the documents layout (:func:`.launch_checks.mla_packing_problem`,
    which the launch checks run first). The one MLA check, reached from TransformerConfig2D and from the layer spec
    (plain TransformerConfigs)."""
    ring = check_mla_ring(mla_ring(config))
    if ring != MlaRing.EXPANDED and not uses_mla(config):
        raise ValueError(
            f"cp_2d_mla_ring {ring!r} chooses what multi-latent attention sends round the ring, but "
            f"multi_latent_attention is off, so it would be ignored; drop it or build an "
            f"MLATransformerConfig2D (--multi-latent-attention)"
        )
    problem = mla_packing_problem(config)
    if problem:
        raise ValueError(problem)


def use_latent_ring(spec, config, use_transformer_engine: bool):
    """Megatron's MLA layer ``spec`` with its self attention made the latent-ring class when ``config`` asks for
    ``cp_2d_mla_ring="latent"`` (unchanged otherwise). Transformer Engine's fused layernorm+linear kv up-projection
    (the TE spec with qk_layernorm) is split into TE's norm and linear, as Megatron's own spec resolver allows, since
    the norm must run before the latent travels; the layer's sharded-state-dict map keeps TE's checkpoint key."""
    if not uses_mla(config) or mla_ring(config) != MlaRing.LATENT:
        return spec
    attention = spec.submodules.self_attention
    if attention.module not in LATENT_CLASSES:
        raise ValueError(
            f"cp_2d_mla_ring='latent' replaces Megatron's MLA self attention "
            f"({', '.join(c.__name__ for c in LATENT_CLASSES)}); this spec's is "
            f"{getattr(attention.module, '__name__', attention.module)}"
        )
    attention.module = LATENT_CLASSES[attention.module]
    if use_transformer_engine and getattr(config, "qk_layernorm", False):
        backend = TESpecProvider()
        attention.submodules.kv_layernorm = backend.layer_norm(
            rms_norm=getattr(config, "normalization", "RMSNorm") == "RMSNorm", for_qk=True
        )
        attention.submodules.linear_kv_up_proj = backend.column_parallel_linear()
        spec.submodules.sharded_state_dict_keys_map = {
            **spec.submodules.sharded_state_dict_keys_map,
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        }
    return spec


def latent_ring_refusals(config, module) -> list[str]:
    """What a latent-ring MLA layer cannot honour, by setting (empty when all is fine)."""
    problems = []
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        problems.append(
            f"fp8={config.fp8!r} / fp4={config.fp4!r}: the latent ring runs the K/V up-projection itself, "
            f"in the activation dtype, where linear_kv_up_proj would run it quantized; use "
            f"cp_2d_mla_ring='expanded'"
        )
    if config.apply_rope_fusion:
        problems.append(
            "apply_rope_fusion=True: the latent ring applies RoPE to the rope key with Megatron's unfused "
            "function (the fused MLA kernel takes the up-projected K/V); set apply_rope_fusion=False "
            "(--no-rope-fusion)"
        )
    if config.recompute_granularity == "selective" and "mla_up_proj" in (config.recompute_modules or []):
        problems.append(
            "recompute_modules 'mla_up_proj': with cp_2d_mla_ring='latent' the K/V up-projection runs "
            "inside the ring and keeps nothing to recompute; drop 'mla_up_proj' from --recompute-modules"
        )
    if hasattr(module.linear_kv_up_proj, "layer_norm_weight"):
        problems.append(
            "linear_kv_up_proj fuses the kv layernorm (a layernorm+linear module), which must run before "
            "the latent travels; build the layer with megatron_2d's spec (get_gpt_layer_spec_2d)"
        )
    if "latent" not in inspect.signature(module.core_attention.forward).parameters:
        problems.append(
            f"core attention {type(module.core_attention).__name__} has no latent ring; use "
            f"CoreAttention2D (get_gpt_layer_spec_2d)"
        )
    return problems


def after_forward_pre_hooks(module: torch.nn.Module) -> torch.nn.Module:
    """``module``, after running its forward pre-hooks (the global ones first, as ``module(...)`` does) without its
    forward, for parameters read by another computation. Called with no inputs: a hook's replacement inputs are
    not used. Megatron's DDP finishes the parameter all-gather of ``module`` here (``finish_param_sync``)."""
    args, kwargs = (), {}
    for hook_id, hook in (*_global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, args, kwargs)
        else:
            hook(module, args)
    return module


class LatentRingMixin:
    """The latent-ring forward for Megatron's MLA self-attention classes (see the module docstring)."""

    def _check_latent_ring(self) -> None:
        problems = latent_ring_refusals(self.config, self)
        if problems:
            raise ValueError("settings not supported with cp_2d_mla_ring='latent':\n  " + "\n  ".join(problems))

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        position_ids=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """[s, b, h] -> ([s, b, h], bias), as MLASelfAttention, with the latent on the context ring."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("cp_2d_mla_ring='latent' is for training; run inference with cp_2d_mla_ring='expanded'")
        if (
            key_value_states is not None
            or attention_bias is not None
            or rotary_pos_emb is not None
            or rotary_pos_cos is not None
            or rotary_pos_sin is not None
            or rotary_pos_cos_sin is not None
        ):
            raise ValueError(
                "MLA self attention takes no key_value_states, attention_bias or rotary embeddings (it makes its own)"
            )
        query, latent = self._query_and_latent(hidden_states, packed_seq_params)
        weight = after_forward_pre_hooks(self.linear_kv_up_proj).weight  # its all-gather done (DDP's hook)
        if self.checkpoint_core_attention and self.training:
            out = self._checkpointed_attention_forward(
                query, latent, weight, attention_mask, packed_seq_params=packed_seq_params
            )
        else:
            out = self._run_core_attention(query, latent, weight, attention_mask, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = out.reshape(out.size(0), 1, -1)  # [t, h * dv] -> [t, 1, h * dv]
        return self.linear_proj(out)

    def _run_core_attention(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **extra_kwargs,
    ):
        """Core attention of (query, latent, up-projection weight), passed as Megatron's (query, key, value) so that
        its selective core-attention checkpoint wraps the latent ring too; a module call (its forward pre-hooks
        run)."""
        return self.core_attention(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            latent=LatentDims(self.config.qk_head_dim, self.config.v_head_dim),
        )

    def _query_and_latent(self, hidden_states, packed_seq_params):
        """(query [s, b, n, qk + rope] after RoPE, latent [s, b, kv_lora_rank + rope]: the compressed KV after its
        layernorm and the rope key after RoPE), as Megatron's MLA computes them before its K/V up-projection
        ([t, ...] without the batch dim for THD)."""
        cfg = self.config
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rope_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, cfg, packed_seq_params)
        rotary = self.rotary_pos_emb(rope_len, packed_seq=thd)
        rotary, mscale = rotary if cfg.rope_type == "yarn" else (rotary, 1.0)
        cu_seqlens = None
        if thd:
            cu_seqlens = (
                packed_seq_params.cu_seqlens_q
                if packed_seq_params.cu_seqlens_q_padded is None
                else packed_seq_params.cu_seqlens_q_padded
            )

        q_compressed, kv_combined = self._qkv_down_projection(hidden_states)
        widths = [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim]
        sequence_parallel = cfg.sequence_parallel and get_pg_size(self.tp_group) > 1
        if kv_combined.size(-1) != sum(widths):  # column-parallel down projection
            kv_compressed, k_pos_emb = torch.split(gather_from_tensor_model_parallel_region(kv_combined), widths, -1)
            if cfg.sequence_parallel:
                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
        else:
            kv_compressed, k_pos_emb = torch.split(kv_combined, widths, -1)
            if sequence_parallel:
                k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)
        if packed_seq_params is not None:  # THD: [t, 1, ...] -> [t, ...]
            q_compressed, kv_compressed, k_pos_emb = (x.squeeze(1) for x in (q_compressed, kv_compressed, k_pos_emb))
        if cfg.q_lora_rank is not None:
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_compressed))
        else:
            q, _ = self.linear_q_proj(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)  # [s, b, n, qk + rope]
        if packed_seq_params is None or cfg.context_parallel_size == 1:
            rotary = rotary[: q.shape[0]]
        rope = dict(
            config=cfg,
            cu_seqlens=cu_seqlens,
            mscale=mscale,
            cp_group=self.pg_collection.cp,
            mla_rotary_interleaved=True,
        )
        q_nope, q_rope = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        query = torch.cat([q_nope, apply_rotary_pos_emb(q_rope, rotary, **rope)], dim=-1)
        k_rope = apply_rotary_pos_emb(k_pos_emb.unsqueeze(-2), rotary, **rope).squeeze(-2)  # [s, b, rope]
        # the latent as linear_kv_up_proj (column parallel) takes it: gradient summed over TP
        latent = self.kv_layernorm(kv_compressed)
        latent = (
            gather_from_sequence_parallel_region(latent, group=self.tp_group)
            if sequence_parallel
            else copy_to_tensor_model_parallel_region(latent, group=self.tp_group)
        )
        return query.contiguous(), torch.cat([latent, k_rope], dim=-1)


class MLASelfAttention2D(LatentRingMixin, MLASelfAttention):
    """Megatron's MLASelfAttention (same parameters, checkpoint keys and queries) with the latent on the 2D ring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._check_latent_ring()


class FusedMLASelfAttention2D(LatentRingMixin, FusedMLASelfAttention):
    """Megatron's FusedMLASelfAttention (fused q/kv down projection) with the latent on the 2D ring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._check_latent_ring()


LATENT_CLASSES = {MLASelfAttention: MLASelfAttention2D, FusedMLASelfAttention: FusedMLASelfAttention2D}
