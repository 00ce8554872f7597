"""QK-clip (MuonClip) after the optimizer step: megatron-core's ``clip_qk``, for the models it cannot reach itself.

Megatron-LM's training loop calls ``megatron.core.optimizer.qk_clip.clip_qk(model, log_max_only)`` after
``optimizer.step()``: per attention layer it all-reduces (MAX) ``core_attention.current_max_attn_logits`` over the
data-parallel x context-parallel group, calls the layer's own ``self_attention.clip_qk()`` (GQA: W_q by eta^alpha
and W_k by eta^(1 - alpha) per query group, eta = min(threshold / max, 1); MLA: q_nope, q_pe and k_nope per head),
which resets the max, and returns the largest max for the log. In megatron-core 0.19.2 three kinds of model stop it
(tests/test_qk_clip.py shows each, on CPU ranks):

    fp32 training (no Float16Module)    the loop reads ``model_chunk.module.module.decoder``: AttributeError
    HybridModel with Mamba / GDN layers  the loop reads every layer's ``self_attention``: AttributeError
    GQA / MHA at TP > 1                  ``SelfAttention._clip_linear_qkv`` views linear_qkv's weight with the whole
                                         model's query and K/V projection sizes, where the weight holds one TP
                                         rank's share: RuntimeError (a size mismatch)
    bf16 + the distributed optimizer     the layer's clip rewrites ``weight.main_param`` as a whole weight, but the
                                         optimizer holds this rank's flat shard of it (RuntimeError) or None on a
                                         rank that holds none of it (AttributeError)

:func:`clip_qk` runs megatron-core's own ``clip_qk`` (the same reduction, log value and layer math) one attention
layer at a time, each presented as the structure it reads. For the call the layer is lent what its clip needs:
this TP rank's projection sizes (``query_projection_size``, ``kv_projection_size``), and under the distributed
optimizer, for each sharded parameter, a whole fp32 ``main_param``: the model weight in fp32 with this rank's shard
in its place (the shard's range from Megatron's own ``DistributedOptimizer._build_model_gbuf_range``), whose part
goes back into the shard after it. The clip scales each weight row by one factor, so the shard gets exactly what a
whole fp32 main weight would. One layer is lent at a time (a transient fp32 copy of one layer's attention weights).

The entry routes use it: :func:`megatron_2d.megatron.arguments.use_clip_qk_2d` makes it the training loop's
``clip_qk`` for a 2d launch that asks for QK-clip or the max-logit log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import torch


def language_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel / HybridModel inside a model chunk's wrappers (DDP, megatron-fsdp, Float16Module)."""
    module = chunk
    while not hasattr(module, "decoder"):
        if not hasattr(module, "module"):
            raise ValueError(f"no decoder inside the model chunk {type(chunk).__name__} (its wrappers end at {module})")
        module = module.module
    return module


def attention_layers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``chunk`` that have self attention (Mamba / GDN layers have none)."""
    return [layer for layer in language_model(chunk).decoder.layers if hasattr(layer, "self_attention")]


def shard_ranges(chunk: torch.nn.Module) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """{parameter: [start, end) of this rank's distributed-optimizer shard within the flattened parameter} for the
    parameters of a Megatron-DDP chunk that have one here, by Megatron's own range arithmetic."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ranges = {}
    buffers = [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]
    for buffer in buffers:
        for bucket in range(len(buffer.buckets)):
            for param, where in DistributedOptimizer._build_model_gbuf_range(buffer, bucket)["param_map"].items():
                ranges[param] = (where["param"].start, where["param"].end)
    return ranges


@contextlib.contextmanager
def whole_main_params(module: torch.nn.Module, ranges: dict) -> Iterator[None]:
    """Lend every parameter of ``module`` whose ``main_param`` is a distributed-optimizer shard (or None) a whole fp32
    main param for the block; then copy this rank's part back into its shard (see the module)."""
    lent = []
    for param in module.parameters():
        if not getattr(param, "main_param_sharded", False):
            continue
        shard = param.main_param
        whole = param.detach().float().clone()
        if shard is not None:
            start, end = ranges[param]
            whole.view(-1)[start:end] = shard.view(-1)
        lent.append((param, shard, whole))
        param.main_param = whole
    try:
        yield
    finally:
        for param, shard, whole in lent:
            if shard is not None:
                start, end = ranges[param]
                shard.view(-1).copy_(whole.view(-1)[start:end])
            param.main_param = shard


@contextlib.contextmanager
def partition_projection_sizes(attention: torch.nn.Module) -> Iterator[None]:
    """Lend a GQA / MHA self attention this TP rank's query and K/V projection sizes (its clip's view of linear_qkv;
    see the module) for the block; nothing for attention without ``_clip_linear_qkv`` (MLA's clip reads per-partition
    sizes itself)."""
    if not hasattr(attention, "_clip_linear_qkv"):
        yield
        return
    head_dim = attention.hidden_size_per_attention_head
    whole = {name: attention.__dict__[name] for name in ("query_projection_size", "kv_projection_size")}
    attention.query_projection_size = attention.num_attention_heads_per_partition * head_dim
    attention.kv_projection_size = attention.num_query_groups_per_partition * head_dim
    try:
        yield
    finally:
        attention.__dict__.update(whole)


def _as_megatron_reads_it(layer: torch.nn.Module) -> SimpleNamespace:
    """One decoder layer as the model chunk megatron-core's clip_qk walks (``.module.module.decoder.layers``)."""
    return SimpleNamespace(module=SimpleNamespace(module=SimpleNamespace(decoder=SimpleNamespace(layers=[layer]))))


def clip_qk(model: Sequence[torch.nn.Module], log_max_only: bool = False) -> float:
    """megatron-core's ``clip_qk(model, log_max_only)`` for every model chunk of ``model`` (see the module): the
    largest max attention logit over the chunks' attention layers (0 when none has one), after clipping each
    layer (unless ``log_max_only``) and resetting its max. Collective over each layer's data-parallel x
    context-parallel group, as megatron-core's."""
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk

    largest = 0.0
    for chunk in model:
        ranges = None
        for layer in attention_layers(chunk):
            attention = layer.self_attention
            with contextlib.ExitStack() as lent:
                if not log_max_only and any(getattr(p, "main_param_sharded", False) for p in attention.parameters()):
                    ranges = shard_ranges(chunk) if ranges is None else ranges
                    lent.enter_context(whole_main_params(attention, ranges))
                if not log_max_only:
                    lent.enter_context(partition_projection_sizes(attention))
                largest = max(largest, megatron_clip_qk([_as_megatron_reads_it(layer)], log_max_only=log_max_only))
    return largest
