"""A CPU stand-in for flash-attn's low-level kernels, so that ring-flash-attn's rings run on CPU ranks.

ring-flash-attn 0.1.8 imports ``flash_attn.flash_attn_interface._flash_attn_forward`` and ``_flash_attn_backward``
at import time and calls them by keyword, introspecting their signature (flash-attn >= 2.6 style: separate
``window_size_left`` / ``window_size_right``, a ``softcap``). The functions below have that signature and run
torch's CPU flash kernel (through :class:`megatron_2d.kernels.CpuFlashKernel`). Only what the fixed-length rings
use is supported: no dropout, no sliding window, no softcap, no ALiBi; anything else raises.

Layouts (flash-attn's):
    q, out, dout, dq   [b, s_q, h_q, d]
    k, v, dk, dv       [b, s_k, h_kv, d]     h_kv divides h_q (GQA)
    softmax_lse        [b, h_q, s_q]         fp32, natural log
    causal             only with s_q == s_k (flash-attn aligns the mask bottom-right; the rings only use it on
                       square diagonal blocks, where both conventions agree)

Nothing here is used on a GPU: :func:`flash_attn_stand_in` installs the module only when the real flash_attn
cannot be found and CUDA is unavailable, and removes it again on exit. ``triton`` is never faked.

    with flash_attn_stand_in():
        zigzag = load_ring_flash_attn_module("zigzag_ring_flash_attn")
    out = zigzag.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from typing import Iterator, Optional, Tuple

import torch

from megatron_2d.kernels import CpuFlashKernel

_KERNEL = CpuFlashKernel()
_PRIVATE_PACKAGE = "_ring_flash_attn_core"
STAND_IN_VERSION = "0.0.0+megatron_2d.cpu_stand_in"


def _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes) -> None:
    """Raise NotImplementedError naming the first option this stand-in does not implement."""
    if dropout_p:
        raise NotImplementedError(f"CPU flash_attn stand-in: dropout_p={dropout_p} (only 0 is supported)")
    if (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError(f"CPU flash_attn stand-in: window_size=({window_size_left}, {window_size_right}) "
                                  f"(only (-1, -1), no sliding window)")
    if softcap:
        raise NotImplementedError(f"CPU flash_attn stand-in: softcap={softcap} (only 0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("CPU flash_attn stand-in: alibi_slopes are not supported")


def _check_causal_square(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"CPU flash_attn stand-in: causal with s_q={q.shape[1]} != s_k={k.shape[1]} "
                                  f"(flash-attn's bottom-right mask is not implemented)")


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn 2.6's ``_flash_attn_forward``: returns (out [b, s, hq, d], softmax_lse [b, hq, s] fp32, None, None).

    The two Nones stand for the dropout mask (``return_softmax`` needs dropout, which is refused) and the RNG state.
    """
    _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check_causal_square(q, k, causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _KERNEL.forward(q, k, v, bool(causal), scale)
    return out.contiguous(), lse.contiguous(), None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """flash-attn 2.6's ``_flash_attn_backward``: writes dq, dk, dv in place (they may be views) and returns
    softmax_d = rowsum(dout * out) [b, hq, s] in fp32, as flash-attn does."""
    _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check_causal_square(q, k, causal)
    if dq is None or dk is None or dv is None:
        raise ValueError("CPU flash_attn stand-in: dq, dk and dv output buffers are required")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    gq, gk, gv = _KERNEL.backward(dout, q, k, v, out, softmax_lse.contiguous(), bool(causal), scale)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    # [b, s, hq, d] -> [b, hq, s]
    return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


def _varlen_unsupported(*args, **kwargs):
    raise NotImplementedError("CPU flash_attn stand-in covers only the fixed-length kernels "
                              "(_flash_attn_forward/_flash_attn_backward), not the varlen ones")


def _stand_in_modules() -> Tuple[types.ModuleType, types.ModuleType]:
    """Fresh ``flash_attn`` and ``flash_attn.flash_attn_interface`` module objects holding the stand-in."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.__doc__ = "CPU stand-in (megatron_2d.testing.flash_attn_cpu); not flash-attn."
    interface._flash_attn_forward = _flash_attn_forward
    interface._flash_attn_backward = _flash_attn_backward
    interface._flash_attn_varlen_forward = _varlen_unsupported
    interface._flash_attn_varlen_backward = _varlen_unsupported
    package = types.ModuleType("flash_attn")
    package.__doc__ = interface.__doc__
    package.__path__ = []                       # a package, so "import flash_attn.flash_attn_interface" resolves
    package.__version__ = STAND_IN_VERSION
    package.flash_attn_interface = interface
    return package, interface


def real_flash_attn_present() -> bool:
    """True when an installed flash_attn (not this stand-in) can be imported by name."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return getattr(module, "__version__", None) != STAND_IN_VERSION
    return importlib.util.find_spec("flash_attn") is not None


def install_flash_attn_stand_in() -> bool:
    """Put the stand-in into ``sys.modules`` for the rest of this process; returns whether it was installed.

    Does nothing (returns False) when the real flash_attn is importable or CUDA is available: on a GPU the real
    kernels must be used, never this one. Meant for forked benchmark ranks; tests prefer :func:`flash_attn_stand_in`.
    """
    if real_flash_attn_present() or torch.cuda.is_available():
        return False
    package, interface = _stand_in_modules()
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface
    return True


@contextlib.contextmanager
def flash_attn_stand_in() -> Iterator[bool]:
    """Install the stand-in for the duration of the block (see :func:`install_flash_attn_stand_in`); yields whether
    it was installed. Modules imported inside the block keep their references to the stand-in functions."""
    installed = install_flash_attn_stand_in()
    try:
        yield installed
    finally:
        if installed:
            sys.modules.pop("flash_attn.flash_attn_interface", None)
            sys.modules.pop("flash_attn", None)


def load_ring_flash_attn_module(name: str = "zigzag_ring_flash_attn") -> types.ModuleType:
    """Import one module of ring-flash-attn (e.g. ``zigzag_ring_flash_attn``) without its package ``__init__``.

    ring-flash-attn 0.1.8's ``__init__`` imports its HuggingFace adapter, which imports ``transformers``; the ring
    modules themselves need only torch, flash_attn's kernels and the package's ``utils``. The module is loaded
    under a private package name (``_ring_flash_attn_core``), so ``import ring_flash_attn`` elsewhere is unaffected.
    flash_attn (real, or the stand-in) must be importable while this runs. Raises ImportError naming the fix when
    ring-flash-attn is not installed.
    """
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("ring-flash-attn is not installed: pip install ring-flash-attn "
                          "(it is listed in requirements-dev.txt)")
    package: Optional[types.ModuleType] = sys.modules.get(_PRIVATE_PACKAGE)
    if package is None:
        package = types.ModuleType(_PRIVATE_PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        package.__doc__ = "ring-flash-attn's ring modules, loaded without the package __init__ (see flash_attn_cpu)"
        sys.modules[_PRIVATE_PACKAGE] = package
    return importlib.import_module(f"{_PRIVATE_PACKAGE}.{name}")
