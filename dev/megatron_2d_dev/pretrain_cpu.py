"""Megatron's own training loop (``megatron.training.pretrain``) on CPU ranks over gloo: test and demo support.

Nothing on the library's runtime path imports this module. ``install_pretrain_cpu_shims()`` must be called
explicitly and refuses when CUDA is available (on GPUs, run the scripts unchanged). It adds, on top of
:mod:`megatron_2d_dev.megatron_cpu` (typing.override, current_device, synchronize, CPU RNG tracker, RoPE and
mask slicing, streams/events for megatron DDP), what ``pretrain()`` itself asks of CUDA:

  P1. ``initialize_megatron`` asserts ``torch.cuda.is_available()``: pretrain's call gets ``allow_no_cuda=True``.
  P2. ``torch.cuda.device_count() -> 1`` and ``set_device`` no-op: megatron seeds the model-parallel RNG tracker
      (``model_parallel_cuda_manual_seed``) only when it sees a device; on CPU that tracker is the CPU one.
  P3. Memory statistics (``memory_allocated``, ``max_memory_*``, ``memory_stats``, ``empty_cache``...) answer 0.
  P4. Everything ``pretrain()`` runs is inside ``megatron_ddp_on_cpu()``: ``device="cuda"``, ``.cuda()`` and
      ``pin_memory`` map to the CPU (training.py allocates its loss dicts and flags with ``device='cuda'``).
  P5. ``compile_helpers`` (``make`` in megatron/core/datasets, run by initialize_megatron) is skipped when the
      wheel's prebuilt ``helpers_cpp`` imports: the wheel ships the extension but not the Makefile.
  P6. ``torch.cuda.get_rng_state`` / ``set_rng_state``: there is no CUDA generator; its state is an empty byte
      tensor (the rerun state machine and checkpoints save and restore it next to the CPU state, which is real).
  P7. ``get_device_arch_version()`` (argument validation reads the GPU's compute capability) answers 9, Hopper:
      validation then applies the checks H100 users meet (e.g. CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP, which
      ``run_script`` sets as Megatron's launch examples do).
  P8. ``_warmup_jit_function`` (pretrain's JIT warm-up) is skipped. It compiles the fused bias-GeLU and
      bias-dropout-add kernels, which the CPU flags switch off, at ~11 s of inductor compile per CPU process; and
      its ``torch.rand(..., device="cuda")`` inputs, shaped by TP and CP, would draw from the CPU generator that
      ``--use-cpu-initialization`` then draws the weights from (on a GPU they draw from the CUDA generator), so the
      weights would depend on the CP size.
  P9. HybridModel's CPU shims (:mod:`megatron_2d_dev.hybrid_cpu`: its final norm, the Mamba / GDN kernel
      stand-ins, Transformer Engine's THD split), for pretrain_hybrid.py.

Two ways in:

    # forked ranks (pytest): the process group already exists, run a script's __main__ on this rank
    run_script(script_path, argv)

    # torchrun: python -m megatron_2d_dev.pretrain_cpu SCRIPT [pretrain flags...]
    torchrun --nproc-per-node 4 -m megatron_2d_dev.pretrain_cpu pretrain_gpt.py --context-parallel-size 4 ...

    # stock Megatron CP (Transformer Engine's context_parallel.py, megatron_2d_dev.stock_cp_spec):
    torchrun ... -m megatron_2d_dev.pretrain_cpu --te-release 2.20.2 pretrain_gpt.py --bf16 \
        --spec megatron_2d_dev.stock_cp_spec gpt_layer_spec_stock_cp --cp-comm-type p2p ...
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import runpy
import sys
from collections.abc import Iterator, Sequence

import torch

from .hybrid_cpu import install_hybrid_cpu_shims
from .megatron_cpu import CudaAvailableError, install_megatron_ddp_cpu_shims, megatron_ddp_on_cpu  # noqa: F401
from .megatron_cpu import refuse_with_cuda as _refuse_with_cuda

_INSTALLED = False

CPU_FLAGS = [
    "--distributed-backend",
    "gloo",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--transformer-impl",
    "local",
    "--num-workers",
    "0",
]
"""Flags every CPU run gets (after the user's): gloo; weights drawn on the CPU, which makes them independent of the TP
size; no fused CUDA/TE/apex kernels; the local layers; data loaded in the rank (forked ranks may not fork loaders)."""


def refuse_with_cuda() -> None:
    """CudaAvailableError when CUDA is available."""
    _refuse_with_cuda("megatron_2d_dev.pretrain_cpu", "run pretrain_gpt.py unchanged")


def _zero(*args, **kwargs) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


def _install_cuda_queries() -> None:
    """P2/P3: the device and memory questions megatron.training asks, answered for one CPU 'device'."""
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = _nothing  # type: ignore[assignment]
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, _zero)
    torch.cuda.memory_stats = lambda *args, **kwargs: {}  # type: ignore[assignment]
    torch.cuda.empty_cache = _nothing  # type: ignore[assignment]
    torch.cuda.reset_peak_memory_stats = _nothing  # type: ignore[assignment]
    # P6
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)  # type: ignore[assignment]
    torch.cuda.set_rng_state = _nothing  # type: ignore[assignment]


ARCH_VERSION = 9
"""The compute capability major version argument validation is told (Hopper)."""


def _install_arch_version() -> None:
    """P7: rebind ``get_device_arch_version`` where megatron.training imported it by name."""
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    for module in (arguments, common_utils):
        module.get_device_arch_version = lambda: ARCH_VERSION


def _install_no_jit_warmup() -> None:
    """P8: no JIT warm-up (``set_jit_fusion_options`` calls it by its module-level name)."""
    from megatron.training import initialize

    initialize._warmup_jit_function = _nothing


def _install_initialize() -> None:
    """P1: pretrain's ``initialize_megatron(...)`` with ``allow_no_cuda=True``."""
    from megatron.training import training

    original = training.initialize_megatron
    if getattr(original, "_m2d_cpu", False):
        return
    allowing = functools.partial(original, allow_no_cuda=True)
    allowing._m2d_cpu = True  # type: ignore[attr-defined]
    training.initialize_megatron = allowing


def _install_dataset_helpers() -> None:
    """P5: keep the prebuilt dataset helpers instead of rebuilding them with a Makefile the wheel lacks."""
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # no prebuilt extension: let megatron compile it (a source checkout has the Makefile)
    dataset_utils.compile_helpers = _nothing


def install_pretrain_cpu_shims() -> None:
    """Make ``megatron.training.pretrain()`` runnable on CPU ranks (idempotent). Refuses when CUDA is available."""
    global _INSTALLED
    refuse_with_cuda()
    if _INSTALLED:
        return
    install_megatron_ddp_cpu_shims()
    import megatron.training  # noqa: F401  (after typing.override)
    import megatron.training.training  # noqa: F401

    _install_cuda_queries()
    _install_initialize()
    _install_dataset_helpers()
    _install_arch_version()
    _install_no_jit_warmup()
    install_hybrid_cpu_shims()
    _INSTALLED = True


@contextlib.contextmanager
def cpu_pretrain() -> Iterator[None]:
    """P4: the enclosed megatron.training code runs with CUDA placements mapped to the CPU."""
    install_pretrain_cpu_shims()
    with megatron_ddp_on_cpu():
        yield


def run_script(script: str, argv: Sequence[str], te_release: str | None = None) -> None:
    """Run ``script``'s ``__main__`` (e.g. Megatron-LM's pretrain_gpt.py) with ``argv`` and the CPU flags, as
    ``python script argv...`` would, on this already-initialized rank. The script's folder is put first on
    sys.path (pretrain_gpt.py imports its sibling gpt_builders / model_provider). ``te_release``: inside
    Transformer Engine's CPU context of that release, megatron-core included (stock CP,
    :mod:`.stock_cp_spec`)."""
    script = os.path.abspath(script)
    folder = os.path.dirname(script)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    saved_argv = sys.argv
    sys.argv = [script, *argv, *CPU_FLAGS]
    try:
        with contextlib.ExitStack() as stack:
            if te_release is not None:
                from .te_context_parallel import te_context_parallel_on_cpu

                stack.enter_context(te_context_parallel_on_cpu(te_release, megatron=True))
            stack.enter_context(cpu_pretrain())
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv


def init_gloo_from_env(timeout_s: float = 120.0) -> None:
    """torchrun's environment -> a gloo default group with a short timeout (megatron then keeps it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_2d_dev.pretrain_cpu [--te-release VERSION] SCRIPT [flags...]`` under torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    te_release = None
    if argv[:1] == ["--te-release"] and len(argv) > 1:
        te_release, argv = argv[1], argv[2:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit(
            "usage: torchrun --nproc-per-node N -m megatron_2d_dev.pretrain_cpu [--te-release VERSION] SCRIPT "
            "[flags...]"
        )
    torch.set_num_threads(1)
    install_pretrain_cpu_shims()
    init_gloo_from_env()
    run_script(argv[0], argv[1:], te_release)


if __name__ == "__main__":
    main()
