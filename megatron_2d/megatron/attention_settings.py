"""Every megatron-core TransformerConfig field, as the 2d core attention treats it: honoured, refused, or outside.

A field we do not read but that changes attention's math would be a silent wrong answer, so each field of
megatron-core 0.19's TransformerConfig is classified here, and tests/test_attention_settings.py fails when a
megatron-core upgrade adds one that is not (classify it here: honour it, refuse it, or record why core attention
never sees it).

    HONOURED   read by CoreAttention2D / the op (or provably without effect on its math), with how
    REFUSED    a value that would change the math and is not implemented: refused at config build and at model
               construction, on every rank, naming the setting and what would work (:func:`attention_refusals`)
    OUTSIDE    applied by Megatron before or after core attention (projections, norms, RoPE, MoE, pipeline,
               optimizer, fusions, inference), so the 2d backend inherits Megatron's own handling

CUDA graphs: training graphs that capture core attention are refused (cuda_graph_impl, with cuda_graph_modules);
graphs that leave attention out are fine. Inference graphs (inference_cuda_graph_scope) and any other capture are
caught at run time: attention_2d refuses to run while the current CUDA stream is capturing.

Arguments of core attention's forward: ``attention_mask`` is read as Transformer Engine's backend reads it (the
mask type decides: causal and no_mask need no tensor; document masks come as packed_seq_params); packed_seq_params
in THD format is honoured (packed documents; each PackedSeqParams field is classified in ``PACKED_SEQ_PARAMS``);
``attention_bias``, other qkv formats and mask types other than causal / no_mask are refused.
"""

from __future__ import annotations

from collections.abc import Callable

HONOURED: dict[str, str] = {
    "context_parallel_size": "CP = hp x cp of the 2D layout",
    "cp_comm_type": "'2d' selects this backend (per-layer lists: other layers run TE's CP)",
    "hierarchical_context_parallel_sizes": "[hp, cp] when cp_2d_head_parallel_size is not given",
    "num_attention_heads": "query heads (split over TP, then over the head group)",
    "num_query_groups": "K/V heads (GQA; replicated when hp exceeds them)",
    "kv_channels": "head dim of q/k/v",
    "tensor_model_parallel_size": "heads per TP rank",
    "softmax_scale": "the scale (default 1/sqrt(kv_channels)); mup settings arrive through it",
    "use_mup": "through softmax_scale (computed in TransformerConfig.__post_init__)",
    "mup_base_head_dim": "through softmax_scale",
    "mup_attn_scale_power": "through softmax_scale",
    "softmax_type": "'off-by-one' and 'learnable' as attention sinks (same softmax_offset parameter and key)",
    "qk_clip": "the op returns each head's max attention logit over the CP group (return_max_logit); core attention "
    "keeps current_max_attn_logits as TEDotProductAttention does, for Megatron's clip_qk",
    "log_max_attention_logit": "as qk_clip: current_max_attn_logits for Megatron's logging",
    "window_size": "sliding window (left, right), TE's convention, on every windowed layer",
    "window_attn_skip_freq": "which layers are windowed (megatron's is_layer_window_attention)",
    "apply_query_key_layer_scaling": "no effect on the math: Megatron divides the scale by the layer number and "
    "multiplies the scores back in the softmax; the op's scores are fp32",
    "attention_softmax_in_fp32": "always: the op's softmax, lse and accumulators are fp32 (fp64 for fp64)",
    "fp16": "input dtype",
    "bf16": "input dtype",
    "params_dtype": "dtype of the softmax_offset parameter",
    "attention_backend": "no effect on the math: the 2d backend picks its block kernel by device",
    "flash_attention_version": "no effect on the math (kernel choice)",
    "masked_softmax_fusion": "no effect on the math (fusion choice)",
    "recompute_granularity": "full recompute works; Selective Checkpoint++ keeps attention instead",
    "recompute_modules": "'core_attn' re-runs CoreAttention2D under Megatron's checkpoint",
    "perform_initialization": "softmax_offset initialised as Megatron's DotProductAttention does",
    "init_method": "softmax_offset's initialisation",
    "use_cpu_initialization": "softmax_offset created on CPU when set",
    "multi_latent_attention": "MLA: Megatron's MLASelfAttention with CoreAttention2D (q/k head dim != v head dim, K "
    "and V sent unpadded); cp_2d_mla_ring chooses per-head K/V or the latent on the ring",
    "cuda_graph_modules": "decides whether training graphs capture core attention (see cuda_graph_impl)",
    "enable_cuda_graph": "deprecated: megatron's __post_init__ turns it into cuda_graph_impl='local' (checked)",
    "external_cuda_graph": "deprecated: megatron's __post_init__ turns it into cuda_graph_impl='transformer_engine' "
    "(checked)",
    "cuda_graph_scope": "deprecated: megatron's __post_init__ moves it to cuda_graph_modules (checked)",
    "hybrid_context_parallel": "hybrid (dynamic) CP: each micro-batch runs on its own CP group with its size's 2D "
    "layout (megatron_2d.megatron.dynamic; what it cannot run is refused there)",
}

# MLATransformerConfig's own fields (megatron-core 0.19.2), classified the same way
MLA_HONOURED: dict[str, str] = {
    "qk_head_dim": "q/k head dim (with qk_pos_emb_head_dim); the latent ring's K up-projection width",
    "qk_pos_emb_head_dim": "the rope part of q/k; the latent ring carries the rope key once per token",
    "v_head_dim": "value head dim (may differ from q/k's; no padding on the wire)",
    "kv_lora_rank": "the latent's width (what the latent ring carries)",
    "mla_down_proj_fusion": "FusedMLASelfAttention: its own down projection; the latent ring keeps it",
    "mscale": "through the softmax_scale MLA passes to core attention (YaRN)",
    "mscale_all_dim": "through the softmax_scale MLA passes to core attention (YaRN)",
    "rope_type": "'rope' and 'yarn': applied by Megatron's MLA before core attention (the latent ring applies the "
    "rope key's RoPE with Megatron's own function, at each token's true position)",
}
MLA_REFUSED: dict[str, str] = {
    "cache_mla_latents": "caching MLA latents is for Megatron's dynamic inference backend (core attention then gets "
    "latents, not K/V); set cache_mla_latents=False",
}
MLA_OUTSIDE = tuple(
    """
    q_lora_rank rotary_base rotary_percent rotary_scaling_factor original_max_position_embeddings beta_fast
    beta_slow
""".split()
)


def _is_set(name: str) -> Callable[[object], bool]:
    return lambda config: bool(getattr(config, name, None))


_KITCHEN = "kitchen attention replaces core attention; it cannot run with cp_comm_type '2d'"
# name -> why a set (truthy) value is refused, and what would work
_REFUSED_WHEN_SET: dict[str, str] = {
    "attention_dropout": "attention dropout is not supported by the 2d backend (it would be silently ignored); "
    "set attention_dropout=0.0 (--attention-dropout 0)",
    "experimental_attention_variant": "experimental attention variants (gated_delta_net, dsa) are not supported by "
    "the 2d backend; leave experimental_attention_variant unset",
    "use_kitchen_attention": _KITCHEN,
    "deterministic_mode": "deterministic mode is not guaranteed by the 2d backend (flash-attn's backward adds dq "
    "with atomics); set deterministic_mode=False",
}


def cuda_graph_captures_attention(config) -> bool:
    """Whether megatron's training CUDA graphs would capture core attention: a full-iteration graph, or per-layer
    graphs (local / transformer_engine) of the whole layer (cuda_graph_modules empty) or of its attention."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph", False):
        impl = "local"  # before megatron's __post_init__ migrates them
    if impl in (None, "none"):
        return False
    if impl == "full_iteration":
        return True
    modules = getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None) or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    names = [getattr(m, "name", str(m)) for m in modules]
    return names in ([], ["full"]) or "attn" in names or "full_iteration" in names


def _cuda_graph_refusal(config) -> str:
    modules = [getattr(m, "name", m) for m in (getattr(config, "cuda_graph_modules", None) or [])]
    scope = (
        "a full-iteration graph"
        if getattr(config, "cuda_graph_impl", None) == "full_iteration"
        else f"cuda_graph_modules={modules} ({'the whole layer' if not modules else 'attention included'})"
    )
    return (
        f"CUDA graphs capturing core attention ({scope}) cannot replay the 2d backend: its point-to-point "
        f"rings, per-batch calls and first-call setup run on the host; keep attention out of the graph "
        f"(cuda_graph_modules without 'attn', e.g. ['mlp'] or ['moe_router', 'moe_preprocess']: "
        f"--cuda-graph-modules mlp) or set cuda_graph_impl='none'"
    )


def _fp8_attention_refusal(what: str, name: str, hint: str = "") -> Callable[[object], str]:
    """Why FP8 attention is refused, and with QK-clip on, that Transformer Engine has no backend for it either."""

    def why(config) -> str:
        text = f"{what} is not implemented by the 2d backend; set {name}=False{hint}"
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            text += (
                " (with qk_clip / log_max_attention_logit no backend runs it: Transformer Engine switches every "
                "attention backend off for the max logit under FP8 attention)"
            )
        return text

    return why


# name -> (when it is refused, why and what would work; a callable gets the config)
REFUSED: dict[str, tuple] = {name: (_is_set(name), why) for name, why in _REFUSED_WHEN_SET.items()}
REFUSED["fp8_dot_product_attention"] = (
    _is_set("fp8_dot_product_attention"),
    _fp8_attention_refusal("fp8 dot-product attention", "fp8_dot_product_attention", " (fp8 linear layers are fine)"),
)
REFUSED["fp8_multi_head_attention"] = (
    _is_set("fp8_multi_head_attention"),
    _fp8_attention_refusal("fp8 multi-head attention", "fp8_multi_head_attention"),
)
REFUSED["kitchen_attention_backend"] = (_is_set("use_kitchen_attention"), _KITCHEN)
REFUSED.update({name: (_is_set(name), why) for name, why in MLA_REFUSED.items()})
REFUSED["cuda_graph_impl"] = (cuda_graph_captures_attention, _cuda_graph_refusal)

OUTSIDE = tuple(
    """
    tensor_parallel_num_weight_shards gtp_weight_remat_size pipeline_model_parallel_comm_backend
    pipeline_model_parallel_size virtual_pipeline_model_parallel_size sequence_parallel
    max_seqlen_per_dp_cp_rank expert_model_parallel_size expert_tensor_parallel_size
    expert_tensor_parallel_num_weight_shards expert_gtp_weight_remat_size timers finalize_model_grads_func
    grad_scale_func moe_grad_scale_func mtp_grad_scale_func no_sync_func grad_sync_func param_sync_func
    enable_autocast autocast_dtype num_microbatches_with_partial_activation_checkpoints
    gradient_accumulation_fusion use_te_rng_tracker tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad
    tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag
    tp_comm_split_rs tp_comm_atomic_rs cross_entropy_loss_fusion cross_entropy_fusion_impl
    tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend
    overlap_moe_expert_parallel_comm delay_wgrad_compute overlap_dispatch_backward_with_experts_wgrad
    ep_overlap_early_attn_memory_release pipeline_dtype variable_seq_lengths overlap_p2p_comm batch_p2p_comm
    batch_p2p_sync use_ring_exchange_p2p deallocate_pipeline_outputs defer_embedding_wgrad_compute
    wgrad_deferral_limit overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage mtp_standalone
    cpu_offloading cpu_offloading_num_layers _cpu_offloading_context cpu_offloading_activations
    cpu_offloading_weights cpu_offloading_double_buffering cpu_offloading_retain_pinned_cpu_buffers
    barrier_with_L1_time num_layers mtp_num_layers mtp_loss_scaling_factor mtp_use_repeated_layer
    mtp_detach_heads mtp_hybrid_override_pattern num_layers_in_first_pipeline_stage
    num_layers_in_last_pipeline_stage pipeline_model_parallel_layout account_for_embedding_in_pipeline_split
    account_for_loss_in_pipeline_split hidden_size ffn_hidden_size hidden_dropout fp32_residual_connection
    apply_residual_connection_post_layernorm layernorm_epsilon layernorm_zero_centered_gamma add_bias_linear
    add_qkv_bias gated_linear_unit activation_func activation_func_fp8_input_store glu_linear_offset
    activation_func_clamp_value num_moe_experts rotary_interleaved normalization qk_layernorm qk_l2_norm
    qk_clip_alpha qk_clip_threshold attention_output_gate test_mode calculate_per_token_loss no_rope_freq
    experimental_attention_variant_loss_scale_func dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk
    dsa_indexer_topk_freq dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
    dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
    dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 linear_attention_freq linear_conv_kernel_dim
    linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads
    output_layer_init_method init_method_std embedding_init_method embedding_init_method_std
    init_model_with_meta_device mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult
    disable_bf16_reduced_precision_matmul bias_activation_fusion persist_layer_norm memory_efficient_layer_norm
    bias_dropout_fusion apply_rope_fusion use_fused_weighted_squared_relu fused_single_qkv_rope
    fused_residual_rmsnorm use_transformer_engine_op_fuser recompute_method recompute_num_layers
    distribute_saved_activations fp8 fp8_recipe fp8_param fp8_quantizer_factory fp8_margin fp8_interval
    fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad fp8_output_proj tp_only_amax_red first_last_layers_bf16
    num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen fp4 fp4_recipe fp4_param
    fp4_quantizer_factory high_priority_a2a_comm_stream moe_shared_expert_intermediate_size
    moe_shared_expert_gate moe_shared_expert_overlap use_grouped_gemm_for_shared_expert
    moe_shared_expert_glu_interleave_size moe_layer_freq moe_ffn_hidden_size moe_router_load_balancing_type
    moe_router_topk moe_enable_routing_replay moe_router_topk_limited_devices
    moe_router_padding_for_quantization moe_router_padding_for_fp8 moe_router_num_groups moe_router_group_topk
    moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_score_function moe_router_dtype
    moe_router_enable_expert_bias moe_router_bias_update_rate moe_router_quantile_balancing_ema
    moe_router_force_load_balancing moe_router_force_biased use_grouped_gemm_for_dense_mlp moe_grouped_gemm
    moe_single_grouped_weight moe_single_grouped_bias moe_aux_loss_coeff moe_z_loss_coeff moe_input_jitter_eps
    moe_token_dropping moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend
    moe_permute_fusion_into_hybridep moe_hybridep_pad_uneven_dispatch_inputs moe_per_layer_logging
    moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference
    moe_token_drop_policy moe_layer_recompute moe_permute_fusion moe_router_fusion moe_apply_probs_on_input
    moe_latent_size moe_flex_dispatcher_num_sms moe_deepep_num_sms moe_hybridep_num_sms
    moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing
    moe_ncclep_static_shape moe_ncclep_zero_copy moe_mlp_glu_interleave_size moe_expert_rank_capacity_factor
    cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps inference_cuda_graph_scope
    clone_scatter_output_in_embedding disable_parameter_transpose_cache config_logger_dir flash_decode
    batch_invariant_mode use_te_activation_func inference_rng_tracker inference_sampling_seed symmetric_ar_type
    nccl_all_reduce_for_prefill use_inference_optimized_layers inference_fuse_tp_communication
    inference_disable_triton_nvls_kernels inference_grouped_gemm_backend
    inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type mrope_section is_hybrid_model
    mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads mamba_training_ssm_states_dtype
    use_mamba_mem_eff_path mlp_chunks_for_prefill mlp_chunks_for_training heterogeneous_block_specs
    hetereogenous_dist_checkpoint quant_recipe transformer_impl fine_grained_activation_offloading
    offload_modules min_offloaded_tensor_size delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
    activation_offload_fraction moe_paged_stash moe_paged_stash_page_size
    moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu
    fine_grained_offloading_max_inflight_offloads
""".split()
)


def attention_refusals(config) -> list[str]:
    """Messages for every setting of ``config`` the 2d backend refuses (empty when all is fine)."""
    return [
        f"{name}={getattr(config, name, None)!r}: {why(config) if callable(why) else why}"
        for name, (refused, why) in REFUSED.items()
        if refused(config)
    ]


def check_attention_settings(config) -> None:
    """Raise ValueError naming every refused setting of ``config``."""
    problems = attention_refusals(config)
    if problems:
        raise ValueError("settings not supported with cp_comm_type '2d':\n  " + "\n  ".join(problems))


# -- packed_seq_params (a forward argument): every field of megatron-core 0.19.2's PackedSeqParams ------------------
PACKED_SEQ_PARAMS: dict[str, str] = {
    "qkv_format": "honoured: 'thd' runs packed documents; other formats are refused",
    "cu_seqlens_q": "honoured: the real document boundaries (zigzag and sequence layouts)",
    "cu_seqlens_kv": "honoured: must equal cu_seqlens_q (self attention), else refused",
    "cu_seqlens_q_padded": "honoured: Megatron's per-document padding (zigzag layout)",
    "cu_seqlens_kv_padded": "honoured: must equal cu_seqlens_q_padded, else refused",
    "max_seqlen_q": "no effect on the math: the layout knows every length (RoPE reads it outside)",
    "max_seqlen_kv": "no effect on the math (as max_seqlen_q)",
    "local_cp_size": "honoured under hybrid_context_parallel: picks the micro-batch's CP group size and layout "
    "(through the 2d spec's SelfAttention2D; refused on a batch that bypasses it)",
    "cp_group": "honoured under hybrid_context_parallel: checked to be this rank's hybrid group of that size",
    "total_tokens": "no effect: Mamba bookkeeping (seq_idx)",
    "seq_idx": "no effect: Mamba's per-token sequence index",
    "tokens_per_sample": "no effect: Megatron's per-sample length, for its statistics",
    "pad_between_seqs": "no effect: the padding is explicit in cu_seqlens vs cu_seqlens_padded",
}


def same_values(a, b) -> bool:
    """Whether two cu_seqlens (tensors or arrays) hold the same values. Compared where they live: two device
    tensors on the device (one device-to-host read of the verdict); callers skip it when a is b (Megatron passes
    one tensor as both q and kv: no read at all)."""
    import torch

    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        return False
    return bool(torch.equal(a, b.to(a.device)))


def packed_seq_refusals(params) -> list[str]:
    """Why ``params`` (a PackedSeqParams) cannot run under the 2d backend; empty when it can."""

    def same(a, b) -> bool:
        return a is b or (a is not None and b is not None and same_values(a, b))

    problems = []
    if params.qkv_format != "thd":
        problems.append(
            f"packed_seq_params with qkv_format {params.qkv_format!r} is not supported by the 2d "
            f"backend; packed documents come as 'thd'"
        )
    if params.cu_seqlens_kv is not None and not same(params.cu_seqlens_kv, params.cu_seqlens_q):
        problems.append(
            "cu_seqlens_kv differs from cu_seqlens_q: the 2d backend runs self attention over the same "
            "packed documents only"
        )
    if not same(params.cu_seqlens_kv_padded, params.cu_seqlens_q_padded):
        problems.append(
            "cu_seqlens_kv_padded differs from cu_seqlens_q_padded: the 2d backend runs self attention "
            "over one packed sharding"
        )
    for name in ("local_cp_size", "cp_group"):
        if getattr(params, name, None) is not None:
            problems.append(
                f"packed_seq_params.{name} is set (hybrid/dynamic context parallelism) on a batch the 2d backend "
                f"gets without its layout: hybrid CP runs with hybrid_context_parallel=True in the model config "
                f"and the 2d layer spec (its self attention, SelfAttention2D, lays each micro-batch out)"
            )
    return problems
