"""Guards that fail on host-device synchronisation, for hot-path tests (a CPU run shows what a GPU run would sync).

with NoHostDataInOp(), NoSyncOps():
    step()
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class NoHostDataInOp(TorchFunctionMode):
    """Fails on reading device values into Python (.item(), .tolist()) or making tensors from Python lists."""

    FORBIDDEN = {torch.Tensor.item, torch.Tensor.tolist, torch.tensor, torch.as_tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"attention_2d called {getattr(func, '__name__', func)} on its hot path")
        return func(*args, **(kwargs or {}))


class NoSyncOps(TorchDispatchMode):
    """Fails on the aten ops behind a device-to-host read (a scalar read, ``torch.equal``'s verdict) or a tensor
    made from Python data."""

    FORBIDDEN = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.lift_fresh.default,
        torch.ops.aten.lift_fresh_copy.default,
        torch.ops.aten.equal.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"attention_2d dispatched {func} on its hot path")
        return func(*args, **(kwargs or {}))
