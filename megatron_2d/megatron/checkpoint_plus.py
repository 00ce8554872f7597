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
each virtual stage has its own layers and FIFOs).

The recompute is checked against the first pass on a sample of q, k and v (``check``): "tolerance" (default)
allows the dtype's rounding noise (max |difference| / max |first| up to ``RECOMPUTE_RTOL``), as GPUs recompute
MoE permutations with atomics and differ bitwise; "bitwise" (a debug mode) allows none. A replay of another
micro-batch differs by O(1) and is refused either way. The check costs no host sync: the verdict is computed on
the device and copied to pinned host memory without blocking; it is read once the copy has landed (polled at the
keeper's next calls), and a failed check raises there, at most a few layer calls after the recompute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from ..choices import RECOMPUTE_CHECKS, check_choice, choice_problem

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v[, sinks]) -> out
_SAMPLES = 64  # elements per input compared between the first pass and the recompute
# max |recomputed - first| / max |first| over the sampled elements that "tolerance" allows: a few units of the
# dtype's rounding, as a recompute whose reductions run in another order gives
RECOMPUTE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A few evenly spaced elements of ``x``, compared between the first pass and the recompute."""
    flat = x.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _SAMPLES)].clone()


def _relative_difference(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """max |fingerprint(x) - first| / max |first|, a 0-dim fp32 tensor on the inputs' device (no host read)."""
    new = _fingerprint(x).float()
    first = first.float()
    return (new - first).abs().max() / first.abs().max().clamp_min(torch.finfo(torch.float32).tiny)


class _Verdicts:
    """Device-side results of the recompute checks, read on the host only once their copy has landed."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event | None, str, float]] = deque()

    def add(self, difference: torch.Tensor, name: str, bound: float) -> None:
        event = None
        if difference.device.type == "cuda":
            host = torch.empty((), dtype=difference.dtype, pin_memory=True)
            host.copy_(difference, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = difference
        self._pending.append((host, event, name, bound))
        self.poll()

    def poll(self) -> None:
        """Raise for the first landed verdict that failed; never waits for the device."""
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            host, _, name, bound = self._pending.popleft()
            value = float(host.numpy())  # host memory: no device read, no dispatch
            if not value <= bound:  # NaN fails too
                raise RuntimeError(
                    f"Selective Checkpoint++: the recomputed {name} differs from the first pass (max relative "
                    f"difference {value:.3g} over sampled elements, allowed {bound:g}): a non-deterministic "
                    f"recompute beyond rounding, or micro-batches replayed out of order; disable "
                    f"selective_checkpoint_plus_plus for this run"
                )


@dataclass
class _KeptAttention:
    inputs: tuple[torch.Tensor, ...]  # detached leaves the kept graph starts from
    output: torch.Tensor  # its output (the graph hangs off it)
    fingerprints: tuple[torch.Tensor, ...]


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
        return (None, *out)  # one gradient per input of forward


class AttentionKeeper:
    """The per-layer FIFO of kept attention results (one entry per micro-batch between forward and backward);
    ``check`` is how a recompute is compared with its first pass ("tolerance" or "bitwise", see the module)."""

    def __init__(self, check: str = "tolerance") -> None:
        check_choice("Selective Checkpoint++ check", check, RECOMPUTE_CHECKS)
        self.check = check
        self._fifo: deque[_KeptAttention] = deque()
        self._verdicts = _Verdicts()

    def __len__(self) -> int:
        return len(self._fifo)

    def __call__(
        self,
        attention: AttentionFn,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``attention`` (q, k, v[, sinks] -> out) under the Checkpoint++ rules."""
        extra = () if sinks is None else (sinks,)
        self._verdicts.poll()
        if not is_checkpointing():
            return attention(q, k, v, *extra)  # not inside a full-layer checkpoint: plain attention
        if not torch.is_grad_enabled():  # first pass of a checkpointed layer: keep the graph
            inputs = tuple(x.detach().requires_grad_(True) for x in (q, k, v)) + tuple(
                s.detach().requires_grad_(s.requires_grad) for s in extra
            )
            with torch.enable_grad():
                out = attention(*inputs)
            self._fifo.append(_KeptAttention(inputs, out, tuple(_fingerprint(x) for x in (q, k, v))))
            return out.detach()
        if not self._fifo:
            raise RuntimeError(
                "Selective Checkpoint++: a recompute pass found no kept attention for this layer; "
                "the layer's first pass did not run inside megatron's checkpoint"
            )
        kept = self._fifo.popleft()
        for name, x, fp in zip("qkv", (q, k, v), kept.fingerprints):
            if x.shape != kept.inputs["qkv".index(name)].shape:
                raise RuntimeError(
                    f"Selective Checkpoint++: the recomputed {name} has shape {tuple(x.shape)}, the "
                    f"first pass {tuple(kept.inputs['qkv'.index(name)].shape)} (micro-batches "
                    f"replayed out of order?); disable selective_checkpoint_plus_plus for this run"
                )
            bound = 0.0 if self.check == "bitwise" else RECOMPUTE_RTOL.get(x.dtype, 4e-2)
            self._verdicts.add(_relative_difference(x, fp), name, bound)
        return _ReplayAttention.apply(kept, q, k, v, *extra)


def check_checkpoint_plus_config(config) -> str | None:
    """Why Selective Checkpoint++ cannot be used with ``config`` (None if it can)."""
    if config.recompute_granularity != "full":
        return (
            f"selective_checkpoint_plus_plus keeps attention across megatron's full-layer recompute, but "
            f"recompute_granularity is {config.recompute_granularity!r}; set recompute_granularity='full' with "
            f"recompute_method 'uniform' or 'block' and recompute_num_layers (--recompute-granularity full "
            f"--recompute-method uniform --recompute-num-layers 1)"
        )
    check = getattr(config, "selective_checkpoint_plus_plus_check", "tolerance")
    problem = choice_problem("selective_checkpoint_plus_plus_check", check, RECOMPUTE_CHECKS)
    if problem:
        return f"{problem} (--selective-checkpoint-plus-plus-check)"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return (
            "selective_checkpoint_plus_plus is not supported with fp8/fp4 recompute (megatron then uses "
            "Transformer Engine's checkpoint, which does not mark its passes)"
        )
    return None
