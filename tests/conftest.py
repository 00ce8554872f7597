"""Shared test settings: one thread per process (ranks are forked from the test process)."""

import torch

torch.set_num_threads(1)
