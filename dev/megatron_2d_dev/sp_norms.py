"""Sequence parallelism on CPU ranks: the norms megatron-core builds with ``sequence_parallel=True``, test support only.

megatron-core 0.19.2's torch norm (``WrappedTorchNorm``, its fallback without apex and Transformer Engine) asserts
``not sequence_parallel``. Jobs with SP run apex's or Transformer Engine's norms, whose Megatron classes mark their
weights ``sequence_parallel`` so that ``finalize_model_grads`` sums their gradients over TP. Two scoped routes run
those classes here, each replacing only the compiled part:

apex (LayerNorm)   :func:`apex_layer_norm`: megatron-core's own ``FusedLayerNorm`` (what its local specs pick when
                   ``import apex`` succeeds), over :class:`FusedLayerNormAffineFunction`, a stand-in of apex's
                   function of that name with its ``apply`` signature (``memory_efficient`` included, which Megatron
                   inspects) computing with ``torch.nn.functional.layer_norm``. Inside the context megatron-core's
                   modules hold what they bind at import when apex is installed (:data:`APEX_BINDINGS`).
TE (RMSNorm too)   :func:`te_norms`: megatron-core's ``TENorm`` (and ModelOpt's ``Norm``, its local-linears spec's
                   norm) building Transformer Engine's own ``LayerNorm`` / ``RMSNorm`` of a real release
                   (:mod:`.te_package`), whose op calls ``tex.layernorm_fwd`` / ``rmsnorm_fwd`` and their backwards:
                   those four get CPU kernels (:data:`NORM_KERNELS`). megatron-core's local specs give RMSNorm layers
                   the torch norm whatever is installed (``LocalSpecProvider.layer_norm``), so
                   :func:`with_te_norms` puts ``TENorm`` into a spec's norm slots, as ModelOpt's spec
                   (``get_gpt_modelopt_spec``: "the native local spec except ... TENorm") does.

Both contexts restore every binding and ``sys.modules`` entry they changed on exit (nothing stays patched; see
tests/test_sequence_parallel.py). Enter them in the parent before forking ranks: the ranks inherit them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

TE_RELEASE = "2.12.0"
"""The Transformer Engine release :func:`te_norms` loads (te_spec_cpu's TE_VERSION)."""

_MISSING = object()


# ---- apex ------------------------------------------------------------------------------------------------------------
class FusedLayerNormAffineFunction(torch.autograd.Function):
    """Stand-in of ``apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction``: ``apply(input, weight, bias,
    normalized_shape, eps, memory_efficient=False)`` -> the affine layer norm of ``input`` over its trailing
    ``normalized_shape`` dims; backward by autograd through torch's layer norm. ``memory_efficient`` (apex keeps the
    output instead of the input) changes what apex saves, not the result, and is accepted and ignored."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        ctx.normalized_shape, ctx.eps = tuple(normalized_shape), eps
        ctx.save_for_backward(input, weight, bias)
        return F.layer_norm(input, ctx.normalized_shape, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad_output):
        saved = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = F.layer_norm(saved[0], ctx.normalized_shape, saved[1], saved[2], ctx.eps)
            grads = torch.autograd.grad(out, saved, grad_output)
        return (*grads, None, None, None)


def _apex_modules() -> dict[str, types.ModuleType]:
    """``apex``, ``apex.normalization`` and ``apex.normalization.fused_layer_norm`` holding the stand-in."""
    modules = {}
    for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm"):
        module = types.ModuleType(name)
        module.__path__ = []  # packages, so that submodules import
        module.__megatron_2d_cpu_stand_in__ = True
        modules[name] = module
    modules["apex.normalization.fused_layer_norm"].FusedLayerNormAffineFunction = FusedLayerNormAffineFunction
    return modules


def apex_bindings() -> list[tuple[str, str, Any]]:
    """(module, name, value): what megatron-core 0.19.2's modules bind at import when apex is installed (and TE is
    not): the fused function and its flag, and the local norm class of the spec builders and of TransformerBlock's
    final norm."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

    return [
        ("megatron.core.fusions.fused_layer_norm", "FusedLayerNormAffineFunction", FusedLayerNormAffineFunction),
        ("megatron.core.fusions.fused_layer_norm", "HAVE_FUSED_LAYER_NORM", True),
        ("megatron.core.models.backends", "HAVE_APEX", True),
        ("megatron.core.models.backends", "FusedLayerNorm", FusedLayerNorm),
        ("megatron.core.models.backends", "LNImpl", FusedLayerNorm),
        ("megatron.core.models.gpt.gpt_layer_specs", "HAVE_APEX", True),
        ("megatron.core.models.gpt.gpt_layer_specs", "LNImpl", FusedLayerNorm),
        ("megatron.core.transformer.transformer_block", "HAVE_APEX", True),
        ("megatron.core.transformer.transformer_block", "LayerNormImpl", FusedLayerNorm),
    ]


@contextlib.contextmanager
def _bound(bindings, modules: dict[str, types.ModuleType] | None = None) -> Iterator[None]:
    """Within: each (module, name, value) of ``bindings`` set and each of ``modules`` in sys.modules; all restored
    (or removed) on exit."""
    saved_attrs, saved_modules = [], {}
    try:
        for name, module in (modules or {}).items():
            saved_modules[name] = sys.modules.get(name, _MISSING)
            sys.modules[name] = module
        for module_name, name, value in bindings:
            module = importlib.import_module(module_name)
            saved_attrs.append((module, name, vars(module).get(name, _MISSING)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved_attrs):
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)
        for name, module in saved_modules.items():
            if module is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def apex_layer_norm() -> Iterator[None]:
    """Within: megatron-core sees apex installed (LayerNorm layers of its local specs are ``FusedLayerNorm`` over
    :class:`FusedLayerNormAffineFunction`); everything restored on exit."""
    with _bound(apex_bindings(), _apex_modules()):
        yield


# ---- Transformer Engine's norms ------------------------------------------------------------------------------------
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gamma(w: torch.Tensor, zero_centered_gamma: bool, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) + 1 if zero_centered_gamma else w.to(dtype)


def _check_plain(name: str, ln_out, quantizer) -> None:
    if ln_out is not None or quantizer is not None:
        raise NotImplementedError(f"CPU transformer_engine_torch: {name} with an output buffer or quantizer")


def rmsnorm_fwd(x, w, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """TE's ``tex.rmsnorm_fwd`` on CPU: ``[y, None, rsigma]``, x [N, H], rsigma [N] fp32 (fp64 for fp64)."""
    _check_plain("rmsnorm_fwd", ln_out, quantizer)
    dtype = _compute_dtype(x)
    xf = x.to(dtype)
    rsigma = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rsigma[:, None] * _gamma(w, zero_centered_gamma, dtype)
    return [y.to(x.dtype), None, rsigma]


def rmsnorm_bwd(dz, x, rsigma, w, sm_margin, zero_centered_gamma):
    """TE's ``tex.rmsnorm_bwd`` on CPU: ``[dx, dgamma]`` (closed form)."""
    dtype = _compute_dtype(x)
    xhat = x.to(dtype) * rsigma[:, None]
    dxhat = dz.to(dtype) * _gamma(w, zero_centered_gamma, dtype)
    dx = rsigma[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return [dx.to(x.dtype), (dz.to(dtype) * xhat).sum(0).to(w.dtype)]


def layernorm_fwd(x, w, b, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """TE's ``tex.layernorm_fwd`` on CPU: ``[y, mu, rsigma]``, mu and rsigma [N] fp32 (fp64 for fp64)."""
    _check_plain("layernorm_fwd", ln_out, quantizer)
    dtype = _compute_dtype(x)
    xf = x.to(dtype)
    mu = xf.mean(-1)
    rsigma = torch.rsqrt((xf - mu[:, None]).pow(2).mean(-1) + eps)
    y = (xf - mu[:, None]) * rsigma[:, None] * _gamma(w, zero_centered_gamma, dtype) + b.to(dtype)
    return [y.to(x.dtype), mu, rsigma]


def layernorm_bwd(dz, x, mu, rsigma, w, sm_margin, zero_centered_gamma):
    """TE's ``tex.layernorm_bwd`` on CPU: ``[dx, dgamma, dbeta]`` (closed form)."""
    dtype = _compute_dtype(x)
    xhat = (x.to(dtype) - mu[:, None]) * rsigma[:, None]
    dzf = dz.to(dtype)
    dxhat = dzf * _gamma(w, zero_centered_gamma, dtype)
    dx = rsigma[:, None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return [dx.to(x.dtype), (dzf * xhat).sum(0).to(w.dtype), dzf.sum(0).to(w.dtype)]


NORM_KERNELS = {
    "rmsnorm_fwd": rmsnorm_fwd,
    "rmsnorm_bwd": rmsnorm_bwd,
    "layernorm_fwd": layernorm_fwd,
    "layernorm_bwd": layernorm_bwd,
}
"""The compiled norm functions of ``transformer_engine_torch`` that TE's LayerNorm / RMSNorm ops call (the same
positional signature in releases 2.5 to 2.20), on CPU."""


def _empty_cpu_tensor() -> torch.Tensor:
    return torch.Tensor()


def te_bindings(te) -> list[tuple[str, str, Any]]:
    """(module, name, value): what megatron-core binds at import when Transformer Engine ``te`` is installed, as far
    as its norms go: ``TENorm`` and ModelOpt's ``Norm`` build TE's classes, TransformerBlock's and HybridStack's final
    norms are ``TENorm``, and MLA accepts ModelOpt's duplicated ``Linear`` down projections. And one CUDA placement
    of TE's Python: ``clear_tensor_data`` (its ops free saved tensors in backward) swaps in ``torch.Tensor().cuda()``,
    made a CPU tensor."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.post_training.modelopt.layers import Linear

    return [
        ("transformer_engine.pytorch.utils", "_empty_tensor", _empty_cpu_tensor),
        ("megatron.core.extensions.transformer_engine", "te", te),
        ("megatron.core.extensions.transformer_engine", "HAVE_TE", True),
        ("megatron.core.post_training.modelopt.layers", "te", te),
        ("megatron.core.post_training.modelopt.layers", "HAVE_TE", True),
        ("megatron.core.post_training.modelopt.layers", "_get_extra_te_kwargs", te_ext._get_extra_te_kwargs),
        ("megatron.core.transformer.transformer_block", "LayerNormImpl", te_ext.TENorm),
        ("megatron.core.models.hybrid.hybrid_block", "TENorm", te_ext.TENorm),
        ("megatron.core.transformer.multi_latent_attention", "Linear", Linear),
    ]


@contextlib.contextmanager
def te_norms(version: str = TE_RELEASE) -> Iterator[types.ModuleType]:
    """Within: Transformer Engine ``version`` imported over the CPU extension with :data:`NORM_KERNELS`, and
    megatron-core's norm classes building its norms (:func:`te_bindings`); yields the extension module (its
    ``calls`` count the kernel calls). On exit TE leaves ``sys.modules`` (earlier entries come back) and megatron-core
    its bindings, so that nothing else sees TE installed."""
    from megatron.core import utils as mcore_utils
    from packaging.version import Version

    from megatron_2d.megatron import hybrid_spec, spec  # noqa: F401  (their ready specs are built at import: before TE shows)

    from .hybrid_cpu import install_hybrid_cpu_shims
    from .te_package import load_release

    install_hybrid_cpu_shims()  # its H1 binds HybridStack's final norm to the torch norm: first, then TENorm over it

    previous = {
        n: m for n, m in sys.modules.items() if n.split(".")[0] in ("transformer_engine", "transformer_engine_torch")
    }
    saved_version = mcore_utils._te_version
    try:
        load_release(version, kernels=NORM_KERNELS)
        te = sys.modules["transformer_engine"]
        mcore_utils._te_version = Version(version)
        with _bound(te_bindings(te)):
            yield sys.modules["transformer_engine_torch"]
    finally:
        mcore_utils._te_version = saved_version
        for name in [n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
            del sys.modules[name]
        sys.modules.update(previous)


def with_te_norms(spec):
    """A copy of ``spec`` (a layer, block or hybrid stack spec) with megatron-core's torch norm replaced by its
    ``TENorm`` in every slot (Megatron's local specs give RMSNorm layers the torch norm, which refuses sequence
    parallelism; ModelOpt's local-linears spec uses TE's norms in the same slots). Build the model inside
    :func:`te_norms`."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_2d.megatron.hybrid_spec import copy_spec

    return copy_spec(spec, {WrappedTorchNorm: TENorm})


NORM_ROUTES = ("torch", "apex", "te")
"""How a test model's norms are built: megatron-core's torch norm (no SP), apex's (LayerNorm with SP), TE's."""


@contextlib.contextmanager
def norm_route(route: str) -> Iterator[None]:
    """The context of a route of :data:`NORM_ROUTES` (nothing for "torch")."""
    if route not in NORM_ROUTES:
        raise ValueError(f"norm route must be one of {list(NORM_ROUTES)}, got {route!r}")
    context = {"torch": contextlib.nullcontext, "apex": apex_layer_norm, "te": te_norms}[route]
    with context():
        yield


def _te_norm_hybrid_specs():
    from megatron_2d.megatron.hybrid_spec import hybrid_stack_spec_2d_local

    from .hybrid_cpu import megatron_local_hybrid_stack_spec

    return with_te_norms(megatron_local_hybrid_stack_spec), with_te_norms(hybrid_stack_spec_2d_local)


megatron_local_hybrid_stack_spec_te_norms, hybrid_stack_spec_2d_te_norms = _te_norm_hybrid_specs()
"""For pretrain_hybrid.py under sequence parallelism, run inside :func:`te_norms` (``--spec
megatron_2d_dev.sp_norms NAME``): Megatron's local hybrid stack spec (the CP = 1 reference's,
``hybrid_cpu.megatron_local_hybrid_stack_spec``) and megatron_2d's local 2D one, each with ``TENorm`` in its norm
slots."""
