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

from megatron_2d.testing.megatron_cpu import (  # noqa: F401  (re-exported for the tests)
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
    from megatron_2d.testing import tiny_gpt

    tiny_gpt.init_parallel(
        context_parallel_size=context_parallel_size,
        seed=seed,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        **kwargs,
    )


def wrap_model(model: torch.nn.Module, ddp_config) -> torch.nn.Module:
    """Megatron's ``DistributedDataParallel``, or megatron-fsdp's ``FullyShardedDataParallel`` when
    ``ddp_config.use_megatron_fsdp``, around ``model`` on the CPU; sets the config hooks Megatron-LM's training
    loop sets (``no_sync_func``, ``finalize_model_grads_func``)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    with megatron_ddp_on_cpu():
        if ddp_config.use_megatron_fsdp:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))
        else:
            wrapped = DistributedDataParallel(model.config, ddp_config, model)
    wrapped.config.no_sync_func = wrapped.no_sync
    wrapped.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(wrapped: torch.nn.Module, optimizer_config):
    """``get_megatron_optimizer`` for one wrapped model chunk (no gloo side groups: gloo is the default backend)."""
    from megatron.core.optimizer import get_megatron_optimizer

    with megatron_ddp_on_cpu():
        return get_megatron_optimizer(optimizer_config, [wrapped], use_gloo_process_groups=False)


def _per_token_loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """Megatron's 3-tuple loss contract: (sum of masked per-token loss, tokens, report)."""
    local_sum = (per_token.float() * loss_mask).sum()
    return local_sum, loss_mask.sum().to(torch.int), {"local_sum": local_sum.detach().clone()}


def _forward_step(data_iterator, model):
    from megatron_2d.testing.tiny_gpt import shard_batch_for_cp

    local = shard_batch_for_cp(next(data_iterator))
    output = model(
        input_ids=local["tokens"], position_ids=local["position_ids"], attention_mask=None, labels=local["labels"]
    )  # [b, s/cp]
    return output, functools.partial(_per_token_loss_func, local["loss_mask"])


def data_parallel_share(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This DP rank's samples of a full batch (its b/dp consecutive samples)."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    b = batch["tokens"].shape[0]
    if b % dp:
        raise ValueError(f"batch of {b} samples does not split over {dp} data-parallel ranks")
    share = b // dp
    return {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}


def train_step(wrapped: torch.nn.Module, optimizer, batch: dict[str, torch.Tensor], seq_length: int) -> dict[str, Any]:
    """One Megatron training step on a full (unsharded) batch: this DP rank's samples, zigzag-sharded over CP, one
    micro-batch through ``get_forward_backward_func()`` (which calls ``finalize_model_grads``), then
    ``optimizer.step()``. The model config must have ``calculate_per_token_loss=True`` so the gradient is that of
    sum(masked per-token loss) / (tokens in the global batch).

    Returns ``loss`` (the global-batch mean, before the update) and ``grad_norm`` (as the optimizer reports it;
    None unless ``clip_grad`` > 0), equal on every rank.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = data_parallel_share(batch)
    with megatron_ddp_on_cpu():
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter([mine]),
            model=[wrapped],
            num_microbatches=1,
            seq_length=seq_length,
            micro_batch_size=mine["tokens"].shape[0],
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
    local_sum = reports[0]["local_sum"]
    dist.all_reduce(local_sum, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {
        "loss": float(local_sum / batch["loss_mask"].sum()),
        "grad_norm": None if grad_norm is None else float(grad_norm),
    }


def full_parameters(wrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a Megatron-DDP-wrapped tiny GPT by canonical name, after forcing the param all-gather
    that ``overlap_param_gather`` defers to the next forward."""
    from megatron_2d.testing.tiny_gpt import canonical_parameters

    with megatron_ddp_on_cpu():
        if wrapped.ddp_config.use_distributed_optimizer:
            wrapped.start_param_sync(force_sync=True)
    return {name: p.detach().clone() for name, p in canonical_parameters(wrapped.module).items()}


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
    "full_parameters",
    "init_parallel",
    "install_megatron_ddp_cpu_shims",
    "megatron_ddp_on_cpu",
    "model_state_bytes",
    "optimizer_main_params",
    "optimizer_state_tensors",
    "reduced_gradient_shards",
    "train_step",
    "wrap_model",
]
