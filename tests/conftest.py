"""Shared test settings: one thread per process (ranks are forked from the test process), and the megatron CPU
shims, asked for here explicitly (importing the package patches nothing; on a machine with CUDA they refuse, so
they are not asked for there)."""

import torch

from megatron_2d.testing.megatron_cpu import install_megatron_cpu_shims

torch.set_num_threads(1)

if not torch.cuda.is_available():
    install_megatron_cpu_shims(import_training=True)   # megatron.training needs typing.override on Python 3.11
