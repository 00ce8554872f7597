"""Local block kernels behind one interface, chosen by device (overridable by name).

    cpu_flash    torch's CPU flash kernel                       CPU, any float dtype
    flash_attn2  flash-attn 2                                   CUDA, fp16/bf16, when installed
    torch_math   explicit scores in fp32, any device and dtype  the GPU fallback without flash-attn
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional

import torch

from .base import BlockKernel
from .cpu_flash import CpuFlashKernel
from .flash_attn2 import FlashAttn2Kernel, flash_attn_available
from .torch_math import TorchMathKernel

KERNELS: Dict[str, Callable[[], BlockKernel]] = {
    "cpu_flash": CpuFlashKernel,
    "flash_attn2": FlashAttn2Kernel,
    "torch_math": TorchMathKernel,
}


def select_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None) -> BlockKernel:
    """The block kernel for ``device``/``dtype``: ``name`` if given (checked), else the best that runs there."""
    if name is None:
        if device.type == "cpu":
            name = "cpu_flash"
        elif device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
            name = "flash_attn2"
        else:
            name = "torch_math"
            if device.type == "cuda":
                warnings.warn(f"attention_2d on CUDA with {dtype} uses the torch_math block kernel (explicit scores, "
                              f"slow); install flash-attn 2 and use fp16/bf16 for the flash kernel", stacklevel=3)
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)} or None (automatic)")
    try:
        kernel = KERNELS[name]()
    except ImportError as err:
        raise ValueError(f"attention kernel {name!r} is not available here ({err}); "
                         f"use kernel=None to choose automatically") from err
    if not kernel.supports(device, dtype):
        raise ValueError(f"attention kernel {name!r} does not run on device {device.type} with {dtype}")
    return kernel


__all__ = ["BlockKernel", "KERNELS", "select_kernel", "CpuFlashKernel", "FlashAttn2Kernel", "TorchMathKernel"]
