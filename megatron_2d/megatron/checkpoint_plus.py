"""Selective Checkpoint++: full-layer recompute that does not recompute attention.

Megatron's full recompute runs a layer's forward twice: once under ``torch.no_grad`` inside its checkpoint, and
again during backward to rebuild the graph. With Checkpoint++ the first pass runs the 2D attention WITH its own
small autograd graph (detached inputs), keeps that graph (the saved head-layout q/k/v, output and log-sum-exp) and
its output in a per-layer FIFO; the recompute pass rebuilds everything else (norms, QKV projection, MLP) and takes
the attention output from the FIFO instead of re-running the all-to-alls, the ring and the kernels. The backward of
that output runs the kept graph, so dQ/dK/dV are exactly those of the first pass.

Passes are told apart by megatron-core's own flag ``tensor_parallel.random.is_checkpointing()`` (set in both the
checkpointed forward and its recompute) and the grad mode (off in the first, on in the recompute). Micro-batches
are replayed in the order they ran forward, which is what every megatron-core schedule does (1F1B, interleaved:
each virtual stage has its own layers and FIFOs). A recomputed input that differs from the first pass's raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Optional, Tuple

import torch

from megatron.core.tensor_parallel.random import is_checkpointing

AttentionFn = Callable[..., torch.Tensor]   # (q, k, v[, sinks]) -> out
_SAMPLES = 64  # elements per input compared between the first pass and the recompute


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A few evenly spaced elements of ``x`` (a recompute must reproduce them bit for bit)."""
    flat = x.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _SAMPLES)].clone()


@dataclass
class _KeptAttention:
    inputs: Tuple[torch.Tensor, ...]                          # detached leaves the kept graph starts from
    output: torch.Tensor                                      # its output (the graph hangs off it)
    fingerprints: Tuple[torch.Tensor, ...]


class _ReplayAttention(torch.autograd.Function):
    """Forward: the kept output. Backward: the kept graph's dQ/dK/dV (and d sinks, when the sinks are learnable:
    they are an input here so autograd delivers their gradient to the parameter), then the graph is released."""

    @staticmethod
    def forward(ctx, kept: _KeptAttention, q, k, v, sinks=None):
        ctx.kept = kept
        return kept.output.detach()

    @staticmethod
    def backward(ctx, dout):
        kept: _KeptAttention = ctx.kept
        ctx.kept = None
        wanted = [x for x in kept.inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(kept.output, wanted, dout))
        out = [next(grads) if x.requires_grad else None for x in kept.inputs]
        kept.output = kept.inputs = None
        return (None, *out)                               # one gradient per input of forward


class AttentionKeeper:
    """The per-layer FIFO of kept attention results (one entry per micro-batch between forward and backward)."""

    def __init__(self) -> None:
        self._fifo: Deque[_KeptAttention] = deque()

    def __len__(self) -> int:
        return len(self._fifo)

    def __call__(self, attention: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run ``attention`` (q, k, v[, sinks] -> out) under the Checkpoint++ rules."""
        extra = () if sinks is None else (sinks,)
        if not is_checkpointing():
            return attention(q, k, v, *extra)             # not inside a full-layer checkpoint: plain attention
        if not torch.is_grad_enabled():                   # first pass of a checkpointed layer: keep the graph
            inputs = tuple(x.detach().requires_grad_(True) for x in (q, k, v)) + tuple(
                s.detach().requires_grad_(s.requires_grad) for s in extra)
            with torch.enable_grad():
                out = attention(*inputs)
            self._fifo.append(_KeptAttention(inputs, out, tuple(_fingerprint(x) for x in (q, k, v))))
            return out.detach()
        if not self._fifo:
            raise RuntimeError("Selective Checkpoint++: a recompute pass found no kept attention for this layer; "
                               "the layer's first pass did not run inside megatron's checkpoint")
        kept = self._fifo.popleft()
        for name, x, fp in zip("qkv", (q, k, v), kept.fingerprints):
            if x.shape != kept.inputs["qkv".index(name)].shape or not torch.equal(_fingerprint(x), fp):
                raise RuntimeError(f"Selective Checkpoint++: the recomputed {name} differs from the first pass "
                                   f"(non-deterministic recompute, or micro-batches replayed out of order); "
                                   f"disable selective_checkpoint_plus_plus for this run")
        return _ReplayAttention.apply(kept, q, k, v, *extra)


def check_checkpoint_plus_config(config) -> Optional[str]:
    """Why Selective Checkpoint++ cannot be used with ``config`` (None if it can)."""
    if config.recompute_granularity != "full":
        return (f"selective_checkpoint_plus_plus keeps attention across megatron's full-layer recompute, but "
                f"recompute_granularity is {config.recompute_granularity!r}; set recompute_granularity='full' with "
                f"recompute_method 'uniform' or 'block' and recompute_num_layers (--recompute-granularity full "
                f"--recompute-method uniform --recompute-num-layers 1)")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return ("selective_checkpoint_plus_plus is not supported with fp8/fp4 recompute (megatron then uses "
                "Transformer Engine's checkpoint, which does not mark its passes)")
    return None
