"""Local block kernels behind one interface, chosen by device (overridable by name).

    cpu_flash    torch's CPU flash kernel                          CPU, any float dtype
    te_fused     Transformer Engine's fused attention (cuDNN)      CUDA, fp16/bf16, when TE imports (2.5 to 2.20)
    torch_cudnn  PyTorch's cuDNN attention ops                     CUDA, fp16/bf16
    flash_attn2  flash-attn 2                                      CUDA, fp16/bf16, when installed (2.5 to 2.8)
    torch_flash  PyTorch's own CUDA flash kernel (no flash-attn)   CUDA, fp16/bf16
    torch_math   explicit [b, h, s_q, s_k] scores, in fp32/fp64   CPU only (a reference: memory quadratic)

Automatic choice (:func:`kernel_preference`): cpu_flash on CPU; on CUDA, by compute capability, Hopper and later
(sm90+) te_fused, torch_cudnn, flash_attn2, torch_flash (cuDNN's kernels are the fast ones there, flash-attn 2's are
Ampere's), before Hopper flash_attn2, torch_flash, torch_cudnn. The first that imports and takes the dtype and head
dim is chosen; each one passed over says why in a one-line notice, and the choice is logged (``logging``, INFO)
once per distinct choice (rank 0). fp32 on CUDA is refused (every CUDA kernel takes fp16/bf16; one materialising
scores would not fit at long-context block sizes). A kernel named explicitly is checked the same way and refused,
not replaced.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..layout.choices import Kernel
from .base import KERNELS, BlockKernel
from .cpu_flash import CpuFlashKernel
from .flash_attn2 import FlashAttn2Kernel
from .te_fused import TeFusedKernel
from .torch_cudnn import TorchCudnnKernel
from .torch_flash import TorchFlashKernel
from .torch_math import TorchMathKernel

logger = logging.getLogger(__name__)
CUDA_DTYPES = (torch.float16, torch.bfloat16)
HOPPER_ORDER = (Kernel.TE_FUSED, Kernel.TORCH_CUDNN, Kernel.FLASH_ATTN2, Kernel.TORCH_FLASH)
AMPERE_ORDER = (Kernel.FLASH_ATTN2, Kernel.TORCH_FLASH, Kernel.TORCH_CUDNN)
_ANNOUNCED: set[str] = set()  # the choices already logged (a log, not a setting: it steers nothing)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``; None where no CUDA runtime answers (tests fake one)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def kernel_preference(device: torch.device) -> tuple[str, ...]:
    """The kernels tried, in order, on ``device`` (a capability that cannot be read orders as before Hopper)."""
    if device.type == "cpu":
        return (Kernel.CPU_FLASH,)
    if device.type != "cuda":
        raise ValueError(f"no attention kernel runs on device type {device.type!r}; kernels: {sorted(KERNELS)}")
    capability = cuda_capability(device)
    return HOPPER_ORDER if capability is not None and capability >= (9, 0) else AMPERE_ORDER


def _build(name: str) -> BlockKernel:
    """The kernel ``name``, built (schema and signature checks included); raises ImportError when it cannot be."""
    kernel = KERNELS[name]
    if not kernel.available():
        raise ImportError(kernel.missing_package)
    return kernel()


def _problem(kernel: BlockKernel, device, dtype, head_dim) -> str | None:
    if not kernel.supports(device, dtype):
        return f"does not run on device {device.type} with {dtype}"
    return None if head_dim is None else kernel.head_dim_problem(head_dim)


def announce(message: str) -> None:
    """Log ``message`` (INFO, "megatron_2d: " first) once per process, on rank 0 (or where torch.distributed is
    not initialised)."""
    if message in _ANNOUNCED:
        return
    _ANNOUNCED.add(message)
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("megatron_2d: %s", message)


def automatic_kernel(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> BlockKernel:
    """The first kernel of :func:`kernel_preference` that builds and takes ``dtype`` and ``head_dim``; a one-line
    warning for each one passed over. Raises ValueError naming every candidate's problem when none fits."""
    order = kernel_preference(device)
    if device.type == "cuda" and dtype not in CUDA_DTYPES:
        raise ValueError(
            f"attention_2d on CUDA runs fused kernels ({', '.join(order)}), which take fp16 or bf16, not {dtype}; "
            f"run the model in bf16/fp16 (Megatron: --bf16)"
        )
    passed: list[str] = []
    for name in order:
        try:
            kernel = _build(name)
        except ImportError as err:
            passed.append(f"{name}: {err}")
            continue
        problem = _problem(kernel, device, dtype, head_dim)
        if problem is not None:
            passed.append(f"{name}: {problem}")
            continue
        for reason in passed:
            warnings.warn(f"attention_2d passes over kernel {reason}; using {name}", stacklevel=4)
        what = f"{dtype}".replace("torch.", "") + ("" if head_dim is None else f", head dim {head_dim}")
        announce(f"attention kernel {name} ({what} on {device.type}" + _capability_note(device) + ")")
        return kernel
    raise ValueError(f"no attention kernel takes {dtype} with head dim {head_dim} here: " + "; ".join(passed))


def _capability_note(device: torch.device) -> str:
    capability = cuda_capability(device) if device.type == "cuda" else None
    return "" if capability is None else f" sm{capability[0]}{capability[1]}"


def automatic_kernel_name(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """The name of the kernel chosen when none is named (raises where none fits)."""
    return automatic_kernel(device, dtype, head_dim).name


def select_kernel(
    device: torch.device, dtype: torch.dtype, name: str | None = None, head_dim: int | None = None
) -> BlockKernel:
    """The block kernel for ``device``/``dtype`` (and q/k/v head dim ``head_dim``, checked when given): ``name``
    if given, else the best that runs there (:func:`automatic_kernel`). Raises ValueError naming the problem."""
    if name is None:
        return automatic_kernel(device, dtype, head_dim)
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)} or None (automatic)")
    try:
        kernel = _build(name)
    except ImportError as err:
        raise ValueError(f"attention kernel {name!r} is not available here ({err})") from err
    if not kernel.supports(device, dtype):
        raise ValueError(f"attention kernel {name!r} does not run on device {device.type} with {dtype}")
    problem = None if head_dim is None else kernel.head_dim_problem(head_dim)
    if problem is not None:
        raise ValueError(f"attention kernel {name!r}: {problem}")
    return kernel


__all__ = [
    "BlockKernel",
    "KERNELS",
    "automatic_kernel",
    "automatic_kernel_name",
    "kernel_preference",
    "select_kernel",
    "CpuFlashKernel",
    "FlashAttn2Kernel",
    "TeFusedKernel",
    "TorchCudnnKernel",
    "TorchFlashKernel",
    "TorchMathKernel",
]
