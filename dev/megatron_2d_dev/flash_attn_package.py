"""Real flash-attn releases on CPU: each release's own Python layer over a CPU ``flash_attn_2_cuda`` extension.

What runs is the release's ``flash_attn/flash_attn_interface.py`` as published (its public functions, its autograd
Functions, and from 2.7 on its ``torch.library`` custom ops); only the compiled extension is replaced, by a module
whose ``fwd``, ``bwd``, ``varlen_fwd`` and ``varlen_bwd`` take exactly the C++ functions' positional arguments of
that release (``csrc/flash_attn/flash_api.cpp``, in the order the release's interface passes them) and compute them
on CPU (:func:`megatron_2d_dev.flash_attn_cpu.flash_forward` / ``flash_backward``: fp32 accumulation, masks
aligned bottom-right, lse = +inf for rows that see no key), with the window the C++ hands its kernels
(:func:`~megatron_2d_dev.flash_attn_cpu.kernel_window`: normalised against s_k, or a varlen call's
max_seqlen_k). From 2.7 the custom ops are registered for "cuda" only;
:func:`load_release` registers each op's own body (``_init_fn``) as its CPU kernel, so calls go through the real
custom-op objects.

Setup (``tools/install.sh`` runs it; each release installs once into its own folder, nothing is compiled):

    python -m megatron_2d_dev.flash_attn_package install        # RELEASES into releases_dir()

Use, in a process that will not import another release (forked ranks; a release's custom ops cannot be
registered twice in one process):

    interface = load_release("2.8.3.post2")                           # flash_attn.flash_attn_interface

The extension's ABIs, as the releases' flash_api.cpp declare them:
    "2.5"  (2.5.8)        no softcap; fwd returns (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state);
                          varlen lse [batch, h, max_seqlen_q] (padded), varlen softmax_d [batch, h, round128(max)]
    "2.6"  (2.6.3)        softcap after window_size_right, leftpad_k in varlen_fwd; varlen lse [h, total_q],
                          varlen softmax_d [h, total_q + 128 * batch]
    "2.7"  (2.7.x, 2.8.x) as 2.6, but fwd returns (out, softmax_lse, S_dmask, rng_state), and fwd refuses a head
                          dim that is not a multiple of 8 (the Python layer pads before calling it)
Not implemented (NotImplementedError): dropout, ALiBi, softmax return, paged K/V, seqused_k/leftpad_k, kv-cache.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import importlib
import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .flash_attn_cpu import flash_backward, flash_forward, kernel_window

RELEASES = ("2.5.8", "2.6.3", "2.7.4.post1", "2.8.3.post2")
RELEASES_ENV = "MEGATRON_2D_FLASH_ATTN_RELEASES"

_ARGS_2_5 = {
    "fwd": (
        "q",
        "k",
        "v",
        "out_",
        "alibi_slopes_",
        "p_dropout",
        "softmax_scale",
        "is_causal",
        "window_size_left",
        "window_size_right",
        "return_softmax",
        "gen_",
    ),
    "varlen_fwd": (
        "q",
        "k",
        "v",
        "out_",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "seqused_k",
        "block_table_",
        "alibi_slopes_",
        "max_seqlen_q",
        "max_seqlen_k",
        "p_dropout",
        "softmax_scale",
        "zero_tensors",
        "is_causal",
        "window_size_left",
        "window_size_right",
        "return_softmax",
        "gen_",
    ),
    "bwd": (
        "dout",
        "q",
        "k",
        "v",
        "out",
        "softmax_lse",
        "dq_",
        "dk_",
        "dv_",
        "alibi_slopes_",
        "p_dropout",
        "softmax_scale",
        "is_causal",
        "window_size_left",
        "window_size_right",
        "deterministic",
        "gen_",
        "rng_state",
    ),
    "varlen_bwd": (
        "dout",
        "q",
        "k",
        "v",
        "out",
        "softmax_lse",
        "dq_",
        "dk_",
        "dv_",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "alibi_slopes_",
        "max_seqlen_q",
        "max_seqlen_k",
        "p_dropout",
        "softmax_scale",
        "zero_tensors",
        "is_causal",
        "window_size_left",
        "window_size_right",
        "deterministic",
        "gen_",
        "rng_state",
    ),
}


def _with(args: tuple[str, ...], after: str, name: str) -> tuple[str, ...]:
    i = args.index(after) + 1
    return args[:i] + (name,) + args[i:]


_ARGS_2_6 = {fn: _with(args, "window_size_right", "softcap") for fn, args in _ARGS_2_5.items()}
_ARGS_2_6["varlen_fwd"] = _with(_ARGS_2_6["varlen_fwd"], "seqused_k", "leftpad_k_")


@dataclass(frozen=True)
class ExtensionABI:
    """How one release's C++ extension is called and what it returns."""

    name: str
    args: dict[str, tuple[str, ...]]  # function -> its positional parameters, in order
    fwd_returns_inputs: bool  # fwd returns (out, q, k, v, out_padded, lse, S_dmask, rng_state)
    padded_varlen_lse: bool  # varlen lse [batch, h, max_seqlen_q] (else [h, total_q])
    fwd_pads_head_dim: bool  # fwd pads a head dim that is not a multiple of 8 (else refuses it)


ABIS = {
    "2.5": ExtensionABI("2.5", _ARGS_2_5, fwd_returns_inputs=True, padded_varlen_lse=True, fwd_pads_head_dim=True),
    "2.6": ExtensionABI("2.6", _ARGS_2_6, fwd_returns_inputs=True, padded_varlen_lse=False, fwd_pads_head_dim=True),
    "2.7": ExtensionABI("2.7", _ARGS_2_6, fwd_returns_inputs=False, padded_varlen_lse=False, fwd_pads_head_dim=False),
}


def abi_of(version: str) -> ExtensionABI:
    """The extension ABI of a flash-attn 2 release (2.5 to 2.8)."""
    major_minor = ".".join(version.split(".")[:2])
    key = {"2.5": "2.5", "2.6": "2.6", "2.7": "2.7", "2.8": "2.7"}.get(major_minor)
    if key is None:
        raise ValueError(f"flash-attn {version}: no CPU extension for this release; known: 2.5 to 2.8")
    return ABIS[key]


# ---- the CPU extension ----------------------------------------------------------------------------------------


def _bind(abi: ExtensionABI, fn: str, args: tuple) -> dict[str, object]:
    names = abi.args[fn]
    if len(args) != len(names):
        raise TypeError(
            f"{fn}(): flash-attn {abi.name}'s extension takes {len(names)} positional arguments "
            f"({', '.join(names)}), got {len(args)}"
        )
    return dict(zip(names, args))


def _check(a: dict[str, object], abi: ExtensionABI, fn: str) -> None:
    """The C++ checks that matter here, with the C++ messages; NotImplementedError for what is not emulated."""
    q = a["q"]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if not (q.dtype == a["k"].dtype == a["v"].dtype):
        raise RuntimeError("query and key must have the same dtype")
    d = q.shape[-1]
    backward = fn.endswith("bwd")
    if d > 256:
        raise RuntimeError(
            f"FlashAttention {'backward' if backward else 'forward'} only supports head dimension at most 256"
        )
    if d % 8 and backward:
        raise RuntimeError("head_size should be a multiple of 8")
    if d % 8 and not abi.fwd_pads_head_dim:
        raise RuntimeError("query, key, value, and out_ must have a head_size that is a multiple of 8")
    unsupported = [
        name for name in ("alibi_slopes_", "block_table_", "seqused_k", "leftpad_k_") if a.get(name) is not None
    ]
    if a["p_dropout"]:
        unsupported.append(f"p_dropout={a['p_dropout']}")
    if a.get("return_softmax"):
        unsupported.append("return_softmax")
    if unsupported:
        raise NotImplementedError(f"CPU flash_attn_2_cuda ({fn}): {', '.join(unsupported)} not emulated")


def _window(a: dict[str, object], seqlen_k: int) -> tuple[bool, int, int, float]:
    """(causal, left, right, softcap) as the C++ hands them to its kernels (:func:`kernel_window`): ``seqlen_k``
    is the block's key count, or a varlen call's max_seqlen_k."""
    causal, left, right = kernel_window(
        bool(a["is_causal"]), int(a["window_size_left"]), int(a["window_size_right"]), seqlen_k
    )
    return causal, left, right, float(a.get("softcap", 0.0))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _into(buffer, value: torch.Tensor) -> torch.Tensor:
    """Write into the caller's output buffer (out_, dq_, ...) when given, else return the value."""
    if buffer is None:
        return value
    buffer.copy_(value)
    return buffer


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """The head dim padded with zeros to a multiple of 8, as the C++ pads it (< 2.7)."""
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % 8))


def _fwd(abi: ExtensionABI, *args):
    a = _bind(abi, "fwd", args)
    _check(a, abi, "fwd")
    q, k, v = (_pad8(a[n]) for n in ("q", "k", "v"))
    causal, left, right, softcap = _window(a, k.shape[1])
    out_padded, lse = flash_forward(q, k, v, float(a["softmax_scale"]), causal, left, right, softcap)
    out = _into(a["out_"], out_padded[..., : a["q"].shape[-1]])
    rest = (lse.contiguous(), torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64))
    return [out, q, k, v, out_padded, *rest] if abi.fwd_returns_inputs else [out, *rest]


def _bwd(abi: ExtensionABI, *args):
    a = _bind(abi, "bwd", args)
    _check(a, abi, "bwd")
    dout, q, k, v, out = (a[n] for n in ("dout", "q", "k", "v", "out"))
    if q.shape[-1] != dout.shape[-1] + (-dout.shape[-1] % 8):
        raise RuntimeError("head_size must be head_size_og rounded to a multiple of 8")
    dout = _pad8(dout)  # the C++ pads dout to q's head dim
    causal, left, right, softcap = _window(a, k.shape[1])
    grads = flash_backward(
        dout, q, k, v, out, a["softmax_lse"], float(a["softmax_scale"]), causal, left, right, softcap
    )
    dq, dk, dv = (_into(a[name], g) for name, g in zip(("dq_", "dk_", "dv_"), grads))
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # rowsum(dout * out) [b, h, s_q]
    softmax_d = torch.nn.functional.pad(d, (0, _round_up(q.shape[1], 128) - q.shape[1]))
    return [dq, dk, dv, softmax_d]


def _sequences(a: dict[str, object]) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence of a varlen call (host reads of cu_seqlens: CPU only)."""
    cq, ck = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _varlen_fwd(abi: ExtensionABI, *args):
    a = _bind(abi, "varlen_fwd", args)
    _check(a, abi, "varlen_fwd")
    q, k, v = a["q"], a["k"], a["v"]
    seqs, max_q = _sequences(a), int(a["max_seqlen_q"])
    out = torch.empty_like(q)
    lse = (
        torch.full((len(seqs), q.shape[1], max_q), float("inf"))
        if abi.padded_varlen_lse
        else torch.empty(q.shape[1], q.shape[0])
    )
    causal, left, right, softcap = _window(a, int(a["max_seqlen_k"]))
    for n, (rq, rk) in enumerate(seqs):
        o, s = flash_forward(
            q[rq].unsqueeze(0),
            k[rk].unsqueeze(0),
            v[rk].unsqueeze(0),
            float(a["softmax_scale"]),
            causal,
            left,
            right,
            softcap,
        )
        out[rq] = o[0]
        if abi.padded_varlen_lse:
            lse[n, :, : rq.stop - rq.start] = s[0]
        else:
            lse[:, rq] = s[0]
    out = _into(a["out_"], out)
    rest = (lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64))
    return [out, q, k, v, out, *rest] if abi.fwd_returns_inputs else [out, *rest]


def _varlen_bwd(abi: ExtensionABI, *args):
    a = _bind(abi, "varlen_bwd", args)
    _check(a, abi, "varlen_bwd")
    dout, q, k, v, out, lse = (a[n] for n in ("dout", "q", "k", "v", "out", "softmax_lse"))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    seqs = _sequences(a)
    causal, left, right, softcap = _window(a, int(a["max_seqlen_k"]))
    for n, (rq, rk) in enumerate(seqs):
        rows = lse[n, :, : rq.stop - rq.start] if abi.padded_varlen_lse else lse[:, rq]
        g = flash_backward(
            *(x[r].unsqueeze(0) for x, r in ((dout, rq), (q, rq), (k, rk), (v, rk), (out, rq))),
            rows.unsqueeze(0).contiguous(),
            float(a["softmax_scale"]),
            causal,
            left,
            right,
            softcap,
        )
        dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
    d = (dout.float() * out.float()).sum(-1).t()  # [h, total_q]
    if abi.padded_varlen_lse:
        rounded = _round_up(int(a["max_seqlen_q"]), 128)
        softmax_d = torch.zeros(len(seqs), q.shape[1], rounded)
        for n, (rq, _) in enumerate(seqs):
            softmax_d[n, :, : rq.stop - rq.start] = d[:, rq]
    else:
        softmax_d = torch.nn.functional.pad(d, (0, 128 * len(seqs)))
    grads = (_into(a[name], g) for name, g in zip(("dq_", "dk_", "dv_"), (dq, dk, dv)))
    return [*grads, softmax_d]


def cpu_extension(abi: ExtensionABI) -> types.ModuleType:
    """A ``flash_attn_2_cuda`` module of one ABI whose four functions compute on CPU; ``module.calls`` counts the
    calls per function.

    To its callers the extension is compiled code: Python's torch function and dispatch modes (the no-sync guards
    of tests/test_hot_path.py) do not see inside it. Its host reads of cu_seqlens are this stand-in's own (the CUDA
    kernels read them on the device), so they run with the modes suspended."""
    module = types.ModuleType("flash_attn_2_cuda")
    module.__doc__ = f"CPU stand-in of flash-attn's compiled extension, ABI {abi.name} (megatron_2d_dev)"
    module.abi, module.calls = abi, collections.Counter()
    for name, impl in (("fwd", _fwd), ("bwd", _bwd), ("varlen_fwd", _varlen_fwd), ("varlen_bwd", _varlen_bwd)):

        def call(*args, _impl=impl, _name=name):
            module.calls[_name] += 1
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                return _impl(abi, *args)

        call.__name__ = call.__qualname__ = name
        setattr(module, name, call)
    return module


# ---- the installed releases -----------------------------------------------------------------------------------


def releases_dir() -> pathlib.Path:
    """Where the releases are installed: $MEGATRON_2D_FLASH_ATTN_RELEASES, else <venv>/flash-attn-releases."""
    return pathlib.Path(os.environ.get(RELEASES_ENV) or pathlib.Path(sys.prefix) / "flash-attn-releases")


def release_path(version: str) -> pathlib.Path:
    return releases_dir() / version


def is_installed(version: str) -> bool:
    return (release_path(version) / "flash_attn" / "flash_attn_interface.py").is_file()


CUSTOM_OPS = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)


def load_release(version: str) -> types.ModuleType:
    """Import flash-attn ``version`` (installed by :func:`install`) over the CPU extension of its ABI; returns its
    ``flash_attn.flash_attn_interface``. Replaces any flash_attn already imported in this process, so call it
    once per process (forked ranks)."""
    if not is_installed(version):
        raise FileNotFoundError(
            f"flash-attn {version} is not installed under {releases_dir()}; run "
            f"'python -m megatron_2d_dev.flash_attn_package install' (tools/install.sh "
            f"does)"
        )
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith(("flash_attn.", "flash_attn_2_cuda"))]:
        del sys.modules[name]
    sys.modules["flash_attn_2_cuda"] = cpu_extension(abi_of(version))
    path = str(release_path(version))
    sys.path.insert(0, path)
    try:
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    finally:
        sys.path.remove(path)
    if importlib.import_module("flash_attn").__version__ != version:
        raise ImportError(
            f"imported flash_attn {sys.modules['flash_attn'].__version__} from {path}, expected {version}"
        )
    for name in CUSTOM_OPS:
        op = getattr(interface, name, None)
        if hasattr(op, "register_kernel"):  # a torch.library custom op (2.7 on), "cuda" only
            op.register_kernel("cpu")(op._init_fn)
    return interface


def install(versions: Sequence[str] = RELEASES, python: str = sys.executable) -> list[str]:
    """Install each missing release's Python layer into its own folder (no CUDA build; at once); returns the
    versions installed now. pip caches the downloads, so a second setup does not fetch them again."""
    missing = [v for v in versions if not is_installed(v)]
    env = dict(os.environ, FLASH_ATTENTION_FORCE_BUILD="TRUE", FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")

    def one(version: str) -> str:
        target = release_path(version)
        staging = target.with_name(target.name + ".partial")
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--quiet",
                "--disable-pip-version-check",
                "--no-build-isolation",
                "--no-deps",
                "--upgrade",
                "--target",
                str(staging),
                f"flash-attn=={version}",
            ],
            env=env,
            check=True,
        )
        staging.rename(target)
        return version

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:
        return list(pool.map(one, missing))


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description="Install flash-attn releases (Python layer only) for CPU tests")
    parser.add_argument("command", choices=["install", "list"])
    args = parser.parse_args(argv or None)
    if args.command == "install":
        releases_dir().mkdir(parents=True, exist_ok=True)
        done = install()
        print(
            f"flash-attn releases in {releases_dir()}: {', '.join(RELEASES)}"
            + (f" (installed now: {', '.join(done)})" if done else "")
        )
    else:
        for version in RELEASES:
            print(version, "installed" if is_installed(version) else "missing", release_path(version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
