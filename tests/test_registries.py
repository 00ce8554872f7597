"""The three registries (kernels, transports, packing modes) are one style (:mod:`megatron_2d.layout.registry`):
every member of the enum has exactly one class, the class names its member, and (kernels and transports) the
planner has a cost for it."""

from __future__ import annotations

import pytest
import torch

from megatron_2d.kernels import KERNELS, BlockKernel
from megatron_2d.layout.choices import Kernel, PackingMode, TransportKind
from megatron_2d.layout.registry import Registry
from megatron_2d.packing.modes import MODES
from megatron_2d.packing.modes import PackingMode as ModeClass
from megatron_2d.transport.kinds import TRANSPORTS


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


@pytest.mark.parametrize(
    "registry, enum, base",
    [(KERNELS, Kernel, BlockKernel), (TRANSPORTS, TransportKind, None), (MODES, PackingMode, ModeClass)],
    ids=["kernels", "transports", "packing modes"],
)
def test_every_member_has_exactly_one_class(registry: Registry, enum, base):
    assert list(registry) == list(enum) and registry.missing() == []
    for member, cls in registry.items():
        assert getattr(cls, registry.key) is member  # the class names its member, as the member
    if base is not None:  # no other class of the library claims a member
        library = {c for c in _subclasses(base) if c.__module__.startswith("megatron_2d.")}
        claims = [c for c in library if getattr(c, registry.key, None) in tuple(enum)]
        assert sorted(claims, key=lambda c: c.__qualname__) == sorted(registry.values(), key=lambda c: c.__qualname__)


def test_a_second_class_or_an_unknown_name_is_refused_whatever_the_order():
    def kernel(name):
        return type(f"K_{name}", (), {"name": name})

    table = Registry("attention kernel", Kernel, key="name")
    table.register(kernel("torch_math"))
    with pytest.raises(ValueError, match="'torch_math' is registered already"):
        table.register(kernel("torch_math"))
    with pytest.raises(ValueError, match=r"'pigeon' is not one of \['te_fused'"):
        table.register(kernel("pigeon"))
    with pytest.raises(TypeError, match="with a name"):
        table.register(type("Nameless", (), {}))
    with pytest.raises(RuntimeError, match=r"attention kernels without a class: \['te_fused'"):
        table.complete()


def test_every_kernel_that_runs_on_cuda_has_a_planner_rate():
    """plan/kernel_rates.py prices each CUDA kernel on every architecture it knows; a kernel without a rate is one
    that does not run on CUDA (cpu_flash, torch_math: the planner models GPU clusters only)."""
    from megatron_2d.plan.kernel_rates import ARCHITECTURES, KERNEL_RATES

    cuda, unpriced = torch.device("cuda"), []
    for member, cls in KERNELS.items():
        runs_on_cuda = any(cls.supports(object.__new__(cls), cuda, d) for d in (torch.float16, torch.bfloat16))
        priced = [arch for arch in ARCHITECTURES if (arch, member) in KERNEL_RATES]
        assert priced == (list(ARCHITECTURES) if runs_on_cuda else []), member
        if not runs_on_cuda:
            unpriced.append(member)
    assert unpriced == [Kernel.CPU_FLASH, Kernel.TORCH_MATH]


def test_every_transport_has_a_planner_cost():
    """Each kind's time is modelled by plan/step.py's ``TRANSPORT_COSTS`` (tests/test_transport_kind.py runs it for
    every kind): its keys are the registered kinds, and nothing else."""
    from megatron_2d.plan.step import TRANSPORT_COSTS

    assert list(TRANSPORT_COSTS) == list(TRANSPORTS)
    assert all(isinstance(kind, TransportKind) and callable(cost) for kind, cost in TRANSPORT_COSTS.items())


def test_importing_the_package_registers_everything():
    """A fresh process that imports the modules the tables are read from finds every registry whole (no folder
    scan, no import of a particular module first)."""
    import subprocess
    import sys

    code = (
        "from megatron_2d.kernels import KERNELS\n"
        "from megatron_2d.transport.kinds import TRANSPORTS\n"
        "from megatron_2d.packing.modes import MODES\n"
        "for r in (KERNELS, TRANSPORTS, MODES):\n"
        "    r.complete()\n"
        "print(len(KERNELS), len(TRANSPORTS), len(MODES))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(Kernel)), str(len(TransportKind)), str(len(PackingMode))]
