"""Shims that let megatron-core 0.19.2 train a small GPTModel on CPU ranks over gloo.

Test support only: nothing on the library's runtime path imports this module, and importing it (or any other
module of the package) patches nothing. Shims 1-6 are applied by an explicit ``install_megatron_cpu_shims()``
(the test harness, tests/conftest.py, and the demo call it), which is idempotent (a second call changes nothing),
safe to call before or after ``import megatron.core``, and refuses (``CudaAvailableError``) where CUDA is
available: the shims exist for CPU-only machines and would hide real device placement on a GPU. Each shim is the
smallest change that was needed; why it is
needed is written next to it. Fusions (bias-gelu, bias-dropout-add, RoPE, softmax) are left off: they
are off by default in 0.19.2 and would cost an inductor compile per process on CPU.

Shims (see each function):
  1. ``typing.override`` on Python 3.11      megatron.training imports it (3.12+ only).
  2. ``torch.cuda.current_device() -> cpu``  ~60 megatron call sites allocate on it.
  3. ``torch.cuda.synchronize()`` no-op      pipeline p2p calls it after batch_isend_irecv.
  4. CPU RNG states tracker                  model_parallel_cuda_manual_seed / attention fork the CUDA RNG.
  5. RoPE slicing under CP > 1               get_pos_emb_on_this_cp_rank uses pin_memory + .cuda().
  6. default causal / sliding-window masks   the local DotProductAttention builds them on "cuda".
  7. ``cuda_to_cpu()`` TorchFunctionMode     pipeline schedules hard-code ``device="cuda"`` (inside the block).
  8. megatron DDP / distributed optimizer / megatron-fsdp on gloo (``install_megatron_ddp_cpu_shims()``,
     ``megatron_ddp_on_cpu()``): 8a CUDA streams and events, 8b CPU device meshes, 8c inside the block only:
     integer devices -> cpu, CUDA tensor type names, ``current_device() == 0``; 8d the CUDA generator's state;
     8e MoE's all-to-all split sizes as numpy arrays (expert parallelism).

The tiny-GPT harness does not wrap the model in megatron's DistributedDataParallel: it sums gradients over the
CP group itself, as DDP's dp_cp all-reduce would (the tests of DDP itself use shims 8).
"""

from __future__ import annotations

import contextlib
import sys
import typing
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


class CudaAvailableError(RuntimeError):
    """The CPU shims were asked for on a machine with CUDA."""


def refuse_with_cuda(
    what: str = "megatron_2d_dev.megatron_cpu", instead: str = "run megatron-core on the GPU without them"
) -> None:
    """CudaAvailableError when CUDA is available: the CPU shims are for CPU-only machines."""
    if torch.cuda.is_available():
        raise CudaAvailableError(
            f"{what} maps CUDA to the CPU for tests on CPU-only machines; CUDA is available here, so {instead} instead"
        )


# --------------------------------------------------------------------------------------------------
# 1. typing.override
# --------------------------------------------------------------------------------------------------
def _install_typing_override() -> None:
    """megatron/training/models/*.py does ``from typing import override`` (new in 3.12); the wheel of
    megatron-core 0.19.2 compiles under 3.11 otherwise. The decorator only marks methods, so the
    identity function is a faithful stand-in."""
    if not hasattr(typing, "override"):
        typing.override = lambda method: method  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------
# 2./3. torch.cuda.current_device and torch.cuda.synchronize
# --------------------------------------------------------------------------------------------------
def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` without CUDA: megatron passes the result as
    ``device=`` to factory functions, which accept a torch.device."""
    return torch.device("cpu")


def _noop_synchronize(device=None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` without CUDA: CPU collectives complete on wait()."""


def _install_cuda_device_shims() -> None:
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _noop_synchronize


# --------------------------------------------------------------------------------------------------
# 4. CPU RNG states tracker
# --------------------------------------------------------------------------------------------------
def _cpu_rng_tracker_class():
    """A ``CudaRNGStatesTracker`` whose named states are states of the default CPU generator.

    megatron's tracker keeps CUDA generator states; ``model_parallel_cuda_manual_seed`` adds three of
    them and attention/dropout code enters ``get_cuda_rng_tracker().fork()``, so the tracker cannot be
    skipped. This subclass keeps the same bookkeeping (names, seeds, current name) over
    ``torch.get_rng_state`` / ``torch.set_rng_state``. It subclasses the original so megatron's
    ``isinstance(..., CudaRNGStatesTracker)`` checks still hold.
    """
    from megatron.core.tensor_parallel import random as mrandom

    base = getattr(mrandom, "_M2D_ORIGINAL_TRACKER", mrandom.CudaRNGStatesTracker)
    mrandom._M2D_ORIGINAL_TRACKER = base
    existing = getattr(mrandom, "_M2D_CPU_TRACKER", None)
    if existing is not None:
        return existing

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Named RNG states of the default CPU generator (see ``_cpu_rng_tracker_class``)."""

        def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
            # CUDA graphs do not exist on CPU; the flag is accepted and ignored.
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current rng state {self._current_state_name} is not {name}")
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    mrandom._M2D_CPU_TRACKER = CpuRNGStatesTracker
    return CpuRNGStatesTracker


def _install_rng_tracker() -> None:
    """Make megatron build the CPU tracker: ``initialize_rng_tracker`` instantiates the module-level
    name ``CudaRNGStatesTracker``, so rebinding that name and force-resetting the tracker is enough."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, mrandom.CudaRNGStatesTracker):
        mrandom.initialize_rng_tracker(force_reset=True)
    # Activation checkpointing saves and restores "the CUDA RNG state" around the recompute; on CPU the CPU
    # generator (saved separately by megatron) and the tracker are the whole state.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` on the CPU tracker, also seeding the CPU generator.

    torch 2.13 seeds every process differently, so the default generator is seeded here too.
    """
    from megatron.core.tensor_parallel import random as mrandom

    _install_rng_tracker()
    mrandom.initialize_rng_tracker(force_reset=True)
    torch.manual_seed(seed)
    mrandom.model_parallel_cuda_manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# 5. RoPE under context parallelism
# --------------------------------------------------------------------------------------------------
def cpu_get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Same contract as ``rope_utils.get_pos_emb_on_this_cp_rank``: split ``seq_dim`` into
    ``2 * cp`` chunks and keep chunks ``r`` and ``2 * cp - 1 - r`` (zigzag), in that order.

    The original builds its index with ``pin_memory=True`` and ``.cuda()``; this one builds it on
    ``pos_emb.device``.
    """
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size = cp_group.size()
    cp_rank = cp_group.rank()
    shape = pos_emb.shape
    # [..., s, ...] -> [..., 2*cp, s/(2*cp), ...]
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1 :])
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=pos_emb.device)
    chunks = chunks.index_select(seq_dim, index)
    # [..., 2, s/(2*cp), ...] -> [..., s/cp, ...]
    return chunks.reshape(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])


_ROPE_MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def _install_rope_shim() -> None:
    """Rebind the function in the defining module and in every module that imported it by name."""
    import importlib

    for name in _ROPE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = cpu_get_pos_emb_on_this_cp_rank


# --------------------------------------------------------------------------------------------------
# 6. Causal masks of the local DotProductAttention
# --------------------------------------------------------------------------------------------------
def cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``transformer.utils.get_default_causal_mask`` on the CPU: ``[sq, sq]`` bool, True above the
    diagonal (the masked-out future)."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """``transformer.utils.get_sliding_window_causal_mask`` on the CPU: ``[sq, skv]`` bool, True where
    key j is outside query i's window ``[i' - window_size[0], i' + window_size[1]]`` with
    ``i' = i + skv - sq`` (queries aligned to the end of the keys)."""
    query_pos = torch.arange(sq).unsqueeze(1) + (skv - sq)
    key_pos = torch.arange(skv).unsqueeze(0)
    inside = (key_pos >= query_pos - window_size[0]) & (key_pos <= query_pos + window_size[1])
    return ~inside


_MASK_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
)


def _install_mask_shim() -> None:
    """FusedScaleMaskSoftmax's torch path calls these with ``device="cuda"`` hard-coded when no mask
    is given; rebind them (by name, where imported) to CPU versions."""
    import importlib

    for name in _MASK_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = cpu_default_causal_mask
        if hasattr(module, "get_sliding_window_causal_mask"):
            module.get_sliding_window_causal_mask = cpu_sliding_window_causal_mask


# --------------------------------------------------------------------------------------------------
# 7. cuda -> cpu inside a block of code
# --------------------------------------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _map_device(device):
    return torch.device("cpu") if _is_cuda(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites torch calls made inside it so that CUDA placements become CPU ones.

    Handles ``device=`` keywords naming CUDA, ``pin_memory=True``, ``Tensor.cuda()``,
    ``Tensor.pin_memory()`` and ``Tensor.to("cuda" | torch.device("cuda"))``. Used around megatron's
    pipeline schedules, which allocate with ``device="cuda"`` (e.g. ``total_num_tokens`` in
    schedules.py).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_map_device(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Context manager: run the enclosed code with CUDA placements mapped to the CPU (see
    ``CudaToCpuMode``). Wrap ``get_forward_backward_func()(...)`` calls in it."""
    with CudaToCpuMode():
        yield


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------
def install_megatron_cpu_shims(import_training: bool = False) -> None:
    """Apply shims 1-6 (7 is the ``cuda_to_cpu()`` block); idempotent. Refuses where CUDA is available.

    Args:
        import_training: also ``import megatron.training`` after the ``typing.override`` shim (it is
            applied either way, so a later import works too).
    """
    global _INSTALLED
    refuse_with_cuda()
    _install_typing_override()
    _install_cuda_device_shims()
    if not _INSTALLED:
        import megatron.core  # noqa: F401  (needs triton installed; see the notes)

        _install_rng_tracker()
        _install_rope_shim()
        _install_mask_shim()
        _INSTALLED = True
    if import_training and "megatron.training" not in sys.modules:
        import megatron.training  # noqa: F401


# --------------------------------------------------------------------------------------------------
# 8. megatron-core's DistributedDataParallel, distributed optimizer and megatron-fsdp on gloo
#
#  8a. CUDA streams and events as no-op CPU stand-ins (torch.cuda.current_stream, default_stream, Stream,
#     stream, Event): param_and_grad_buffer.py asks for the current stream, partial sharding creates a
#     communication stream, megatron-fsdp two side streams. With gloo every collective megatron issues completes
#     in program order on the CPU (async ones on wait()), so there is nothing to order.
#  8b. DeviceMesh.from_group(device_type="cuda") builds a CPU mesh (megatron-fsdp's DTensor meshes).
#  8c. Inside megatron_ddp_on_cpu() only: cuda/integer devices -> cpu (CudaToCpuMode), Tensor.type() answers with
#  CUDA type names (megatron's optimizers accept only torch.cuda.*Tensor params), torch.cuda.current_device()
#  returns 0 (megatron-fsdp formats it into "cuda:N") where the mode is active (not in backward: the autograd
#  engine runs it without the caller's modes, and there it stays the cpu device of shim 2).
#  8d. torch.cuda.get_rng_state / set_rng_state read and set a CPU generator standing in for the CUDA one, which
#  nothing draws from on CPU ranks: megatron-fsdp copies TP rank 0's RNG states to the other TP ranks at wrapping.
#  Config, not a shim: gloo has no ReduceOp.PREMUL_SUM, so megatron-fsdp runs with
#  gradient_reduce_div_fusion=False (CPU_DDP_CONFIG_OVERRIDES).
# --------------------------------------------------------------------------------------------------
_DDP_INSTALLED = False

CPU_DDP_CONFIG_OVERRIDES: dict[str, Any] = {"gradient_reduce_div_fusion": False}
"""DistributedDataParallelConfig fields needed on gloo: no PREMUL_SUM reduce op (megatron-fsdp divides in a
separate multiply instead)."""


# --------------------------------------------------------------------------------------------------
# 8a. CUDA streams and events
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

    def record_event(self, event=None) -> CpuEvent:
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

    def __enter__(self) -> CpuStreamContext:
        return self

    def __exit__(self, *exc) -> None:
        return None


_DEFAULT_STREAM = CpuStream()


def _current_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


_CUDA_GENERATOR_STAND_IN = torch.Generator()


def _install_cuda_rng_state_shims() -> None:
    torch.cuda.get_rng_state = lambda device="cuda": _CUDA_GENERATOR_STAND_IN.get_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": _CUDA_GENERATOR_STAND_IN.set_state(state)  # type: ignore


def _install_stream_shims() -> None:
    torch.cuda.Stream = CpuStream  # type: ignore[misc, assignment]
    torch.cuda.Event = CpuEvent  # type: ignore[misc, assignment]
    torch.cuda.current_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.default_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.stream = CpuStreamContext  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------------
# 8b. CPU device meshes for megatron-fsdp
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
# 8c. Inside a block: cuda -> cpu, CUDA type names, current_device() == 0
# --------------------------------------------------------------------------------------------------
def _cuda_type_name(cpu_type_name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (names already naming cuda are kept)."""
    if cpu_type_name.startswith("torch.") and not cpu_type_name.startswith("torch.cuda."):
        return "torch.cuda." + cpu_type_name[len("torch.") :]
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
    """Run the enclosed megatron DDP / megatron-fsdp / optimizer code on CPU ranks (shims 8, 8c in the block).

    Enter it around building the wrapper and the optimizer and around every training step.
    """
    install_megatron_ddp_cpu_shims()
    saved = torch.cuda.current_device

    def current_device():
        # 0 where the mode maps integer devices to cpu; the autograd engine runs backward (recomputes, TP
        # collectives' backward) without the caller's torch-function modes, so there it is shim 2's cpu device
        if any(isinstance(m, MegatronDDPOnCpuMode) for m in torch.overrides._get_current_function_mode_stack()):
            return 0
        return saved()

    torch.cuda.current_device = current_device  # type: ignore[assignment]
    try:
        with MegatronDDPOnCpuMode():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors: megatron converts the all-to-all split sizes to numpy
    only when it copies them from a CUDA device, and ``all_to_all_single`` takes a sequence of ints, not a tensor."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _install_moe_split_sizes_shim() -> None:
    """8e: the token dispatcher's ``maybe_move_tensor_to_cpu`` (imported by name) answers numpy for CPU tensors."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes


def install_megatron_ddp_cpu_shims() -> None:
    """Apply ``install_megatron_cpu_shims`` and shims 8a, 8b, 8d, 8e (idempotent; refuses where CUDA is available)."""
    global _DDP_INSTALLED
    install_megatron_cpu_shims()
    if not _DDP_INSTALLED:
        _install_stream_shims()
        _install_device_mesh_shim()
        _install_cuda_rng_state_shims()
        _install_moe_split_sizes_shim()
        _DDP_INSTALLED = True


def shims_installed() -> bool:
    """True once ``install_megatron_cpu_shims`` has run in this process (or a parent before fork)."""
    return _INSTALLED


__all__ = [
    "CPU_DDP_CONFIG_OVERRIDES",
    "CudaAvailableError",
    "CudaToCpuMode",
    "install_megatron_ddp_cpu_shims",
    "megatron_ddp_on_cpu",
    "cpu_get_pos_emb_on_this_cp_rank",
    "cuda_to_cpu",
    "install_megatron_cpu_shims",
    "model_parallel_cpu_manual_seed",
    "refuse_with_cuda",
    "shims_installed",
]
