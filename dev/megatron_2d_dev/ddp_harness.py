"""Test harness for megatron-core's DDP / distributed optimizer / megatron-fsdp on forked CPU ranks.

Test support only. The CPU shims it needs live with the others in ``megatron_cpu`` (section 8); this module
trains through Megatron's own schedule and reports the model-state bytes each rank holds.

Proven on CPU with this: which group gradients are reduced and sharded over, what state each rank keeps, and that
sharded training gives the unsharded losses, gradient norms and parameters. Not proven without a GPU: the overlap
of communication with compute and the stream ordering of partial sharding (here every "stream" is program order),
NCCL's PREMUL_SUM path, and memory peaks (the transient all-gathered layers of megatron-fsdp).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_2d_dev.megatron_cpu import (  # noqa: F401  (re-exported for the tests)
    CPU_DDP_CONFIG_OVERRIDES,
    install_megatron_ddp_cpu_shims,
    megatron_ddp_on_cpu,
)


# --------------------------------------------------------------------------------------------------
# Harness: parallel state, wrapping, one training step through Megatron's schedule, bytes held
# --------------------------------------------------------------------------------------------------
def init_parallel(
    context_parallel_size: int = 1, num_distributed_optimizer_instances: int = 1, seed: int = 1234, **kwargs: Any
) -> None:
    """``tiny_gpt.init_parallel`` with ``num_distributed_optimizer_instances`` (partial sharding builds its groups
    in ``initialize_model_parallel``); replaces any previous layout."""
    from megatron_2d_dev import tiny_gpt

    tiny_gpt.init_parallel(
        context_parallel_size=context_parallel_size,
        seed=seed,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        **kwargs,
    )


def wrap_model(model: torch.nn.Module, ddp_config, disable_bucketing: bool = False) -> torch.nn.Module:
    """Megatron's ``DistributedDataParallel``, or megatron-fsdp's ``FullyShardedDataParallel`` when
    ``ddp_config.use_megatron_fsdp``, around ``model`` on the CPU; sets the config hooks Megatron-LM's training
    loop sets (``no_sync_func``, ``finalize_model_grads_func``). ``disable_bucketing``: as Megatron-LM passes it
    for every virtual pipeline chunk but the first."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    with megatron_ddp_on_cpu():
        if ddp_config.use_megatron_fsdp:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))
        else:
            wrapped = DistributedDataParallel(model.config, ddp_config, model, disable_bucketing=disable_bucketing)
    wrapped.config.no_sync_func = wrapped.no_sync
    wrapped.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def wrap_chunks(chunks: Sequence[torch.nn.Module], ddp_config) -> list[torch.nn.Module]:
    """:func:`wrap_model` on each model chunk (virtual pipeline stages), bucketing the first only, and the config
    hooks Megatron-LM sets for several chunks (one ``no_sync`` over all of them)."""
    wrapped = [wrap_model(chunk, ddp_config, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    config = wrapped[0].config  # one config object for every chunk
    if len(wrapped) > 1:
        config.no_sync_func = [c.no_sync for c in wrapped]
    if ddp_config.overlap_grad_reduce:  # Megatron-LM's --align-grad-reduce (its default)
        grad_sync = [c.start_grad_sync for c in wrapped]
        config.grad_sync_func = grad_sync if len(wrapped) > 1 else grad_sync[0]
    return wrapped


def build_optimizer(wrapped: torch.nn.Module | Sequence[torch.nn.Module], optimizer_config):
    """``get_megatron_optimizer`` for the wrapped model chunk(s) (no gloo side groups: gloo is the default
    backend)."""
    from megatron.core.optimizer import get_megatron_optimizer

    chunks = list(wrapped) if isinstance(wrapped, Sequence) else [wrapped]
    with megatron_ddp_on_cpu():
        return get_megatron_optimizer(optimizer_config, chunks, use_gloo_process_groups=False)


def per_token_loss(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """Megatron's 3-tuple loss contract: (sum of masked per-token loss, tokens, report)."""
    local_sum = (per_token.float() * loss_mask).sum()
    return local_sum, loss_mask.sum().to(torch.int), {"local_sum": local_sum.detach().clone()}


def _forward_step(data_iterator, model):
    from megatron_2d_dev.tiny_gpt import shard_batch_for_cp

    local = shard_batch_for_cp(next(data_iterator))
    output = model(
        input_ids=local["tokens"], position_ids=local["position_ids"], attention_mask=None, labels=local["labels"]
    )  # [b, s/cp]
    return output, functools.partial(per_token_loss, local["loss_mask"])


def data_parallel_share(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This DP rank's samples of a full batch (its b/dp consecutive samples)."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    b = batch["tokens"].shape[0]
    if b % dp:
        raise ValueError(f"batch of {b} samples does not split over {dp} data-parallel ranks")
    share = b // dp
    return {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}


def schedule_step(
    chunks: Sequence[torch.nn.Module],
    optimizer,
    forward_step,
    microbatches: Sequence[Any],
    seq_length: int,
    micro_batch_size: int,
    before_step=None,
    data_iterator=None,
) -> tuple[list[dict], float | None]:
    """One Megatron training step: ``microbatches`` (this DP rank's) through ``get_forward_backward_func()`` on the
    wrapped model chunks (each chunk reads its own iterator over them), which calls ``finalize_model_grads``; then
    ``before_step()`` if given (the reduced gradients are in place) and ``optimizer.step()``. Returns the loss
    reports of this rank (the last pipeline stage's; empty elsewhere) and the gradient norm the optimizer reports
    (None unless ``clip_grad`` > 0), equal on every rank. ``data_iterator``: one chunk's iterator, in place of one
    over ``microbatches`` (hybrid CP: Megatron's data wrapper over them)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with megatron_ddp_on_cpu():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(microbatches) for _ in chunks] if data_iterator is None else [data_iterator]
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=list(chunks),
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        if before_step is not None:
            before_step()
        _, grad_norm, _ = optimizer.step()
    return list(reports), None if grad_norm is None else float(grad_norm)


def train_step(wrapped: torch.nn.Module, optimizer, batch: dict[str, torch.Tensor], seq_length: int) -> dict[str, Any]:
    """One Megatron training step on a full (unsharded) batch: this DP rank's samples, zigzag-sharded over CP, one
    micro-batch through :func:`schedule_step`. The model config must have ``calculate_per_token_loss=True`` so the
    gradient is that of sum(masked per-token loss) / (tokens in the global batch).

    Returns ``loss`` (the global-batch mean, before the update) and ``grad_norm`` (as the optimizer reports it;
    None unless ``clip_grad`` > 0), equal on every rank.
    """
    from megatron.core import parallel_state

    mine = data_parallel_share(batch)
    reports, grad_norm = schedule_step(
        [wrapped], optimizer, _forward_step, [mine], seq_length, micro_batch_size=mine["tokens"].shape[0]
    )
    local_sum = reports[0]["local_sum"]
    dist.all_reduce(local_sum, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {"loss": float(local_sum / batch["loss_mask"].sum()), "grad_norm": grad_norm}


def full_parameters(wrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a Megatron-DDP-wrapped tiny GPT by canonical name, after forcing the param all-gather
    that ``overlap_param_gather`` defers to the next forward."""
    from megatron_2d_dev.tiny_gpt import canonical_parameters

    with megatron_ddp_on_cpu():
        if wrapped.ddp_config.use_distributed_optimizer:
            wrapped.start_param_sync(force_sync=True)
    return {name: p.detach().clone() for name, p in canonical_parameters(wrapped.module).items()}


def full_weights(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every weight of Megatron-DDP-wrapped model chunks by canonical name, in fp32 at its full shape (gathered over
    TP, the pipeline stages and the expert-parallel ranks), after forcing the distributed optimizer's param
    all-gather that ``overlap_param_gather`` defers to the next forward. Collective over the world."""
    from megatron_2d_dev.tiny_gpt import (
        canonical_parameters,
        gather_over_tensor_parallel,
        merge_over_expert_parallel,
        merge_over_pipeline,
    )

    local: dict[str, torch.Tensor] = {}
    for wrapped in chunks:
        with megatron_ddp_on_cpu():
            if wrapped.ddp_config.use_distributed_optimizer:
                wrapped.start_param_sync(force_sync=True)
        params = canonical_parameters(unwrapped(wrapped))
        local.update(gather_over_tensor_parallel({n: (p.detach().float(), p) for n, p in params.items()}))
    return merge_over_expert_parallel(merge_over_pipeline(local))


def full_gradients(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every gradient of the wrapped model chunks after a step's reduction (call it between ``finalize_model_grads``
    and ``optimizer.step()``, e.g. as :func:`schedule_step`'s ``before_step``), by canonical name, gathered to its
    full shape: over the shard group (distributed optimizer: each bucket's reduce-scattered shards; megatron-fsdp:
    each grad buffer's shards), over TP and over the pipeline stages. Collective over the world."""
    from megatron_2d_dev.tiny_gpt import (
        gather_over_tensor_parallel,
        merge_over_expert_parallel,
        merge_over_pipeline,
    )

    local: dict[str, torch.Tensor] = {}
    for wrapped in chunks:
        with megatron_ddp_on_cpu():
            grads = _fsdp_gradients(wrapped) if wrapped.ddp_config.use_megatron_fsdp else _ddp_gradients(wrapped)
        local.update(gather_over_tensor_parallel(grads))
    return merge_over_expert_parallel(merge_over_pipeline(local))


def unwrapped(wrapped: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / megatron-fsdp and Float16Module."""
    module = wrapped.module
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def _ddp_gradients(wrapped) -> dict[str, tuple[torch.Tensor, torch.nn.Parameter]]:
    """{canonical name: (full-over-DP main_grad, param)} of a DDP-wrapped chunk; the distributed optimizer's shards
    are all-gathered into their grad buffers first (their other slots are scratch space after a reduce-scatter)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from megatron_2d_dev.tiny_gpt import canonical_parameters

    if wrapped.ddp_config.use_distributed_optimizer:
        for group in wrapped.bucket_groups + wrapped.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            for bucket in group.buckets:
                shard = shard_buffer(bucket.grad_data, size)[group.intra_distributed_optimizer_instance_rank].clone()
                dist.all_gather_into_tensor(
                    bucket.grad_data, shard, group=group.intra_distributed_optimizer_instance_group
                )
    return {
        name: (p.main_grad.detach().float().clone(), p) for name, p in canonical_parameters(unwrapped(wrapped)).items()
    }


def _fsdp_gradients(wrapped) -> dict[str, tuple[torch.Tensor, torch.nn.Parameter]]:
    """{canonical name: (full-over-DP gradient, param)} of a megatron-fsdp-wrapped chunk: each parameter group's
    main-grad buffer, its shards all-gathered over the buffer's group where it is sharded."""
    from megatron_2d_dev.tiny_gpt import canonical_name

    buffer = wrapped.param_and_grad_buffer
    model = unwrapped(wrapped)
    out: dict[str, tuple[torch.Tensor, torch.nn.Parameter]] = {}
    gathered: dict[int, torch.Tensor] = {}  # id(grad buffer) -> its whole bucket
    for name, param in buffer.optimizer_named_parameters:
        orig = param.orig_param
        group = buffer.parameter_groups[buffer.param_to_param_group[orig]]
        gbuf = group.main_grad_buffer
        if gbuf is None:
            continue
        if id(gbuf) not in gathered:
            if gbuf.is_data_distributed:  # equal shards (megatron-fsdp pads the bucket)
                shard = gbuf.get_shard_from_local_buffer().detach().clone()
                parts = [torch.empty_like(shard) for _ in range(gbuf.dp_world_size)]
                dist.all_gather(parts, shard, group=gbuf.data_parallel_group)
                gathered[id(gbuf)] = torch.cat(parts)
            else:
                gathered[id(gbuf)] = gbuf.data
        index = gbuf.item_index_map[gbuf.param_idx[orig]]
        start = index.global_data_index - gbuf.bucket_index.global_data_index
        local_shape = orig.to_local().shape if hasattr(orig, "to_local") else orig.shape
        grad = gathered[id(gbuf)][start : start + index.size].view(local_shape).float().clone()
        out[canonical_name(model, name.removeprefix("module."))] = (grad, orig)
    return out


def reduced_gradient_shards(wrapped: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients this rank's distributed optimizer steps with after a step's reduce-scatter: its shard of every
    bucket's grad buffer, bucket by bucket in DDP's order (the rest of a grad buffer is scratch space whose content
    differs between overlapped and synchronous reductions)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    return [
        shard_buffer(bucket.grad_data, group.intra_distributed_optimizer_instance_size)[
            group.intra_distributed_optimizer_instance_rank
        ]
        .detach()
        .clone()
        for group in wrapped.bucket_groups + wrapped.expert_parallel_bucket_groups
        for bucket in group.buckets
    ]


# ---- bytes held ---------------------------------------------------------------------------------------------------
def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Sequence[torch.Tensor | None], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once), minus storages in ``exclude``."""
    seen = {_local(t).untyped_storage().data_ptr() for t in exclude if _local(t) is not None}
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        if local is None or local.untyped_storage().nbytes() == 0:
            continue
        ptr = local.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += local.untyped_storage().nbytes()
    return total


def _inner_optimizers(optimizer) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in (chained if chained is not None else [optimizer]) if o.optimizer is not None]


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """The state tensors (Adam exp_avg/exp_avg_sq, SGD momentum) this rank's torch optimizer holds."""
    return [
        v
        for inner in _inner_optimizers(optimizer)
        for state in inner.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]


def optimizer_main_params(optimizer) -> list[torch.Tensor]:
    """The (main) params this rank's torch optimizer updates: fp32 shards, or views of fp32 model params."""
    return [p for inner in _inner_optimizers(optimizer) for group in inner.param_groups for p in group["params"]]


def _buffers(wrapped: torch.nn.Module, kind: str) -> list[torch.Tensor]:
    """megatron-fsdp buffers of one kind ('params' or 'grads') on this rank, helpers included."""
    names = {
        "params": ("model_weight_buffer", "transpose_weight_buffer", "hfsdp_helper_wbuf", "hfsdp_helper_wtbuf"),
        "grads": ("main_grad_buffer", "hfsdp_helper_gbuf"),
    }[kind]
    return [
        getattr(group, name).data
        for group in wrapped.param_and_grad_buffer.parameter_groups
        for name in names
        if getattr(group, name, None) is not None and getattr(group, name).data is not None
    ]


def model_state_bytes(wrapped: torch.nn.Module, optimizer) -> dict[str, int]:
    """Persistent model-state bytes this rank holds, measured on the real objects (distinct storages):

    ``params``: the model's parameters (megatron-fsdp: its weight buffers); ``grads``: the DDP grad buffers
    (megatron-fsdp: its grad buffers); ``optimizer``: the optimizer's state tensors plus main params that are not
    the model params themselves (fp32 copies of 16-bit params, megatron-fsdp's main-weight shards);
    ``optimizer_states``: the state tensors alone.
    """
    states = optimizer_state_tensors(optimizer)
    if getattr(wrapped.ddp_config, "use_megatron_fsdp", False):
        params = _buffers(wrapped, "params")
        grads = _buffers(wrapped, "grads")
    else:
        params = [p for p in wrapped.module.parameters()]
        params += [b.param_data for b in wrapped.buffers + wrapped.expert_parallel_buffers if b.param_data is not None]
        grads = [b.grad_data for b in wrapped.buffers + wrapped.expert_parallel_buffers]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grads),
        "optimizer": _storage_bytes(states) + _storage_bytes(optimizer_main_params(optimizer), exclude=params),
        "optimizer_states": _storage_bytes(states),
    }


__all__ = [
    "CPU_DDP_CONFIG_OVERRIDES",
    "build_optimizer",
    "data_parallel_share",
    "full_gradients",
    "full_parameters",
    "full_weights",
    "init_parallel",
    "install_megatron_ddp_cpu_shims",
    "megatron_ddp_on_cpu",
    "model_state_bytes",
    "optimizer_main_params",
    "optimizer_state_tensors",
    "per_token_loss",
    "reduced_gradient_shards",
    "schedule_step",
    "train_step",
    "unwrapped",
    "wrap_chunks",
    "wrap_model",
]
