"""Real Transformer Engine releases on CPU: each release's own Python layer over a CPU ``transformer_engine_torch``.

What runs is the release's ``transformer_engine`` package as published (the pure-Python ``transformer-engine`` wheel:
``transformer_engine.pytorch`` imported whole, ``cpp_extensions.fused_attn_fwd`` / ``fused_attn_bwd`` as TE's
``context_parallel.py`` calls them); only the compiled parts are replaced:

    libtransformer_engine.so, cuDNN, NVRTC   not loaded: the release's own switch for that, NVTE_PROJECT_BUILDING
                                             (set while the package imports), skips its ctypes loads
    transformer_engine_torch                 a module made here (:func:`cpu_extension`): its enums hold the member
                                             names the release's Python layer references (read from its source),
                                             the other names it imports are placeholders that raise when called,
                                             and ``fused_attn_fwd`` / ``fused_attn_bwd`` take the release's
                                             positional arguments (:data:`ABIS`) and compute on CPU
    load_framework_extension("torch")        the release's loader of that shared object, made a no-op for it

The CPU functions compute what TE's F16_arbitrary_seqlen backend computes for the calls the te_fused kernel and
TE's own context parallelism make, and refuse the rest (NotImplementedError): layouts (:data:`LAYOUTS`) bshd, sbhd,
thd, and 2.5's bs2hd / sb2hd (K and V interleaved; dK and dV come back interleaved in one dKV buffer, as the
extension allocates them); masks no_mask, causal and padding variants (causal top-left, ``*_bottom_right``
bottom-right); window (-1, -1), or (-1, 0) with a causal mask (a causal mask reads (-1, -1) as (-1, 0)); no bias,
dropout, FP8, paged K/V or non-vanilla softmax. Tensors are read as the extension reads them: from their data
pointer with their layout's strides. THD sequences start at ``cu_seqlens_*_padded`` and hold ``cu_seqlens_*`` real
tokens (TE's padding between sequences); O and the gradients are zero elsewhere, and a query run whose sequence has
no key in the call gets O = 0 and stats -inf (what TE's merges then ignore). Outputs ``[O, softmax stats
(natural-log log-sum-exp, fp32), rng_state]``: stats [b, h, s_q, 1] for bshd / sbhd, for thd [total_q, h, 1] or, as
older TE / cuDNN lay them out, [b, h, max_seqlen_q, 1] (``thd_stats``, which also picks the cuDNN version the
extension reports, :data:`CUDNN_VERSIONS`). With ``return_max_logit`` (2.12's and 2.20's ABI) the forward also
returns cuDNN's per-row max of the scaled, masked scores (fp32, laid out as the stats; -inf for a query run with no
key in the call; THD rows that hold no query, the padded layout's and TE's padding between sequences, carry
garbage, as unwritten device memory would): ``[O, Max, Sum_Exp, rng_state]`` for 2.12 (the Python layer makes the
stats Max + log(Sum_Exp)), ``[O, Stats, Max, rng_state]`` for 2.20. ``get_fused_attn_backend`` answers
F16_arbitrary_seqlen for exactly the calls the functions compute, in each release's ABI. The ``tex.thd_*`` helpers
of TE's THD context parallelism are :mod:`.te_thd_cpu`'s. Math: torch's CPU flash kernel (V zero-padded to q's head
dim).

Setup (``tools/install.sh`` runs it; each release installs once into its own folder, nothing is compiled, and the
packages TE's PyTorch layer imports from 2.8 on, onnxscript and onnx, into one more):

    python -m megatron_2d_dev.te_package install

Use, in a process that will import no other release (forked ranks):

    fused_attn = load_release("2.20.2")       # transformer_engine.pytorch.cpp_extensions.fused_attn
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import enum
import functools
import importlib
import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from megatron_2d.kernels.base import band_mask
from megatron_2d.kernels.cpu_flash import CpuFlashKernel
from megatron_2d.kernels.torch_math import TorchMathKernel
from megatron_2d.layout.band import Band

from . import te_thd_cpu

RELEASES = ("2.5.0", "2.8.0", "2.12.0", "2.20.2")
RELEASES_ENV = "MEGATRON_2D_TE_RELEASES"
DEPENDENCIES = ("onnxscript==0.7.2", "onnx==1.23.2", "onnx_ir==1.1.0", "ml_dtypes==0.7.0", "protobuf==7.36.2")
"""What ``transformer_engine.pytorch`` imports from 2.8 on beyond torch (``export.py``: onnxscript, onnx)."""
DEPENDENCIES_DIR = "_deps"

_FWD_2_5 = (
    "max_seqlen_q", "max_seqlen_kv", "is_training", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
    "attn_bias_type", "attn_mask_type", "window_size", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "fake_dtype",
    "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v", "s_quantizer", "o_quantizer",
    "attn_bias", "rng_gen", "rng_elts_per_thread",
)  # fmt: skip
_BWD_2_5 = (
    "max_seqlen_q", "max_seqlen_kv", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type",
    "attn_mask_type", "window_size", "deterministic", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o",
    "fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer",
    "dp_quantizer", "dqkv_quantizer",
)  # fmt: skip


def _with(args: tuple[str, ...], after: str, *names: str) -> tuple[str, ...]:
    i = args.index(after) + 1
    return args[:i] + names + args[i:]


_FWD_2_8 = _with(_with(_FWD_2_5, "attn_mask_type", "softmax_type"), "attn_bias", "softmax_offset")
_BWD_2_8 = _with(_BWD_2_5, "attn_mask_type", "softmax_type")
_FWD_2_12 = _with(_FWD_2_8, "window_size", "bottom_right_diagonal") + ("return_max_logit", "cuda_graph")
_BWD_2_12 = _with(_BWD_2_8, "window_size", "bottom_right_diagonal") + ("cuda_graph",)
_FWD_2_20 = _with(_FWD_2_12, "qkv_layout", "o_format", "qkv_scale_inv_format")
_BWD_2_20 = tuple(
    a
    for a in _with(_BWD_2_12, "qkv_layout", "o_format", "do_format", "dqkv_layout", "qkv_scale_inv_format",
                   "do_scale_inv_format")
    if a != "dqkv_dtype"
)  # fmt: skip


@dataclass(frozen=True)
class ExtensionABI:
    """How one release family's Python layer calls ``tex.fused_attn_fwd`` / ``fused_attn_bwd``: the positional
    parameters, named as the Python layer names what it passes (an enum argument by the string it is looked up
    from), and how many gradients the backward returns after dQ, dK, dV."""

    name: str
    fwd: tuple[str, ...]
    bwd: tuple[str, ...]
    extra_grads: int


ABIS = {
    "2.5": ExtensionABI("2.5", _FWD_2_5, _BWD_2_5, extra_grads=1),  # dBias
    "2.8": ExtensionABI("2.8", _FWD_2_8, _BWD_2_8, extra_grads=2),  # dBias, dSoftmaxOffset
    "2.12": ExtensionABI("2.12", _FWD_2_12, _BWD_2_12, extra_grads=2),
    "2.20": ExtensionABI("2.20", _FWD_2_20, _BWD_2_20, extra_grads=2),
}


def abi_of(version: str) -> ExtensionABI:
    """The extension ABI of a TE release (2.5 to 2.20)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (2, 5) or (major, minor) > (2, 20):
        raise ValueError(f"Transformer Engine {version}: no CPU extension for this release; known: 2.5 to 2.20")
    key = "2.5" if minor < 8 else "2.8" if minor < 12 else "2.12" if minor < 20 else "2.20"
    return ABIS[key]


# ---- the enums: the member names each release's Python layer references --------------------------------------


def referenced_names(package: pathlib.Path) -> tuple[dict[str, list[str]], list[str]]:
    """What the PyTorch layer under ``package`` takes from ``transformer_engine_torch``: ({enum: member names} as it
    references them, ``tex.Enum.member`` or ``Enum.member`` for an enum imported or re-exported by name; enums are
    its capitalised names), and every other name it reads from the module (``tex.name`` or imported by name).
    Read once per process (and per process tree: see :func:`prepare_forked_loads`); each caller gets its own copy."""
    enums, others = _read_referenced_names(str(package))
    return {name: list(members) for name, members in enums.items()}, list(others)


@functools.cache
def _read_referenced_names(package_dir: str) -> tuple[dict[str, list[str]], list[str]]:
    package = pathlib.Path(package_dir)
    found: dict[str, set[str]] = collections.defaultdict(set)
    imported: set[str] = set()
    for path in sorted((package / "pytorch").rglob("*.py")):
        source = path.read_text()
        if "transformer_engine_torch" not in source:
            continue  # no alias of the module in this file, so nothing below would match (half the files)
        nodes = list(ast.walk(ast.parse(source)))  # walked once, read three times
        module_aliases, name_aliases = set(), {}
        for node in nodes:
            if isinstance(node, ast.Import):
                module_aliases |= {a.asname or a.name for a in node.names if a.name == "transformer_engine_torch"}
            elif isinstance(node, ast.ImportFrom) and node.module == "transformer_engine_torch":
                name_aliases.update({a.asname or a.name: a.name for a in node.names if a.name != "*"})
        imported |= set(name_aliases.values())
        for node in nodes:  # module-level re-exports of an enum: ``RoutingMapFormat = tex.NVTE...`` (2.20)
            value = node.value if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if (
                isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id in module_aliases
                and isinstance(node.targets[0], ast.Name)
                and value.attr[:1].isupper()
            ):
                name_aliases[node.targets[0].id] = value.attr
        for node in nodes:
            if not isinstance(node, ast.Attribute) or node.attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in module_aliases:
                imported.add(node.attr)  # tex.name: bound when the module imports if in a signature or a default
            if (
                isinstance(owner, ast.Attribute)
                and isinstance(owner.value, ast.Name)
                and owner.value.id in module_aliases
            ):
                name = owner.attr
            elif isinstance(owner, ast.Name) and owner.id in name_aliases:
                name = name_aliases[owner.id]
            else:
                continue
            if name[:1].isupper():
                found[name].add(node.attr)
    return {name: sorted(members) for name, members in found.items()}, sorted(imported - set(found))


def _not_emulated(name: str):
    """A name of the compiled extension the te_fused kernel never calls: a class, or a function that says so."""
    if name[:1].isupper():
        return type(name, (), {"__module__": "transformer_engine_torch"})

    def missing(*args, **kwargs):
        raise NotImplementedError(f"CPU transformer_engine_torch: {name} is not emulated")

    missing.__name__ = missing.__qualname__ = name
    return missing


def _enum(name: str, members: Sequence[str]) -> type[enum.IntEnum]:
    """A pybind-like enum: a class whose int-valued members carry ``.name`` and ``__members__``."""
    return enum.IntEnum(name, [(m, i) for i, m in enumerate(members)], module="transformer_engine_torch")


# ---- the CPU functions ----------------------------------------------------------------------------------------


def _math(q: torch.Tensor, v: torch.Tensor):
    return TorchMathKernel() if v.shape[-1] > q.shape[-1] else CpuFlashKernel().for_head_dims(q.shape[-1], v.shape[-1])


def _row_max(q: torch.Tensor, k: torch.Tensor, band: Band | None, scale: float) -> torch.Tensor:
    """[b, h, s_q] fp32: each query row's max of scale * q . k over the keys ``band`` lets it see (scores in fp32,
    as cuDNN keeps them)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if band is not None:
        scores = scores + band_mask(band, q.shape[1], k.shape[1], torch.float32, q.device)
    return scores.amax(dim=-1)


UNWRITTEN = 1.0e4
"""What the stand-in leaves in the max rows of the padded THD layout that hold no query (see the module)."""


def _bind(names: tuple[str, ...], fn: str, args: tuple) -> dict[str, object]:
    if len(args) != len(names):
        raise TypeError(f"{fn}(): takes {len(names)} positional arguments ({', '.join(names)}), got {len(args)}")
    return dict(zip(names, args))


LAYOUTS = {  # qkv_layout -> (format, K and V interleaved in one [..., 2, h, d] buffer)
    "NVTE_BSHD_BSHD_BSHD": ("bshd", False),
    "NVTE_SBHD_SBHD_SBHD": ("sbhd", False),
    "NVTE_BSHD_BS2HD": ("bshd", True),
    "NVTE_SBHD_SB2HD": ("sbhd", True),
    "NVTE_THD_THD_THD": ("thd", False),
}
"""The layouts the CPU functions take: TE's CP passes sbhd (Megatron's) and, in 2.5's p2p, sb2hd / bs2hd."""
_MASKS = {  # mask -> (padding, causal alignment or None)
    "NVTE_NO_MASK": (False, None),
    "NVTE_CAUSAL_MASK": (False, "top_left"),
    "NVTE_CAUSAL_BOTTOM_RIGHT_MASK": (False, "bottom_right"),
    "NVTE_PADDING_MASK": (True, None),
    "NVTE_PADDING_CAUSAL_MASK": (True, "top_left"),
    "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK": (True, "bottom_right"),
}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Call:
    fmt: str  # "bshd", "sbhd" or "thd"
    kv_packed: bool  # K and V interleaved ([..., 2, h, d])
    causal: str | None  # causal alignment, None without a causal mask


def _unsupported(a: dict[str, object]) -> list[str]:
    """What of a call (fused_attn_fwd / _bwd arguments, or a backend query) the CPU functions do not compute."""
    layout, mask = a["qkv_layout"].name, a["attn_mask_type"].name
    unsupported = [] if layout in LAYOUTS else [f"qkv_layout {layout}"]
    if a["attn_bias_type"].name != "NVTE_NO_BIAS":
        unsupported.append(a["attn_bias_type"].name)
    if "softmax_type" in a and a["softmax_type"].name != "NVTE_VANILLA_SOFTMAX":
        unsupported.append(a["softmax_type"].name)
    if a["dropout"]:
        unsupported.append(f"dropout {a['dropout']}")
    for name in ("page_table_k", "page_table_v", "s_quantizer", "o_quantizer", "dp_quantizer", "dqkv_quantizer"):
        if a.get(name) is not None:
            unsupported.append(name)
    padding, causal = _MASKS.get(mask, (None, None))
    if not isinstance(a["window_size"], (tuple, list)) or len(a["window_size"]) != 2:
        raise TypeError(f"window_size must be a pair of ints (the extension's std::vector), got {a['window_size']!r}")
    window = tuple(a["window_size"])
    # cuDNN reads a causal mask with window (-1, -1) as (-1, 0); TE's CP passes either
    if window not in ((-1, -1), (-1, 0)) or (window == (-1, 0) and causal is None):
        unsupported.append(f"window {window} with {mask}")
    if layout in LAYOUTS and padding is not None and padding != (LAYOUTS[layout][0] == "thd"):
        unsupported.append(f"{mask} with {layout}")
    if padding is None:
        unsupported.append(mask)
    return unsupported


def _call(a: dict[str, object]) -> _Call:
    """The call's layout and mask, after the checks; NotImplementedError for what is not emulated."""
    q, k, v = a["q"], a["k"], a["v"]
    if q.dtype not in _HALF or not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(f"fused attention F16_arbitrary_seqlen takes fp16/bf16 q, k, v, got {q.dtype}")
    if a["fake_dtype"] != q.dtype:
        raise RuntimeError(f"fake_dtype {a['fake_dtype']} is not q's dtype {q.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[-1] % 8 or x.shape[-1] > 256:
            raise RuntimeError(f"cuDNN fused attention: {name} head dim {x.shape[-1]} is not a multiple of 8 <= 256")
    if q.shape[-2] % k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise RuntimeError("K/V heads must divide the query heads")
    unsupported = _unsupported(a)
    if unsupported:
        raise NotImplementedError(f"CPU transformer_engine_torch: {', '.join(unsupported)} not emulated")
    fmt, kv_packed = LAYOUTS[a["qkv_layout"].name]
    causal = _MASKS[a["attn_mask_type"].name][1]
    if "bottom_right_diagonal" in a and a["bottom_right_diagonal"] is not None:
        if a["bottom_right_diagonal"] != (causal == "bottom_right") and causal is not None:
            raise RuntimeError(f"bottom_right_diagonal {a['bottom_right_diagonal']} contradicts {a['attn_mask_type']}")
    return _Call(fmt, kv_packed, causal)


def _layout_strides(shape: Sequence[int], fmt: str, interleaved: bool) -> tuple[int, ...]:
    """The strides the compiled extension reads a [b, s, h, d] / [s, b, h, d] / [t, h, d] tensor with: its layout's,
    whatever the tensor's own (it takes a pointer and a shape); K and V of a 2HD layout interleave per token."""
    *outer, h, d = shape
    if fmt == "thd":
        return (h * d, d, 1)
    token = (2 if interleaved else 1) * h * d
    return (outer[1] * token, token, d, 1)


def _as_read(x: torch.Tensor, fmt: str, interleaved: bool = False) -> torch.Tensor:
    """``x`` as the compiled extension reads it: from its data pointer with its layout's strides. A tensor whose own
    strides differ is read as the GPU would read it (a view of the same memory), not as PyTorch's view says."""
    return te_thd_cpu.read_as(x, _layout_strides(x.shape, fmt, interleaved))


def _bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.transpose(0, 1) if fmt == "sbhd" else x  # [s, b, h, d] -> [b, s, h, d] (a view)


def _sequences(a: dict[str, object], call: _Call) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each THD sequence (host reads): from ``cu_seqlens_*_padded`` where each starts, from
    ``cu_seqlens_*`` how many of its tokens are real (TE's padding between sequences). bshd / sbhd: the whole tensor."""
    q, k = a["q"], a["k"]
    cq, ck = a["cu_seqlens_q"].tolist(), a["cu_seqlens_kv"].tolist()
    if a["cu_seqlens_q"].dtype != torch.int32 or a["cu_seqlens_kv"].dtype != torch.int32:
        raise RuntimeError("cu_seqlens must be int32")
    if call.fmt != "thd":
        b, sq, sk = q.shape[call.fmt.index("b")], q.shape[call.fmt.index("s")], k.shape[call.fmt.index("s")]
        if cq != [i * sq for i in range(b + 1)] or ck != [i * sk for i in range(b + 1)]:
            raise NotImplementedError(
                f"CPU transformer_engine_torch: {call.fmt} with sequences shorter than the tensor"
            )
        return [(slice(0, sq), slice(0, sk))]
    starts = []
    for name, cu, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_kv", ck, k.shape[0])):
        padded = a[name + "_padded"]
        offsets = cu if padded is None else padded.tolist()
        if len(offsets) != len(cu) or (padded is not None and padded.dtype != torch.int32):
            raise RuntimeError(f"{name}_padded must be int32 with as many entries as {name}")
        lengths = [e - b for b, e in zip(cu[:-1], cu[1:])]
        if any(n < 0 or o + n > e for o, n, e in zip(offsets[:-1], lengths, offsets[1:])) or offsets[-1] > total:
            raise RuntimeError(f"{name} {cu} does not fit in {name}_padded {offsets} (tensor of {total} tokens)")
        starts.append((offsets, lengths))
    (oq, nq), (ok, nk) = starts
    if len(nq) != len(nk):
        raise RuntimeError("cu_seqlens_q and cu_seqlens_kv must have batch + 1 entries alike")
    if max(nq) > a["max_seqlen_q"] or max(nk) > a["max_seqlen_kv"]:
        raise RuntimeError("a sequence is longer than max_seqlen_q / max_seqlen_kv")
    return [(slice(o, o + n), slice(p, p + m)) for o, n, p, m in zip(oq, nq, ok, nk)]


def _band(causal: str | None, sq: int, sk: int) -> Band | None:
    if causal is None:
        return None
    if causal == "bottom_right" and sk < sq:
        raise NotImplementedError("CPU transformer_engine_torch: bottom-right causal rows that see no key")
    return Band(None, 0 if causal == "top_left" else sk - sq)


def _inputs(a: dict[str, object], call: _Call, names: Sequence[str]) -> list[torch.Tensor]:
    """The named tensors as the extension reads them (K and V interleaved in a 2HD layout)."""
    return [_as_read(a[n], call.fmt, call.kv_packed and n in ("k", "v")) for n in names]


def _fwd(abi: ExtensionABI, thd_stats: str, *args):
    a = _bind(abi.fwd, "fused_attn_fwd", args)
    call = _call(a)
    q, k, v = _inputs(a, call, "qkv")
    scale = float(a["attn_scale"])
    runs = _sequences(a, call)
    with_max = bool(a.get("return_max_logit", False))
    out = q.new_empty((*q.shape[:-1], v.shape[-1])) if call.fmt != "thd" else q.new_zeros((*q.shape[:-1], v.shape[-1]))
    if call.fmt != "thd":  # one call for the whole batch: [b, s, h, d] views of bshd or sbhd
        qb, kb, vb, ob = (_bshd(x, call.fmt) for x in (q, k, v, out))
        band = _band(call.causal, qb.shape[1], kb.shape[1])
        o, lse = _math(q, v).forward(qb, kb, vb, band, scale)
        ob.copy_(o)
        stats = lse.float().unsqueeze(-1)  # [b, h, s, 1]
        maxes = _row_max(qb, kb, band, scale).unsqueeze(-1) if with_max else None
        return _outputs(abi, out, stats, maxes)
    h, max_q = q.shape[1], int(a["max_seqlen_q"])
    stats = torch.zeros(q.shape[0], h, 1) if thd_stats == "packed" else torch.zeros(len(runs), h, max_q, 1)
    maxes = torch.full_like(stats, UNWRITTEN) if with_max else None
    for n, (rq, rk) in enumerate(runs):
        if rq.stop == rq.start:
            continue
        rows = (rq, slice(None)) if thd_stats == "packed" else (n, slice(None), slice(0, rq.stop - rq.start))
        if rk.stop == rk.start:  # no key of the sequence in this call: out stays 0, stats -inf (merges ignore it)
            stats[rows] = float("-inf")
            if with_max:
                maxes[rows] = float("-inf")
            continue
        qs, ks, vs = q[rq][None], k[rk][None], v[rk][None]
        band = _band(call.causal, qs.shape[1], ks.shape[1])
        o, lse = _math(q, v).forward(qs, ks, vs, band, scale)
        out[rq] = o[0]
        row_max = _row_max(qs, ks, band, scale)[0] if with_max else None  # [h, s_q]
        if thd_stats == "packed":
            stats[rq, :, 0] = lse[0].float().t()
            if with_max:
                maxes[rq, :, 0] = row_max.t()
        else:
            stats[(*rows, 0)] = lse[0].float()
            if with_max:
                maxes[(*rows, 0)] = row_max
    return _outputs(abi, out, stats, maxes)


def _outputs(abi: ExtensionABI, out: torch.Tensor, stats: torch.Tensor, maxes: torch.Tensor | None) -> list:
    """The forward's outputs in the release's ABI: without the max logit ``[O, Stats, rng_state]``; with it (``maxes``)
    2.12's ``[O, Max, Sum_Exp, rng_state]`` or 2.20's ``[O, Stats, Max, rng_state]``."""
    rng_state = torch.zeros(2, dtype=torch.int64)
    if maxes is None:
        return [out, stats, rng_state]
    if abi.name == "2.12":  # Max, then Sum_Exp = sum exp(s - max): the Python layer adds log(Sum_Exp) to Max
        return [out, maxes, torch.exp(stats - maxes).nan_to_num(0.0), rng_state]  # no key: -inf - -inf -> 0
    return [out, stats, maxes, rng_state]


def _grad_buffers(q, k, v, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV as the extension allocates them: dK and dV interleaved in one dKV buffer for a 2HD layout; THD
    gradients zeroed (the rows between padded sequences)."""
    new = torch.zeros if call.fmt == "thd" else torch.empty
    dq = new(q.shape, dtype=q.dtype)
    if call.kv_packed:
        dkv = torch.empty((*k.shape[:-2], 2, *k.shape[-2:]), dtype=k.dtype)  # [.., 2, h, d]
        return dq, dkv.select(-3, 0), dkv.select(-3, 1)
    return dq, new(k.shape, dtype=k.dtype), new(v.shape, dtype=v.dtype)


def _bwd(abi: ExtensionABI, thd_stats: str, *args):
    a = _bind(abi.bwd, "fused_attn_bwd", args)
    call = _call(a)
    q, k, v, o, d_o = _inputs(a, call, ("q", "k", "v", "o", "d_o"))
    stats, _rng_state = a["aux_ctx_tensors"][:2]
    runs = _sequences(a, call)
    scale = float(a["attn_scale"])
    if call.fmt != "thd":
        b, s = q.shape[call.fmt.index("b")], q.shape[call.fmt.index("s")]
        expected = (b, q.shape[2], s, 1)
    else:
        expected = (
            (q.shape[0], q.shape[1], 1) if thd_stats == "packed" else (len(runs), q.shape[1], int(a["max_seqlen_q"]), 1)
        )
    if tuple(stats.shape) != expected or stats.dtype != torch.float32:
        raise RuntimeError(f"softmax stats {tuple(stats.shape)} {stats.dtype}, expected {expected} fp32")
    dq, dk, dv = _grad_buffers(q, k, v, call)
    if call.fmt != "thd":
        xs = [_bshd(x, call.fmt) for x in (d_o, q, k, v, o)]
        g = _math(q, v).backward(*xs, stats[..., 0], _band(call.causal, xs[1].shape[1], xs[2].shape[1]), scale)
        for buffer, grad in zip((dq, dk, dv), g):
            _bshd(buffer, call.fmt).copy_(grad)
        return [dq, dk, dv] + [None] * abi.extra_grads
    for n, (rq, rk) in enumerate(runs):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        xs = [x[r][None] for x, r in ((d_o, rq), (q, rq), (k, rk), (v, rk), (o, rq))]
        rows = stats[rq, :, 0].t() if thd_stats == "packed" else stats[n, :, : rq.stop - rq.start, 0]
        g = _math(q, v).backward(
            *xs, rows[None].contiguous(), _band(call.causal, xs[1].shape[1], xs[2].shape[1]), scale
        )
        for buffer, r, grad in ((dq, rq, g[0]), (dk, rk, g[1]), (dv, rk, g[2])):
            buffer[r] = grad[0]
    return [dq, dk, dv] + [None] * abi.extra_grads


# ---- what TE's Python layer asks of the device: cuDNN's version and which fused backend takes a call ----------

CUDNN_VERSIONS = {"packed": (9, 10, 2), "padded": (9, 5, 1)}
"""The cuDNN the stand-in stands for, by its THD softmax-stats layout: cuDNN 9.6 moved THD stats from [b, h, s_max,
1] to [t, h, 1] (TE reads the version to know which layout comes back)."""

_BACKEND_2_5 = (
    "is_training", "qkv_dtype", "kv_dtype", "qkv_layout", "bias_type", "attn_mask_type", "dropout", "num_attn_heads",
    "num_gqa_groups", "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v", "window_size_left",
    "window_size_right",
)  # fmt: skip
_BACKEND_2_8 = _with(_BACKEND_2_5, "attn_mask_type", "softmax_type")
_BACKEND_2_12 = _BACKEND_2_8 + ("return_max_logit", "cuda_graph", "deterministic")
BACKEND_QUERIES = {"2.5": _BACKEND_2_5, "2.8": _BACKEND_2_8, "2.12": _BACKEND_2_12, "2.20": ("params",)}
"""The positional parameters of ``tex.get_fused_attn_backend`` by ABI (2.20 takes one FusedAttentionParams)."""


def _backend_query(abi: ExtensionABI, args: tuple) -> dict[str, object]:
    a = _bind(BACKEND_QUERIES[abi.name], "get_fused_attn_backend", args)
    if abi.name == "2.20":
        a = dict(vars(a["params"]))
    return a


def _fused_attn_backend(module: types.ModuleType, abi: ExtensionABI, *args):
    """F16_arbitrary_seqlen for a call the CPU functions compute, else No_Backend (2.20: with the reason)."""
    a = _backend_query(abi, args)
    backend = module.NVTE_Fused_Attn_Backend
    query = {
        "qkv_layout": a["qkv_layout"],
        "attn_mask_type": a["attn_mask_type"],
        "attn_bias_type": a["bias_type"],
        "dropout": a["dropout"],
        "window_size": (a["window_size_left"], a["window_size_right"]),
        "return_max_logit": a.get("return_max_logit", False),
        **({"softmax_type": a["softmax_type"]} if "softmax_type" in a else {}),
    }
    problems = _unsupported(query)
    if a["qkv_dtype"].name not in ("kFloat16", "kBFloat16"):
        problems.append(f"{a['qkv_dtype'].name} (fp16 / bf16 only)")
    for name in ("head_dim_qk", "head_dim_v"):
        if a[name] % 8 or a[name] > 256:
            problems.append(f"{name} {a[name]}")
    found = backend.NVTE_No_Backend if problems else backend.NVTE_F16_arbitrary_seqlen
    if abi.name == "2.20":
        return found, ("CPU stand-in: " + ", ".join(problems)) if problems else ""
    return found


def cpu_extension(
    abi: ExtensionABI,
    enums: dict[str, list[str]],
    others: Sequence[str] = (),
    thd_stats: str = "packed",
    kernels: dict[str, Callable] | None = None,
) -> types.ModuleType:
    """A ``transformer_engine_torch`` module of one ABI: ``enums`` as pybind-like enums, ``others`` as names that
    are not emulated (:func:`_not_emulated`), ``fused_attn_fwd`` / ``fused_attn_bwd`` on CPU, and ``kernels``
    ({name: CPU function}, e.g. the norms of :mod:`.sp_norms`); ``module.calls`` counts the calls. ``thd_stats``:
    "packed" or "padded" (see the module). To its callers it is compiled code: Python's torch function and dispatch
    modes do not see inside."""
    if thd_stats not in ("packed", "padded"):
        raise ValueError(f"thd_stats must be 'packed' or 'padded', got {thd_stats!r}")
    module = types.ModuleType("transformer_engine_torch")
    module.__doc__ = f"CPU stand-in of Transformer Engine's compiled extension, ABI {abi.name} (megatron_2d_dev)"
    module.abi, module.thd_stats, module.calls = abi, thd_stats, collections.Counter()
    for name, members in enums.items():
        setattr(module, name, _enum(name, members))
    for name in others:
        setattr(module, name, _not_emulated(name))
    version = CUDNN_VERSIONS[thd_stats]
    functions = {
        "fused_attn_fwd": functools.partial(_fwd, abi, thd_stats),
        "fused_attn_bwd": functools.partial(_bwd, abi, thd_stats),
        "get_fused_attn_backend": functools.partial(_fused_attn_backend, module, abi),
        "get_cudnn_version": lambda: version[0] * 10000 + version[1] * 100 + version[2],  # cuDNN 9's encoding
        **te_thd_cpu.functions(abi.name),
        **(kernels or {}),
    }
    for name, impl in functions.items():

        def call(*args, _impl=impl, _name=name):
            module.calls[_name] += 1
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                return _impl(*args)

        call.__name__ = call.__qualname__ = name
        setattr(module, name, call)
    return module


# ---- the installed releases -----------------------------------------------------------------------------------


def releases_dir() -> pathlib.Path:
    """Where the releases are installed: $MEGATRON_2D_TE_RELEASES, else <venv>/te-releases."""
    return pathlib.Path(os.environ.get(RELEASES_ENV) or pathlib.Path(sys.prefix) / "te-releases")


def release_path(version: str) -> pathlib.Path:
    return releases_dir() / version


def is_installed(version: str) -> bool:
    deps = releases_dir() / DEPENDENCIES_DIR / "onnxscript"
    return (release_path(version) / "transformer_engine" / "pytorch" / "__init__.py").is_file() and deps.is_dir()


def prepare_forked_loads(versions: Sequence[str] = RELEASES) -> None:
    """In a process that then forks ranks which each call :func:`load_release`: what every such load would do the
    same way, done once here. Each installed release's extension names are read (:func:`referenced_names`, about
    1 s of CPU for 2.20.2), and the releases' shared dependencies that TE's PyTorch layer imports (``onnxscript``
    and with it onnx, onnx_ir, ml_dtypes, protobuf, from the releases' ``_deps`` folder: about 1 s) are imported;
    a load in the calling process leaves them imported too. Nothing of TE itself is imported."""
    for version in versions:
        if is_installed(version):
            referenced_names(release_path(version) / "transformer_engine")
    deps = str(releases_dir() / DEPENDENCIES_DIR)
    if not os.path.isdir(deps):
        return
    sys.path.insert(0, deps)
    try:
        importlib.import_module("onnxscript")
    finally:
        sys.path.remove(deps)


def unload_release() -> None:
    """Drop every Transformer Engine module (and the CPU extension) from ``sys.modules``."""
    for name in [n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
        del sys.modules[name]


def load_release(
    version: str, thd_stats: str = "packed", kernels: dict[str, Callable] | None = None
) -> types.ModuleType:
    """Import TE ``version`` (installed by :func:`install`) over the CPU extension of its ABI (with ``kernels``, see
    :func:`cpu_extension`), with ``NVTE_TORCH_COMPILE=0`` unless the caller set it; returns its
    ``transformer_engine.pytorch.cpp_extensions.fused_attn``. Replaces any TE already imported in this process, so
    call it once per process (forked ranks)."""
    if not is_installed(version):
        raise FileNotFoundError(
            f"Transformer Engine {version} is not installed under {releases_dir()}; run "
            f"'python -m megatron_2d_dev.te_package install' (tools/install.sh does)"
        )
    unload_release()
    root = release_path(version)
    enums, others = referenced_names(root / "transformer_engine")
    sys.modules["transformer_engine_torch"] = cpu_extension(abi_of(version), enums, others, thd_stats, kernels)
    paths = [str(root), str(releases_dir() / DEPENDENCIES_DIR)]
    sys.path[:0] = paths
    building = os.environ.get("NVTE_PROJECT_BUILDING")
    os.environ["NVTE_PROJECT_BUILDING"] = "1"  # the release's own switch: no ctypes loads of its shared objects
    compiling = os.environ.get("NVTE_TORCH_COMPILE")
    if compiling is None:  # TE's jit functions (its CP's merges) uncompiled: torch.compile costs ~29 s a process
        os.environ["NVTE_TORCH_COMPILE"] = "0"
    try:
        # transformer_engine.common first, under a bare parent, so that its loader of the compiled framework
        # extension can be told the stand-in is loaded before the package's __init__ imports transformer_engine.pytorch
        parent = types.ModuleType("transformer_engine")
        parent.__path__ = [str(root / "transformer_engine")]
        sys.modules["transformer_engine"] = parent
        common = importlib.import_module("transformer_engine.common")
        common.load_framework_extension = lambda framework: None
        del sys.modules["transformer_engine"]
        package = importlib.import_module("transformer_engine")
        package.common = common
        importlib.import_module("transformer_engine.pytorch")
        fused_attn = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
    finally:
        for path in paths:
            sys.path.remove(path)
        if building is None:
            os.environ.pop("NVTE_PROJECT_BUILDING", None)
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = building
        if compiling is None:
            os.environ.pop("NVTE_TORCH_COMPILE", None)
    if package.__version__ != version:
        raise ImportError(f"imported transformer_engine {package.__version__} from {root}, expected {version}")
    return fused_attn


def _pip(target: pathlib.Path, requirements: Sequence[str], python: str) -> None:
    staging = target.with_name(target.name + ".partial")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-compile", "--upgrade", "--target", str(staging), *requirements],
        check=True,
    )  # fmt: skip
    staging.rename(target)


def install(versions: Sequence[str] = RELEASES, python: str = sys.executable) -> list[str]:
    """Install each missing release's Python layer (the pure-Python ``transformer-engine`` wheel, no CUDA parts)
    into its own folder and the packages it imports into one more; returns what was installed now. pip caches the
    downloads, so a second setup does not fetch them again."""
    done = []
    deps = releases_dir() / DEPENDENCIES_DIR
    if not (deps / "onnxscript").is_dir():
        _pip(deps, DEPENDENCIES, python)
        done.append(DEPENDENCIES_DIR)
    missing = [v for v in versions if not (release_path(v) / "transformer_engine").is_dir()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:
        list(pool.map(lambda v: _pip(release_path(v), [f"transformer-engine=={v}"], python), missing))
    return done + missing


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description="Install Transformer Engine releases (Python layer) for CPU tests")
    parser.add_argument("command", choices=["install", "list"])
    args = parser.parse_args(argv or None)
    if args.command == "install":
        releases_dir().mkdir(parents=True, exist_ok=True)
        done = install()
        print(
            f"Transformer Engine releases in {releases_dir()}: {', '.join(RELEASES)}"
            + (f" (installed now: {', '.join(done)})" if done else "")
        )
    else:
        for version in RELEASES:
            print(version, "installed" if is_installed(version) else "missing", release_path(version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
