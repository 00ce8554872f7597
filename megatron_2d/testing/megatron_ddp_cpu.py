"""Test-only CPU path for megatron-core's DistributedDataParallel, distributed optimizer and megatron-fsdp on gloo.

Test support only: nothing on the library's runtime path imports this module. On top of
``megatron_cpu.install_megatron_cpu_shims()`` it adds what megatron-core 0.19.2's data-parallel wrappers and
optimizers need on CPU ranks, and a small harness that trains through Megatron's own schedule:

Shims (installed by ``install_megatron_ddp_cpu_shims``, only when CUDA is absent):
  1. CUDA streams and events as no-op CPU stand-ins (``torch.cuda.current_stream``, ``default_stream``,
     ``Stream``, ``stream``, ``Event``): param_and_grad_buffer.py asks for the current stream, partial
     sharding creates a communication stream, megatron-fsdp two side streams. With gloo every collective megatron
     issues completes in program order on the CPU (async ones on ``wait()``), so there is nothing to order.
  2. ``DeviceMesh.from_group(device_type="cuda")`` builds a CPU mesh (megatron-fsdp's DTensor meshes).

Inside ``megatron_ddp_on_cpu()`` only (a TorchFunctionMode plus one swapped function, undone on exit):
  3. ``device="cuda"`` / ``cuda:N`` / integer devices -> cpu, ``.cuda()``/pin_memory dropped
     (``megatron_cpu.CudaToCpuMode``), e.g. the optimizer's ``torch.tensor(..., device='cuda')``.
  4. ``Tensor.type()`` answers with CUDA type names: megatron's optimizers accept only
     'torch.cuda.FloatTensor' / 'HalfTensor' / 'BFloat16Tensor' params.
  5. ``torch.cuda.current_device()`` returns 0 (not the CPU device ``megatron_cpu`` gives outside), because
     megatron-fsdp formats it into ``f"cuda:{...}"``; the integer then reaches factories as ``device=0``, which 3 maps.

Config, not a shim: gloo has no ReduceOp.PREMUL_SUM, so megatron-fsdp runs here with
``gradient_reduce_div_fusion=False`` (``CPU_DDP_CONFIG_OVERRIDES``); NCCL runs the default.

Proven on CPU with this: which group gradients are reduced and sharded over, what state each rank keeps, and that
sharded training gives the unsharded losses, gradient norms and parameters. Not proven without a GPU: the overlap
of communication with compute and the stream ordering of partial sharding (here every "stream" is program order),
NCCL's PREMUL_SUM path, and memory peaks (the transient all-gathered layers of megatron-fsdp).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_2d.testing.megatron_cpu import CudaToCpuMode, install_megatron_cpu_shims

_INSTALLED = False

CPU_DDP_CONFIG_OVERRIDES: Dict[str, Any] = {"gradient_reduce_div_fusion": False}
"""DistributedDataParallelConfig fields needed on gloo: no PREMUL_SUM reduce op (megatron-fsdp divides in a
separate multiply instead)."""


# --------------------------------------------------------------------------------------------------
# 1. CUDA streams and events on CPU
# --------------------------------------------------------------------------------------------------
class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: every operation runs in program order on CPU, so waiting on
    another stream or event has nothing to wait for."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream) -> None:
        """No-op: CPU work and gloo collectives are already ordered."""

    def wait_event(self, event) -> None:
        """No-op, as ``wait_stream``."""

    def record_event(self, event=None) -> "CpuEvent":
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        return True


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: recorded work is always complete on CPU."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        """No-op."""

    def wait(self, stream=None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        return True


class CpuStreamContext:
    """``torch.cuda.stream(s)``: on CPU there is one ordered stream, so entering another changes nothing. A class,
    not a generator: megatron enters one such object in two ``with`` statements (partial distributed optimizer
    with ``overlap_grad_reduce``), as torch's StreamContext allows."""

    def __init__(self, stream=None) -> None:
        self.stream = stream

    def __enter__(self) -> "CpuStreamContext":
        return self

    def __exit__(self, *exc) -> None:
        return None


_DEFAULT_STREAM = CpuStream()


def _current_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


def _install_stream_shims() -> None:
    torch.cuda.Stream = CpuStream  # type: ignore[misc, assignment]
    torch.cuda.Event = CpuEvent  # type: ignore[misc, assignment]
    torch.cuda.current_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.default_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.stream = CpuStreamContext  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------------
# 2. CPU device meshes for megatron-fsdp
# --------------------------------------------------------------------------------------------------
def _install_device_mesh_shim() -> None:
    """megatron-fsdp builds ``DeviceMesh.from_group(groups, device_type="cuda", ...)`` for its DTensors; on CPU
    ranks the same mesh over the same gloo groups is a "cpu" mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.from_group
    if getattr(original, "_m2d_cpu", False):
        return

    def from_group(group, device_type, *args, **kwargs):
        return original(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    from_group._m2d_cpu = True  # type: ignore[attr-defined]
    DeviceMesh.from_group = staticmethod(from_group)  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------------
# 3.-5. Inside a block: cuda -> cpu, CUDA type names, current_device() == 0
# --------------------------------------------------------------------------------------------------
def _cuda_type_name(cpu_type_name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (names already naming cuda are kept)."""
    if cpu_type_name.startswith("torch.") and not cpu_type_name.startswith("torch.cuda."):
        return "torch.cuda." + cpu_type_name[len("torch."):]
    return cpu_type_name


def _is_device_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MegatronDDPOnCpuMode(CudaToCpuMode):
    """``CudaToCpuMode`` plus integer devices mapped to cpu and ``Tensor.type()`` (no argument) answering with
    CUDA type names; ``Tensor.type(dtype)`` conversions pass through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunction():
                return _cuda_type_name(args[0].type())
        kwargs = dict(kwargs or {})
        if _is_device_index(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_device_index(a) else a for a in args)
        return super().__torch_function__(func, types, args, kwargs)


@contextlib.contextmanager
def megatron_ddp_on_cpu() -> Iterator[None]:
    """Run the enclosed megatron DDP / megatron-fsdp / optimizer code on CPU ranks (shims 3-5 above).

    Enter it around building the wrapper and the optimizer and around every training step.
    """
    install_megatron_ddp_cpu_shims()
    saved = torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    try:
        with MegatronDDPOnCpuMode():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def install_megatron_ddp_cpu_shims() -> None:
    """Apply ``install_megatron_cpu_shims`` and shims 1-2 (idempotent; nothing is changed when CUDA exists)."""
    global _INSTALLED
    install_megatron_cpu_shims()
    if not _INSTALLED and not torch.cuda.is_available():
        _install_stream_shims()
        _install_device_mesh_shim()
        _INSTALLED = True


# --------------------------------------------------------------------------------------------------
# Harness: parallel state, wrapping, one training step through Megatron's schedule, bytes held
# --------------------------------------------------------------------------------------------------
def init_parallel(context_parallel_size: int = 1, num_distributed_optimizer_instances: int = 1,
                  seed: int = 1234, **kwargs: Any) -> None:
    """``tiny_gpt.init_parallel`` with ``num_distributed_optimizer_instances`` (partial sharding builds its groups
    in ``initialize_model_parallel``); replaces any previous layout."""
    from megatron.core import parallel_state

    from megatron_2d.testing import tiny_gpt

    tiny_gpt.init_parallel()  # tears down the previous layout (groups included) and installs the shims
    parallel_state.destroy_model_parallel()
    tiny_gpt._destroy_subgroups()
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state.initialize_model_parallel(
        context_parallel_size=context_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=1,
        **kwargs,
    )
    tiny_gpt.model_parallel_cpu_manual_seed(seed)


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
    output = model(input_ids=local["tokens"], position_ids=local["position_ids"], attention_mask=None,
                   labels=local["labels"])  # [b, s/cp]
    return output, functools.partial(_per_token_loss_func, local["loss_mask"])


def data_parallel_share(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This DP rank's samples of a full batch (its b/dp consecutive samples)."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    b = batch["tokens"].shape[0]
    if b % dp:
        raise ValueError(f"batch of {b} samples does not split over {dp} data-parallel ranks")
    share = b // dp
    return {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}


def train_step(wrapped: torch.nn.Module, optimizer, batch: Dict[str, torch.Tensor], seq_length: int) -> Dict[str, Any]:
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
            forward_step_func=_forward_step, data_iterator=iter([mine]), model=[wrapped], num_microbatches=1,
            seq_length=seq_length, micro_batch_size=mine["tokens"].shape[0], forward_only=False)
        _, grad_norm, _ = optimizer.step()
    local_sum = reports[0]["local_sum"]
    dist.all_reduce(local_sum, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {"loss": float(local_sum / batch["loss_mask"].sum()),
            "grad_norm": None if grad_norm is None else float(grad_norm)}


def full_parameters(wrapped: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of a Megatron-DDP-wrapped tiny GPT by canonical name, after forcing the param all-gather
    that ``overlap_param_gather`` defers to the next forward."""
    from megatron_2d.testing.tiny_gpt import canonical_parameters

    with megatron_ddp_on_cpu():
        if wrapped.ddp_config.use_distributed_optimizer:
            wrapped.start_param_sync(force_sync=True)
    return {name: p.detach().clone() for name, p in canonical_parameters(wrapped.module).items()}


# ---- bytes held ---------------------------------------------------------------------------------------------------
def _local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Sequence[Optional[torch.Tensor]], exclude: Sequence[torch.Tensor] = ()) -> int:
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


def _inner_optimizers(optimizer) -> List[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in (chained if chained is not None else [optimizer]) if o.optimizer is not None]


def optimizer_state_tensors(optimizer) -> List[torch.Tensor]:
    """The state tensors (Adam exp_avg/exp_avg_sq, SGD momentum) this rank's torch optimizer holds."""
    return [v for inner in _inner_optimizers(optimizer) for state in inner.state.values()
            for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def optimizer_main_params(optimizer) -> List[torch.Tensor]:
    """The (main) params this rank's torch optimizer updates: fp32 shards, or views of fp32 model params."""
    return [p for inner in _inner_optimizers(optimizer) for group in inner.param_groups for p in group["params"]]


def _buffers(wrapped: torch.nn.Module, kind: str) -> List[torch.Tensor]:
    """megatron-fsdp buffers of one kind ('params' or 'grads') on this rank, helpers included."""
    names = {"params": ("model_weight_buffer", "transpose_weight_buffer", "hfsdp_helper_wbuf", "hfsdp_helper_wtbuf"),
             "grads": ("main_grad_buffer", "hfsdp_helper_gbuf")}[kind]
    return [getattr(group, name).data for group in wrapped.param_and_grad_buffer.parameter_groups for name in names
            if getattr(group, name, None) is not None and getattr(group, name).data is not None]


def model_state_bytes(wrapped: torch.nn.Module, optimizer) -> Dict[str, int]:
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
    "CpuEvent",
    "CpuStream",
    "CpuStreamContext",
    "MegatronDDPOnCpuMode",
    "build_optimizer",
    "data_parallel_share",
    "full_parameters",
    "init_parallel",
    "install_megatron_ddp_cpu_shims",
    "megatron_ddp_on_cpu",
    "model_state_bytes",
    "optimizer_main_params",
    "optimizer_state_tensors",
    "train_step",
    "wrap_model",
]
