"""Transformer Engine's own context parallelism (stock Megatron CP) on CPU ranks, inside one scoped context.

Inside ``te_context_parallel_on_cpu(version)`` a Transformer Engine release's ``context_parallel.py`` runs as
published (neither edited nor copied): ``attn_forward_func_with_cp`` with cp_comm_type p2p, a2a, a2a+p2p and
all_gather, sbhd / bshd / thd, forward and backward over gloo, and its ``DotProductAttention`` (so megatron-core's
``TEDotProductAttention``) on top. The compiled parts are :mod:`.te_package`'s CPU stand-in (fused attention,
cuDNN's version, the backend query) and :mod:`.te_thd_cpu` (the ``tex.thd_*`` helpers). What the context changes,
each the smallest change found to be needed, all restored on exit (tests/test_te_context_parallel.py checks):

  C1. Streams: ``torch.cuda.Stream`` / ``Event`` / ``stream`` / ``current_stream`` / ``default_stream`` are the
      in-order CPU no-ops of :mod:`.megatron_cpu` and ``current_device()`` is the cpu device. TE's two-stream
      overlap runs serially, as everything does on CPU. NVTX ranges (2.5's ``prepare_forward`` opens one; CPU
      builds of torch have no NVTX) are no-ops, and ``torch.cuda.device(cpu device)`` selects nothing (2.8's
      ``DotProductAttention.forward`` enters it with the query's device).
  C2. The modelled GPU: TE's ``get_device_compute_capability`` answers :attr:`ModelledGPU.compute_capability`,
      rebound where TE's modules hold it (it decides real branches: below (10, 0) at CP = 2, p2p batches its send
      and receive, ``batch_isend_irecv``). ``torch.cuda.get_device_properties`` stays untouched (inductor reads it).
  C3. CUDA claimed to TE's named functions only (:data:`CUDA_CLAIMS`): TE asserts ``torch.cuda.is_available()``
      in its base module's ``__init__`` and ``.is_cuda`` of q/k/v in ``prepare_forward``,
      ``DotProductAttention.forward``, ``FusedAttention.forward`` (2.20: of cu_seqlens in
      ``get_thd_partitioned_indices``). Those functions' own frames (found by code object) get True; every other
      caller, TE's other code included, the true answer. ``is_available`` is wrapped; ``Tensor.is_cuda`` is
      answered by a TorchFunctionMode active in the context (or, with ``claim_cuda=False``, only inside
      ``TEOnCPU.claiming()``: a mode makes every torch call of its block pass through Python).
  C4. Point-to-point requests whose ``wait()`` may be repeated: gloo's send/recv ``Work.wait()`` is not idempotent
      (a second wait blocks for good) and TE's p2p backward waits twice on the same requests. ``isend`` and
      ``irecv`` (so ``batch_isend_irecv`` of P2POps made of them) return requests whose second ``wait()`` returns
      at once, as NCCL's do.
  C5. The release is loaded (:func:`.te_package.load_release`, with ``NVTE_TORCH_COMPILE=0``: no torch.compile of
      TE's jit functions, ~29 s a process) unless that release is already loaded; one the context loaded is unloaded
      on exit. Another release loaded in the process is refused (one TE per process).
  C6. With ``megatron=True``: ``megatron.core.extensions.transformer_engine`` is executed again with TE loaded
      (megatron-core decides ``HAVE_TE`` at import) and megatron-core's cached TE version is cleared; its previous
      namespace (or absence) comes back on exit.

Refuses where CUDA is available: there, run the real Transformer Engine. Use it where the ranks are (a forked
rank, a rank in its own network namespace, a torchrun worker), after the process group exists:

    with te_context_parallel_on_cpu("2.20.2") as te:
        out = te.attn_forward_func_with_cp(True, q, k, v, ..., cp_group, cp_ranks, torch.cuda.Stream(), "p2p", ...)

Within the context TE runs as on a GPU machine with the stand-in's cuDNN (:data:`.te_package.CUDNN_VERSIONS`);
the CP code's arithmetic (merges in the input dtype, dK/dV moved in it) is TE's own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from . import megatron_cpu, te_package

PACKAGE = "transformer_engine.pytorch."

CUDA_CLAIMS = (
    ("module.base", "TransformerEngineBaseModule.__init__"),  # torch.cuda.is_available()
    ("module.base", "TransformerEngineBaseModule.prepare_forward"),  # inp.is_cuda
    ("attention.dot_product_attention.dot_product_attention", "DotProductAttention.forward"),  # q, k, v .is_cuda
    ("attention.dot_product_attention.backends", "FusedAttention.forward"),  # q, k, v .is_cuda
    ("attention.dot_product_attention.context_parallel", "get_thd_partitioned_indices"),  # 2.20: cu_seqlens
)
"""(module under transformer_engine.pytorch, function): the only code that sees a CUDA device. A function a release
lacks is skipped (2.5 to 2.12 have no get_thd_partitioned_indices); tests check the list against each release's
asserts."""

EXTENSION = "megatron.core.extensions.transformer_engine"

_ACTIVE: list[TEOnCPU] = []
"""The contexts entered in this process (or in its parent before a fork), innermost last."""


@dataclass(frozen=True)
class ModelledGPU:
    """The GPU TE is told it runs on: what its Python layer reads of the device."""

    name: str
    compute_capability: tuple[int, int]


H100 = ModelledGPU("H100", (9, 0))
B200 = ModelledGPU("B200", (10, 0))


@dataclass
class TEOnCPU:
    """What the context yields: the release and the entry points stock Megatron CP uses."""

    version: str
    gpu: ModelledGPU
    context_parallel: types.ModuleType
    """The release's ``transformer_engine.pytorch.attention.dot_product_attention.context_parallel``."""
    extension: types.ModuleType
    """The CPU ``transformer_engine_torch`` (``extension.calls`` counts its calls)."""
    megatron_extension: types.ModuleType | None = None
    """megatron-core's ``extensions.transformer_engine`` with TE loaded (``megatron=True``)."""
    claimed: frozenset = field(default_factory=frozenset)
    """The code objects that see a CUDA device (C3)."""
    claims_throughout: bool = True
    """Whether ``tensor.is_cuda`` is claimed (C3's TorchFunctionMode active) for the whole block, or only inside
    :meth:`claiming`."""

    def claiming(self) -> contextlib.AbstractContextManager:
        """A block in which TE's named functions read ``tensor.is_cuda`` as True (nothing to do when the context
        claims throughout): for callers that keep the mode off their own code (benchmarks time other rows in the
        same ranks)."""
        return contextlib.nullcontext() if self.claims_throughout else _CudaClaim(self.claimed)

    @property
    def attn_forward_func_with_cp(self):
        return self.context_parallel.attn_forward_func_with_cp

    @property
    def transformer_engine(self) -> types.ModuleType:
        return sys.modules["transformer_engine"]


def _no_op(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def _no_range(*args, **kwargs) -> Iterator[None]:
    yield


def _device_context(original):
    """``torch.cuda.device(d)``: nothing to select for a CPU device (2.8's DotProductAttention.forward enters
    ``torch.cuda.device(query.device)``); any other device goes to torch's own."""

    def device(d):
        if isinstance(d, torch.device) and d.type == "cpu" or d == "cpu":
            return contextlib.nullcontext()
        return original(d)

    return device


# ---- C3: a CUDA device for named functions only -------------------------------------------------------------------

_IS_CUDA = torch._C.TensorBase.is_cuda


def _reader(frame: types.FrameType | None) -> types.CodeType | None:
    """The code that read a tensor property: the first frame above ``frame`` that is not a torch function mode's
    handler (modes entered after this context, e.g. megatron_ddp_on_cpu's, pass the read on from theirs)."""
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return None if frame is None else frame.f_code


class _CudaClaim(TorchFunctionMode):
    """``tensor.is_cuda`` is True when read by one of ``codes``' frames; every other torch call passes through."""

    def __init__(self, codes: frozenset) -> None:
        super().__init__()
        self.codes = codes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_CUDA and _reader(sys._getframe(1)) in self.codes:
            return True
        return func(*args, **(kwargs or {}))


def claimed_code(claims=CUDA_CLAIMS) -> frozenset:
    """The code objects of ``claims`` in the loaded release (decorators unwrapped: what runs)."""
    codes = set()
    for module_name, qualname in claims:
        obj = sys.modules[PACKAGE + module_name]
        for part in qualname.split("."):
            obj = vars(obj).get(part) if isinstance(obj, (type, types.ModuleType)) else None
            if obj is None:
                break
        if obj is not None:
            codes.add(inspect.unwrap(obj).__code__)
    return frozenset(codes)


# ---- C4: repeatable waits -----------------------------------------------------------------------------------------


class RepeatableWait:
    """A point-to-point request whose ``wait()`` may be called again (the second returns at once)."""

    def __init__(self, work) -> None:
        self.work = work
        self.done = False

    def wait(self, *args, **kwargs) -> bool:
        if not self.done:
            self.work.wait(*args, **kwargs)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _repeatable(fn):
    def call(*args, **kwargs):
        work = fn(*args, **kwargs)
        if isinstance(work, list):
            return [RepeatableWait(w) for w in work]
        return None if work is None else RepeatableWait(work)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__wrapped__ = fn
    return call


# ---- the context ----------------------------------------------------------------------------------------------------


class _Restorer:
    """Attribute changes, undone in reverse order."""

    _MISSING = object()

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []

    def set(self, owner: types.ModuleType, name: str, value) -> None:
        self.saved.append((owner, name, vars(owner).get(name, self._MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self.saved):
            if value is self._MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self.saved.clear()


def active() -> TEOnCPU | None:
    """The innermost context entered in this process (or in its parent before the fork), if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def loaded_release() -> str | None:
    """The Transformer Engine release loaded in this process, if any."""
    package = sys.modules.get("transformer_engine")
    return getattr(package, "__version__", None) if package is not None else None


@contextlib.contextmanager
def _release(version: str, thd_stats: str) -> Iterator[bool]:
    """C5: the release loaded for the block (yields whether it was loaded here)."""
    loaded = loaded_release()
    if loaded is not None:
        if loaded != version:
            raise ValueError(
                f"Transformer Engine {loaded} is loaded in this process; asked for {version}: one release per process "
                f"(run each in its own forked ranks)"
            )
        stats = sys.modules["transformer_engine_torch"].thd_stats
        if stats != thd_stats:
            raise ValueError(f"Transformer Engine {version} is loaded with thd_stats={stats!r}, asked {thd_stats!r}")
        yield False
        return
    te_package.load_release(version, thd_stats)  # NVTE_TORCH_COMPILE=0 unless set
    try:
        yield True
    finally:
        te_package.unload_release()


@contextlib.contextmanager
def _megatron_extension(restorer: _Restorer) -> Iterator[types.ModuleType]:
    """C6: megatron-core's TE extension module executed with TE loaded; its previous state back on exit."""
    import megatron.core.utils as mcore_utils

    previous = sys.modules.get(EXTENSION)
    namespace = dict(vars(previous)) if previous is not None else None
    restorer.set(mcore_utils, "_te_version", None)
    try:
        module = importlib.reload(previous) if previous is not None else importlib.import_module(EXTENSION)
        if not module.HAVE_TE:
            raise RuntimeError(f"{EXTENSION} did not find Transformer Engine {loaded_release()}")
        yield module
    finally:
        if previous is None:
            sys.modules.pop(EXTENSION, None)
            parent = sys.modules.get(EXTENSION.rsplit(".", 1)[0])
            if parent is not None and "transformer_engine" in vars(parent):
                delattr(parent, "transformer_engine")
        else:
            vars(previous).clear()
            vars(previous).update(namespace)


def _te_modules() -> list[types.ModuleType]:
    return [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "transformer_engine" and m is not None]


@contextlib.contextmanager
def te_context_parallel_on_cpu(
    version: str,
    gpu: ModelledGPU = H100,
    thd_stats: str = "packed",
    megatron: bool = False,
    claim_cuda: bool = True,
) -> Iterator[TEOnCPU]:
    """Within: Transformer Engine ``version``'s context parallelism runs on CPU ranks (C1-C6 of the module).

    Args:
        version: an installed release (:data:`.te_package.RELEASES`).
        gpu: the modelled GPU (its compute capability picks TE's branches).
        thd_stats: the stand-in's THD softmax-stats layout, "packed" (cuDNN >= 9.6) or "padded".
        megatron: also make megatron-core's TE extension (``TEDotProductAttention``) use this release.
        claim_cuda: C3's ``tensor.is_cuda`` claim throughout the block; False: only inside the yielded
            :meth:`TEOnCPU.claiming` (``attn_forward_func_with_cp`` needs none; TE's modules do in forward).

    Inside such a context (of this process, or of its parent before a fork) another one of the same release and
    GPU adds nothing but the claim it asks for."""
    megatron_cpu.refuse_with_cuda("megatron_2d_dev.te_context_parallel", "run Transformer Engine itself")
    outer = _ACTIVE[-1] if _ACTIVE else None
    reusable = outer is not None and (outer.version, outer.gpu) == (version, gpu)
    if reusable and (outer.megatron_extension is not None or not megatron):
        with outer.claiming() if claim_cuda else contextlib.nullcontext():
            yield outer
        return
    restorer = _Restorer()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_release(version, thd_stats))
        stack.callback(restorer.restore)
        # C1
        for name, value in (
            ("Stream", megatron_cpu.CpuStream),
            ("Event", megatron_cpu.CpuEvent),
            ("stream", megatron_cpu.CpuStreamContext),
            ("current_stream", megatron_cpu._current_stream),
            ("default_stream", megatron_cpu._current_stream),
            ("current_device", megatron_cpu._cpu_current_device),
        ):
            restorer.set(torch.cuda, name, value)
        for name, value in (("range_push", _no_op), ("range_pop", _no_op), ("range", _no_range)):
            restorer.set(torch.cuda.nvtx, name, value)
        restorer.set(torch.cuda, "device", _device_context(torch.cuda.device))
        # C2
        utils = sys.modules[PACKAGE + "utils"]
        original = utils.get_device_compute_capability
        capability = gpu.compute_capability

        def get_device_compute_capability() -> tuple[int, int]:
            return capability

        for module in _te_modules():
            for name, value in list(vars(module).items()):
                if value is original:
                    restorer.set(module, name, get_device_compute_capability)
        # C3
        codes = claimed_code()
        is_available = torch.cuda.is_available

        def claimed_is_available() -> bool:
            return sys._getframe(1).f_code in codes or is_available()

        restorer.set(torch.cuda, "is_available", claimed_is_available)
        if claim_cuda:
            stack.enter_context(_CudaClaim(codes))
        # C4: in torch.distributed and in distributed_c10d, whose P2POp accepts only its own isend / irecv
        c10d = dist.distributed_c10d
        for name in ("isend", "irecv"):
            repeatable = _repeatable(getattr(c10d, name))
            restorer.set(c10d, name, repeatable)
            restorer.set(dist, name, repeatable)
        # C6
        extension = stack.enter_context(_megatron_extension(restorer)) if megatron else None
        active = TEOnCPU(
            version=version,
            gpu=gpu,
            context_parallel=sys.modules[PACKAGE + "attention.dot_product_attention.context_parallel"],
            extension=sys.modules["transformer_engine_torch"],
            megatron_extension=extension,
            claimed=codes,
            claims_throughout=claim_cuda,
        )
        _ACTIVE.append(active)
        stack.callback(_ACTIVE.pop)
        yield active
