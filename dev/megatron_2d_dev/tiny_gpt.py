"""A tiny megatron-core GPTModel on forked CPU ranks, for parity tests and demos of context parallelism.

Run the functions below inside ``run_on_ranks`` (megatron_2d.testing.distributed): every rank calls
``init_parallel`` then builds the same model and batch; the helpers return results that are equal on
all ranks and comparable across parallel layouts.

    def case(rank, world_size):
        init_parallel(context_parallel_size=world_size)
        spec = local_spec_with_core_attention(MyCoreAttention)
        model = build_tiny_gpt(TinyGPTConfig(num_query_groups=2), spec)
        return forward_backward(model, synthetic_batch(TinyGPTConfig(num_query_groups=2)))

Notation: b micro-batch size, s full sequence length, cp context-parallel size, tp tensor-parallel size.

Layout independence (what makes CP>1 comparable to CP=1 exactly):
  * weights are drawn per parameter from a generator seeded by (seed, canonical name) in the full,
    unsharded shape and then sliced for this TP rank, so they do not depend on TP, PP or CP;
  * canonical names use global layer indices (``decoder.layers.<layer_number - 1>``), so a PP stage's
    parameters carry the names they have in the PP=1 model;
  * the loss is sum(per-token loss * loss_mask) / (tokens in the full batch); each CP rank backpropagates
    its share and the gradients of weights (all replicated over CP) are summed over the CP group, as
    Megatron's DDP does over its dp_cp group.
"""

from __future__ import annotations

import copy
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_2d.layout.topology import zigzag_chunks
from megatron_2d.megatron.data import get_batch_on_this_cp_rank_2d
from megatron_2d.megatron.process_groups import destroy_2d_groups
from megatron_2d.sequence_sharding import unshard_sequence
from megatron_2d.testing.distributed import GROUP_TIMEOUT
from megatron_2d_dev.megatron_cpu import cuda_to_cpu, model_parallel_cpu_manual_seed, shims_installed

Batch = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Parallel state
# --------------------------------------------------------------------------------------------------
def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    seed: int = 1234,
    **initialize_kwargs: Any,
) -> None:
    """(Re)initialize megatron's parallel state on this rank and seed its RNG tracker; ``initialize_kwargs`` go to
    megatron's ``initialize_model_parallel`` (e.g. ``num_distributed_optimizer_instances``).

    Call on every rank of an initialized gloo world (e.g. inside ``run_on_ranks``); the data-parallel
    size is whatever remains of the world. Calling it again replaces the previous layout, so one forked
    run can compare several layouts. The CPU shims must be installed first, by an explicit
    ``install_megatron_cpu_shims()`` (tests/conftest.py and the demo do; forked ranks inherit them).
    """
    if not shims_installed():
        raise RuntimeError(
            "tiny_gpt runs megatron-core on CPU ranks: call megatron_2d_dev.megatron_cpu."
            "install_megatron_cpu_shims() first (importing this module patches nothing)"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _drop_previous_layout()
    # destroy_model_parallel() (0.19.2) leaves the hierarchical CP groups set; clear them so a layout
    # without hierarchical CP does not report the previous layout's groups.
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=(
            list(hierarchical_context_parallel_sizes) if hierarchical_context_parallel_sizes else None
        ),
        create_gloo_process_groups=False,  # the default backend already is gloo
        distributed_timeout_minutes=round(GROUP_TIMEOUT.total_seconds() / 60),  # the world's: robust under load
        **initialize_kwargs,
    )
    model_parallel_cpu_manual_seed(seed)


def _drop_previous_layout() -> None:
    """Drop the previous layout: its 2D groups are destroyed (:func:`destroy_2d_groups`); Megatron's groups, which
    destroy_model_parallel() only forgets, are left to the rank's exit.

    Destroying a gloo group waits a tick of the device's event loop (~10 ms) per connected peer, and a layout has
    dozens of Megatron groups; left alive they cost nothing, as the forked ranks' groups share one gloo device
    (megatron_2d.testing.distributed: their idle threads wait on a condition, the device's one loop serves them all).
    """
    destroy_2d_groups()


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
@dataclass
class TinyGPTConfig:
    """Size of the tiny model and of its synthetic batch (parallel sizes come from parallel_state)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """None: multi-head attention; else GQA with this many K/V heads (divisible by tp)."""
    ffn_hidden_size: int | None = None
    """None: 4 * hidden_size."""
    vocab_size: int = 128
    seq_length: int = 64
    """Full sequence length s; must be divisible by 2 * cp."""
    micro_batch_size: int = 2
    seed: int = 1234
    """Seeds the weights (with each parameter's canonical name) and the synthetic batch."""
    position_embedding_type: str = "rope"
    cp_comm_type: str | list[str] | None = None
    """Passed to TransformerConfig; reaches the core_attention constructor when cp > 1."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra TransformerConfig fields (or fields of ``config_class``)."""
    config_class: type = TransformerConfig
    """A TransformerConfig subclass may add fields for a custom core attention."""


def make_transformer_config(cfg: TinyGPTConfig) -> TransformerConfig:
    """TransformerConfig for ``cfg`` and the current parallel_state (fp32, no dropout, no fusions)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    query_groups = cfg.num_query_groups or cfg.num_attention_heads
    if query_groups % tp:
        raise ValueError(f"num_query_groups={query_groups} must be divisible by tp={tp}")
    hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        hierarchical_context_parallel_sizes=([g.size() for g in hcp] if hcp else None),
        cp_comm_type=cfg.cp_comm_type,
        sequence_parallel=False,  # the torch norm asserts with SP: see megatron_2d_dev.sp_norms
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(cfg.config_overrides)
    return cfg.config_class(**kwargs)


def local_spec_with_core_attention(core_attention: Any | None = None, **spec_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec, with ``core_attention`` (a class or ModuleSpec) put into
    ``spec.submodules.self_attention.submodules.core_attention``. None keeps the local
    DotProductAttention (which only supports cp == 1)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(**spec_kwargs))
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


_LOCAL_EXPERT = re.compile(r"(.*\.experts)\.local_experts\.(\d+)\.(.*)")


def _global_expert(model: torch.nn.Module, name: str) -> str:
    """``name`` with a local expert's index made global under expert parallelism (EP rank x local experts + i)."""
    match = _LOCAL_EXPERT.match(name)
    if match is None or parallel_state.get_expert_model_parallel_world_size() == 1:
        return name
    experts, index, rest = match.groups()
    first = parallel_state.get_expert_model_parallel_rank() * model.get_submodule(experts).num_local_experts
    return f"{experts}.local_experts.{first + int(index)}.{rest}"


def canonical_name(model: torch.nn.Module, name: str) -> str:
    """The name parameter ``name`` of ``model`` (one pipeline stage or virtual chunk) has in the PP=1, EP=1 model:
    its decoder layer index made global (``decoder.layers.<layer_number - 1>``), and its expert index."""
    name = _global_expert(model, name)
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    layers = model.decoder.layers
    return f"decoder.layers.{layers[int(match.group(1))].layer_number - 1}.{match.group(2)}"


def canonical_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by the name they have in the PP=1 model (global decoder layer indices)."""
    return {canonical_name(model, name): param for name, param in model.named_parameters()}


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and (
        parallel_state.get_tensor_model_parallel_world_size() > 1
    )


def _full_value(name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Deterministic value of parameter ``name`` in its unsharded ``shape``.

    Matrices ~ N(0, 1/fan_in) (attention logits O(1), so broken attention shows in the loss), word
    embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * noise if ("norm" in name and name.endswith("weight")) else 0.1 * noise
    if "embedding" in name:
        return noise
    return noise / float(shape[1]) ** 0.5


@torch.no_grad()
def reset_parameters_deterministically(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with ``_full_value`` of its canonical name, sliced for this TP rank."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, param in canonical_parameters(model).items():
        if _is_tp_sharded(param):
            dim = param.partition_dim
            if getattr(param, "partition_stride", 1) != 1:
                raise NotImplementedError(f"{name}: partition_stride != 1")
            full_shape = list(param.shape)
            full_shape[dim] *= tp
            value = _full_value(name, full_shape, seed).chunk(tp, dim=dim)[tp_rank]
        else:
            value = _full_value(name, param.shape, seed)
        param.copy_(value)


def build_tiny_gpt(
    cfg: TinyGPTConfig,
    layer_spec: ModuleSpec | None = None,
    config: TransformerConfig | None = None,
    vp_stage: int | None = None,
) -> GPTModel:
    """Build the tiny GPTModel for this rank's PP stage (virtual stage ``vp_stage`` under interleaved PP), with
    layout-independent weights.

    ``layer_spec`` defaults to ``get_gpt_layer_local_spec()``; use ``local_spec_with_core_attention``
    to plug in a core attention. ``config``: the TransformerConfig to build from, made from ``cfg`` when None (pass
    the one a spec function was given, as Megatron's builder does). Embeddings and output layer are untied (no
    embedding group needed under PP). ``vp_stage``: the model chunk of this virtual pipeline stage (interleaved
    schedule: parallel state and ``cfg`` with virtual_pipeline_model_parallel_size; build one chunk per stage).
    """
    config = make_transformer_config(cfg) if config is None else config
    spec = layer_spec if layer_spec is not None else get_gpt_layer_local_spec()
    torch.manual_seed(cfg.seed)  # torch 2.13 seeds processes differently; megatron draws first
    virtual = dict(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(**virtual),
        post_process=parallel_state.is_pipeline_last_stage(**virtual),
        share_embeddings_and_output_weights=False,
        position_embedding_type=cfg.position_embedding_type,
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    reset_parameters_deterministically(model, cfg.seed)
    return model


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def synthetic_batch(cfg: TinyGPTConfig, step: int = 0) -> Batch:
    """Deterministic full (unsharded) batch: tokens, labels (next tokens), loss_mask, position_ids,
    each ``[b, s]``. Some trailing tokens of the last sample are masked out of the loss."""
    b, s = cfg.micro_batch_size, cfg.seq_length
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    stream = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen)
    loss_mask = torch.ones(b, s)
    loss_mask[-1, s - s // 8 :] = 0.0
    return {
        "tokens": stream[:, :-1].contiguous(),
        "labels": stream[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
    }


def shard_batch_for_cp(batch: Batch) -> Batch:
    """This CP rank's zigzag share of ``batch`` (chunks r and 2*cp-1-r of 2*cp), via megatron's
    ``get_batch_on_this_cp_rank`` (sequence length checked first); the input is not modified."""
    return get_batch_on_this_cp_rank_2d(batch, parallel_state.get_context_parallel_group())


def zigzag_chunk_ids(cp_rank: int, cp_size: int) -> list[int]:
    """Indices of the 2*cp sequence chunks that CP rank ``cp_rank`` holds, in its local order (topology's)."""
    return list(zigzag_chunks(cp_rank, cp_size))


def unshard_cp(per_rank: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of the zigzag split: ``per_rank[r]`` is CP rank r's local tensor (sequence_sharding's)."""
    return unshard_sequence(per_rank, seq_dim=seq_dim)


def _gather_cp_sequence(local: torch.Tensor, seq_dim: int) -> torch.Tensor:
    group = parallel_state.get_context_parallel_group()
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return unshard_cp(parts, seq_dim)


# --------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------
def all_reduce_grads_over_cp(model: torch.nn.Module) -> None:
    """Sum every parameter gradient over the CP group (all weights are replicated over CP)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return
    group = parallel_state.get_context_parallel_group()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def all_reduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Under sequence parallelism, sum over TP the gradients of parameters marked ``sequence_parallel`` (norms,
    duplicated linears: each TP rank saw its share of the sequence), as Megatron's ``finalize_model_grads`` does."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1 or not model.config.sequence_parallel:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if param.grad is not None and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=group)


def gather_over_tensor_parallel(grads: dict[str, tuple[torch.Tensor, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """{name: (this TP rank's tensor, its parameter)} -> {name: the tensor at the parameter's full shape},
    TP-sharded ones all-gathered over the TP group along their partition dim (the same names on every TP rank)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    out: dict[str, torch.Tensor] = {}
    for name, (grad, param) in grads.items():
        grad = grad.detach().contiguous()
        if _is_tp_sharded(param):
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad, group=group)
            grad = torch.cat(parts, dim=param.partition_dim)
        out[name] = grad.clone()
    return out


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's gradients keyed by canonical name, gathered over TP into unsharded tensors.

    Call after ``all_reduce_grads_over_cp``. Parameters without a gradient get zeros.
    """
    return gather_over_tensor_parallel(
        {
            name: (param.grad if param.grad is not None else torch.zeros_like(param), param)
            for name, param in canonical_parameters(model).items()
        }
    )


def full_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """This stage's parameters by canonical name, with their full (TP-unsharded) shapes."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in canonical_parameters(model).items():
        shape = list(param.shape)
        if _is_tp_sharded(param):
            shape[param.partition_dim] *= tp
        out[name] = tuple(shape)
    return out


def merge_over_expert_parallel(local: dict[str, Any]) -> dict[str, Any]:
    """The union of every expert-parallel rank's ``local`` dict (collective over the EP group): each holds its own
    experts."""
    size = parallel_state.get_expert_model_parallel_world_size()
    if size == 1:
        return local
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, local, group=parallel_state.get_expert_model_parallel_group())
    merged: dict[str, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged


def merge_over_pipeline(local: dict[str, Any]) -> dict[str, Any]:
    """The union of every pipeline stage's ``local`` dict (collective over the PP group)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    gathered: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(gathered, local, group=parallel_state.get_pipeline_model_parallel_group())
    merged: dict[str, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged


# --------------------------------------------------------------------------------------------------
# Forward + backward, training
# --------------------------------------------------------------------------------------------------
def _run_on_cp_shard(model: torch.nn.Module, batch: Batch) -> tuple:
    """(per-token loss [b, s/cp], this rank's CP shard of ``batch``)."""
    local = shard_batch_for_cp(batch)
    per_token = model(
        input_ids=local["tokens"],
        position_ids=local["position_ids"],
        attention_mask=None,
        labels=local["labels"],
    )
    return per_token, local


def _local_loss(model: GPTModel, batch: Batch) -> tuple:
    """(sum over this rank's tokens of masked per-token loss, local per-token loss [b, s/cp])."""
    per_token, local = _run_on_cp_shard(model, batch)
    return (per_token.float() * local["loss_mask"]).sum(), per_token


def cp_sum(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(value, group=parallel_state.get_context_parallel_group())
    return value


def forward_backward(model: GPTModel, batch: Batch) -> dict[str, Any]:
    """One forward and backward of ``batch`` (full, unsharded) on a PP=1 model.

    Returns, identical on every rank:
      ``loss``           sum(per-token loss * mask) / mask.sum() over the full batch (0-dim tensor);
      ``per_token_loss`` ``[b, s]`` in full sequence order;
      ``grads``          {canonical name: full gradient of ``loss``}, summed over CP, gathered over TP;
      ``grad_norm``      the gradient norm Megatron's optimizer computes (:func:`megatron_grad_norm`).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("forward_backward needs PP=1; use pipeline_forward_backward")
    model.zero_grad(set_to_none=True)
    num_tokens = batch["loss_mask"].sum()
    local_sum, per_token = _local_loss(model, batch)
    (local_sum / num_tokens).backward()
    all_reduce_grads_over_cp(model)
    all_reduce_sequence_parallel_grads(model)
    return {
        "loss": cp_sum(local_sum) / num_tokens,
        "per_token_loss": _gather_cp_sequence(per_token, seq_dim=1),
        "grads": full_gradients(model),
        "grad_norm": megatron_grad_norm(model),
    }


def megatron_thd_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None, total_tokens=None):
    """PackedSeqParams of a packed THD stream as Megatron's forward steps build them: ``cu_seqlens`` the document
    bounds attention gets (the real ones, or the padded ones as pretrain_gpt.py passes them), ``cu_seqlens_padded``
    the padded slots' (None: unpadded), the longest slot as max_seqlen."""
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    longest = int((slots[1:] - slots[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        total_tokens=total_tokens,
    )


def thd_batch_on_this_cp_rank(batch: Batch, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> Batch:
    """This CP rank's share of a packed ``batch`` ([1, T] tensors, documents padded to ``cu_seqlens_padded``) by
    Megatron's per-document zigzag split (:func:`megatron_2d.megatron.packed_data.get_thd_batch_on_this_cp_rank_2d`,
    Transformer Engine's partitioning, as pretrain_gpt.py's --sft batches)."""
    from megatron_2d.megatron.packed_data import get_thd_batch_on_this_cp_rank_2d

    split = dict(batch, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    return get_thd_batch_on_this_cp_rank_2d(split, parallel_state.get_context_parallel_group())


def packed_forward_backward(model: GPTModel, local: Batch, params) -> dict[str, Any]:
    """One forward and backward of this CP rank's share ``local`` of a packed batch with ``params`` (PP = 1):
    ``loss`` (the CP group's sum of masked per-token losses / its masked tokens), ``grads`` (full, summed over
    CP), ``grad_norm`` (:func:`megatron_grad_norm`) and ``per_token_finite``, identical on every rank."""
    model.zero_grad(set_to_none=True)
    per_token = model(
        input_ids=local["tokens"],
        position_ids=local.get("position_ids"),
        attention_mask=None,
        labels=local["labels"],
        packed_seq_params=params,
    )
    total = cp_sum(local["loss_mask"].sum())
    local_sum = (per_token.float() * local["loss_mask"]).sum()
    (local_sum / total).backward()
    all_reduce_grads_over_cp(model)
    return {
        "loss": cp_sum(local_sum) / total,
        "grads": full_gradients(model),
        "grad_norm": megatron_grad_norm(model),
        "per_token_finite": bool(torch.isfinite(per_token).all()),
    }


def megatron_grad_norm(model: torch.nn.Module | Sequence[torch.nn.Module]) -> float:
    """The L2 norm of ``model``'s gradients (a model, or its virtual pipeline chunks; summed over CP already) as
    Megatron's optimizer computes it for clipping: its own filter (no shared parameters, no tensor-parallel
    duplicates) and ``get_grad_norm_fp32`` over the model-parallel group. A parameter with wrong TP attributes (a
    TP-sharded one counted on TP rank 0 only, a replicated one on every TP rank) changes it at TP > 1; the same on
    every rank."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.transformer.module import param_is_not_shared

    grads = [
        p.grad.float()
        for chunk in (model if isinstance(model, Sequence) else [model])
        for p in chunk.parameters()
        if p.grad is not None and param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
    ]
    with cuda_to_cpu():
        norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    return float(norm)


@dataclass
class TrainedSteps:
    """What :func:`train_steps` saw: each step's loss (before its update) and its gradient norm (Megatron's)."""

    losses: list[float]
    grad_norms: list[float]


def train_steps(
    model: GPTModel,
    cfg: TinyGPTConfig,
    steps: int = 3,
    optimizer: str = "adam",
    lr: float = 1e-2,
) -> TrainedSteps:
    """Train ``steps`` steps on ``synthetic_batch(cfg, step)`` with a torch.optim optimizer
    ("sgd" or "adam"), gradients summed over CP; returns each step's loss (before its update) and the gradient
    norm Megatron's optimizer would compute (:func:`megatron_grad_norm`)."""
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', not {optimizer!r}")
    run = TrainedSteps([], [])
    for step in range(steps):
        batch = synthetic_batch(cfg, step)
        opt.zero_grad(set_to_none=True)
        num_tokens = batch["loss_mask"].sum()
        local_sum, _ = _local_loss(model, batch)
        (local_sum / num_tokens).backward()
        all_reduce_grads_over_cp(model)
        all_reduce_sequence_parallel_grads(model)
        run.grad_norms.append(megatron_grad_norm(model))
        opt.step()
        run.losses.append(float(cp_sum(local_sum) / num_tokens))
    return run


def pipeline_forward_backward(
    model: GPTModel | Sequence[GPTModel], cfg: TinyGPTConfig, batch: Batch, num_microbatches: int = 2
) -> dict[str, Any]:
    """Forward and backward through megatron's ``get_forward_backward_func()`` schedule (1F1B under
    PP>1, interleaved for a list of virtual-stage chunks, no pipelining under PP=1), ``batch`` split into
    ``num_microbatches`` along b.

    Returns, identical on every rank: ``loss`` (mean over microbatches of each microbatch's masked
    mean loss), ``grads`` (all stages' gradients, summed over CP, gathered over TP, by canonical name) and
    ``grad_norm`` (:func:`megatron_grad_norm`).
    """
    chunks = list(model) if isinstance(model, Sequence) else [model]
    b = batch["tokens"].shape[0]
    if b % num_microbatches:
        raise ValueError(f"micro_batch_size={b} not divisible by num_microbatches={num_microbatches}")
    mbs = b // num_microbatches
    microbatches = [{k: v[i * mbs : (i + 1) * mbs] for k, v in batch.items()} for i in range(num_microbatches)]

    def loss_func(loss_mask, global_tokens, per_token):
        local_sum = (per_token.float() * loss_mask).sum()
        # 3-tuple: the schedule divides the first entry IN PLACE by global_tokens and num_microbatches
        # before backward, hence the clone for the report.
        return local_sum, global_tokens, {"local_sum": local_sum.detach().clone(), "tokens": global_tokens}

    def forward_step(data_iterator, module):
        full = next(data_iterator)
        out, local = _run_on_cp_shard(module, full)
        return out, lambda t: loss_func(local["loss_mask"], full["loss_mask"].sum().to(torch.int), t)

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    with cuda_to_cpu():
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches) if len(chunks) == 1 else [iter(microbatches) for _ in chunks],
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=cfg.seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        all_reduce_grads_over_cp(chunk)
        all_reduce_sequence_parallel_grads(chunk)
        grads.update(full_gradients(chunk))
    if parallel_state.is_pipeline_last_stage():
        loss = sum(cp_sum(r["local_sum"]) / r["tokens"] for r in reports) / num_microbatches
    else:
        loss = None
    losses: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(losses, loss, group=parallel_state.get_pipeline_model_parallel_group())
    return {"loss": losses[-1], "grads": merge_over_pipeline(grads), "grad_norm": megatron_grad_norm(chunks)}


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------
def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (0 when both are 0): a scale-aware error for whole tensors."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_results(actual: dict[str, Any], expected: dict[str, Any]) -> dict[str, float]:
    """Relative errors of every entry ``forward_backward``/``pipeline_forward_backward`` return:
    keys ``loss``, ``grad_norm``, ``per_token_loss`` (if present) and ``grad:<name>``. Raises if gradient names
    differ."""
    errors = {"loss": max_relative_error(torch.as_tensor(actual["loss"]), torch.as_tensor(expected["loss"]))}
    errors["grad_norm"] = abs(actual["grad_norm"] - expected["grad_norm"]) / abs(expected["grad_norm"])
    if "per_token_loss" in expected:
        errors["per_token_loss"] = max_relative_error(actual["per_token_loss"], expected["per_token_loss"])
    if set(actual["grads"]) != set(expected["grads"]):
        raise AssertionError(
            f"gradient names differ: only actual {sorted(set(actual['grads']) - set(expected['grads']))}, "
            f"only expected {sorted(set(expected['grads']) - set(actual['grads']))}"
        )
    for name, grad in expected["grads"].items():
        if actual["grads"][name].shape != grad.shape:
            raise AssertionError(f"{name}: shape {tuple(actual['grads'][name].shape)} != {tuple(grad.shape)}")
        errors[f"grad:{name}"] = max_relative_error(actual["grads"][name], grad)
    return errors


__all__ = [
    "TinyGPTConfig",
    "TrainedSteps",
    "all_reduce_grads_over_cp",
    "all_reduce_sequence_parallel_grads",
    "build_tiny_gpt",
    "canonical_name",
    "canonical_parameters",
    "compare_results",
    "forward_backward",
    "full_gradients",
    "full_shapes",
    "gather_over_tensor_parallel",
    "init_parallel",
    "local_spec_with_core_attention",
    "make_transformer_config",
    "merge_over_expert_parallel",
    "merge_over_pipeline",
    "max_relative_error",
    "megatron_grad_norm",
    "megatron_thd_params",
    "packed_forward_backward",
    "pipeline_forward_backward",
    "reset_parameters_deterministically",
    "shard_batch_for_cp",
    "synthetic_batch",
    "thd_batch_on_this_cp_rank",
    "train_steps",
    "unshard_cp",
    "zigzag_chunk_ids",
]
