"""Local block kernels behind one interface, chosen by device (overridable by name).

    cpu_flash    torch's CPU flash kernel                          CPU, any float dtype
    flash_attn2  flash-attn 2                                      CUDA, fp16/bf16, when installed (2.5 to 2.8)
    torch_flash  PyTorch's own CUDA flash kernel (no flash-attn)   CUDA, fp16/bf16
    torch_math   explicit [b, h, s_q, s_k] scores, in fp32/fp64   CPU only (a reference: memory quadratic)

Automatic choice: cpu_flash on CPU; on CUDA flash_attn2 when flash-attn imports, else torch_flash (fp16/bf16 only:
both flash kernels refuse fp32, and a kernel that materialises scores would not fit at long-context block sizes).
Head dims are checked at selection (flash kernels: a multiple of 8, at most 256), so a bad one fails before the
first step instead of in the first backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .base import BlockKernel
from .cpu_flash import CpuFlashKernel
from .flash_attn2 import FlashAttn2Kernel, flash_attn_available
from .torch_flash import TorchFlashKernel
from .torch_math import TorchMathKernel

KERNELS: dict[str, Callable[[], BlockKernel]] = {
    "cpu_flash": CpuFlashKernel,
    "flash_attn2": FlashAttn2Kernel,
    "torch_flash": TorchFlashKernel,
    "torch_math": TorchMathKernel,
}
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def automatic_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel chosen when none is named (raises where none fits)."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and dtype in FLASH_DTYPES:
        if flash_attn_available():
            return "flash_attn2"
        warnings.warn(
            "flash-attn is not installed: attention_2d uses PyTorch's own flash kernel (torch_flash); "
            "install flash-attn 2 for its native sliding windows and varlen launches",
            stacklevel=4,
        )
        return "torch_flash"
    if device.type == "cuda":
        raise ValueError(
            f"attention_2d on CUDA runs flash kernels, which take fp16 or bf16, not {dtype}; run the "
            f"model in bf16/fp16 (Megatron: --bf16)"
        )
    raise ValueError(f"no attention kernel runs on device type {device.type!r}; kernels: {sorted(KERNELS)}")


def select_kernel(
    device: torch.device, dtype: torch.dtype, name: str | None = None, head_dim: int | None = None
) -> BlockKernel:
    """The block kernel for ``device``/``dtype`` (and q/k/v head dim ``head_dim``, checked when given): ``name``
    if given, else the best that runs there. Raises ValueError naming the problem."""
    chosen = automatic_kernel_name(device, dtype) if name is None else name
    if chosen not in KERNELS:
        raise ValueError(f"unknown attention kernel {chosen!r}; choose one of {sorted(KERNELS)} or None (automatic)")
    try:
        kernel = KERNELS[chosen]()
    except ImportError as err:
        raise ValueError(
            f"attention kernel {chosen!r} is not available here ({err})"
            + ("; use kernel=None to choose automatically" if name is not None else "")
        ) from err
    if not kernel.supports(device, dtype):
        raise ValueError(f"attention kernel {chosen!r} does not run on device {device.type} with {dtype}")
    problem = None if head_dim is None else kernel.head_dim_problem(head_dim)
    if problem is not None:
        raise ValueError(f"attention kernel {chosen!r}: {problem}")
    return kernel


__all__ = [
    "BlockKernel",
    "KERNELS",
    "automatic_kernel_name",
    "select_kernel",
    "CpuFlashKernel",
    "FlashAttn2Kernel",
    "TorchFlashKernel",
    "TorchMathKernel",
]
