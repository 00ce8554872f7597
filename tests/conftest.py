"""Shared test settings: one thread per process (ranks are forked from the test process), and the megatron CPU
shims, asked for here explicitly (importing the package patches nothing; on a machine with CUDA they refuse, so
they are not asked for there).

Markers (registered in pyproject.toml; `make test-fast` deselects the first two):
  distributed  forks ranks (megatron_2d.testing.distributed.run_on_ranks) or starts torchrun / process groups;
  megatron     builds a Megatron model, runs Megatron-LM's training entry or parses its command line.
A test that forks ranks without the `distributed` marker fails at once (see _ranks_refused_unless_marked), so the
fast set cannot silently gain a multi-rank test."""

import contextlib

import pytest
import torch

from megatron_2d.testing import distributed as _distributed
from megatron_2d.testing.megatron_cpu import install_megatron_cpu_shims

torch.set_num_threads(1)

if not torch.cuda.is_available():
    install_megatron_cpu_shims(import_training=True)  # megatron.training needs typing.override on Python 3.11


class _RanksRefused:
    """Stands in for ``multiprocessing`` inside megatron_2d.testing.distributed while a test without the
    ``distributed`` marker runs: forking ranks fails the test with the fix in the message."""

    def __init__(self, nodeid):
        self.nodeid = nodeid

    def get_context(self, method=None):
        pytest.fail(
            f"{self.nodeid} forks ranks (run_on_ranks) but is not marked `distributed`: add "
            "@pytest.mark.distributed (or a module-level pytestmark) so `make test-fast` leaves it out",
            pytrace=False,
        )


@contextlib.contextmanager
def _ranks_refused_unless_marked(item):
    if item.get_closest_marker("distributed") is not None:
        yield
        return
    saved = _distributed.mp
    _distributed.mp = _RanksRefused(item.nodeid)
    try:
        yield
    finally:
        _distributed.mp = saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):  # module-scoped fixtures (e.g. `results`) fork ranks during setup
    with _ranks_refused_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _ranks_refused_unless_marked(item):
        yield
