"""Selective Checkpoint++: full-layer recompute that does not recompute attention.

Megatron's full recompute runs a layer's forward twice: once under ``torch.no_grad`` inside its checkpoint, and
again during backward to rebuild the graph. With Checkpoint++ the first pass keeps some of the attention's
intermediates per layer and micro-batch (a :class:`megatron_2d.kept_forward.KeptForward`, in a per-layer FIFO), and
the recompute pass rebuilds the layer as full recompute does but takes those intermediates instead of computing
them. The attention's backward is the op's own, from what the recompute saved, so dQ/dK/dV are exactly those of a
run without recompute. What is kept is the keep policy (``keep``, :data:`megatron_2d.layout.choices.CHECKPOINT_KEEPS`):

    outputs           (default, LoongTrain's) the ring's output and log-sum-exp: the recompute rebuilds q, k, v from
                      the layer input and runs the head all-to-alls again, but not the ring or the kernels' forward
    attention-inputs  also the head all-to-all's outputs (head-layout q and K/V) and the output after the inverse
                      exchange: the recompute sends nothing

Neither keeps anything in token layout of q, k or v (not Megatron's QKV projection output, of which v is a view,
nor the rotated q and k): the first pass runs under no_grad as Megatron's, and the op records only its own results.

Passes are told apart by megatron-core's own flag ``tensor_parallel.random.is_checkpointing()`` (set in both the
checkpointed forward and its recompute) and the grad mode (off in the first, on in the recompute). Micro-batches
are replayed in the order they ran forward, which is what every megatron-core schedule does (1F1B, interleaved:
each virtual stage has its own layers and FIFOs).

The recompute is checked against the first pass on a sample of the attention's inputs (q, k and v, or MLA's q,
latent and up-projection weight): a few elements of each are copied in the first pass and compared with the
recomputed ones (``check``): "tolerance" (default) allows the dtype's rounding noise (max |difference| / max
|first| up to ``RECOMPUTE_RTOL``), as GPUs recompute MoE permutations with atomics and differ bitwise; "bitwise" (a
debug mode) allows none. A replay of another micro-batch differs by O(1) and is refused either way. The check costs
no host sync: the verdict is computed on the device and copied to pinned host memory without blocking; it is read
once the copy has landed (polled at the keeper's next calls), and a failed check raises there, at most a few layer
calls after the recompute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from ..kept_forward import KeptForward
from ..layout.choices import CHECKPOINT_KEEPS, RECOMPUTE_CHECKS, CheckpointKeep, RecomputeCheck, check_choice
from .fields import NEEDS_CHECKPOINT_PLUS, fields_2d, flag, table

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v[, sinks], kept=None) -> out
_SAMPLES = 64  # elements per input compared between the first pass and the recompute
# max |recomputed - first| / max |first| over the sampled elements that "tolerance" allows: a few units of the
# dtype's rounding, as a recompute whose reductions run in another order gives
RECOMPUTE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A few evenly spaced elements of ``x``, compared between the first pass and the recompute."""
    flat = x.detach().reshape(-1)
    return flat[:: _sample_step(flat.numel())].clone()


def _sample_step(numel: int) -> int:
    return max(1, numel // _SAMPLES)


def fingerprint_elements(numel: int) -> int:
    """How many elements of an input of ``numel`` elements the first pass keeps for the check (64 or 65)."""
    return -(-numel // _sample_step(numel))


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
class _Kept:
    """One call's entry in the FIFO: what the op kept, and what the recompute is checked against."""

    forward: KeptForward
    shapes: tuple[torch.Size, ...]
    fingerprints: tuple[torch.Tensor, ...]


class AttentionKeeper:
    """The per-layer FIFO of kept attention (one entry per micro-batch between forward and backward); ``check`` is
    how a recompute is compared with its first pass ("tolerance" or "bitwise"), ``keep`` what is kept ("outputs" or
    "attention-inputs"; see the module)."""

    def __init__(
        self, check: RecomputeCheck = RecomputeCheck.TOLERANCE, keep: CheckpointKeep = CheckpointKeep.OUTPUTS
    ) -> None:
        self.check = check_choice("Selective Checkpoint++ check", check, RECOMPUTE_CHECKS)
        self.keep = check_choice("Selective Checkpoint++ keep", keep, CHECKPOINT_KEEPS)
        self._fifo: deque[_Kept] = deque()
        self._verdicts = _Verdicts()

    def __len__(self) -> int:
        return len(self._fifo)

    def kept_tensors(self) -> list[torch.Tensor]:
        """Every tensor the FIFO holds now: the kept intermediates and the fingerprints (memory accounting)."""
        return [t for entry in self._fifo for t in (*entry.forward.tensors(), *entry.fingerprints)]

    def __call__(
        self,
        attention: AttentionFn,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        names: tuple[str, str, str] = ("q", "k", "v"),
    ) -> torch.Tensor:
        """Run ``attention`` (q, k, v[, sinks], kept= -> out) under the Checkpoint++ rules; ``names`` name the three
        tensors in the check's messages."""
        extra = () if sinks is None else (sinks,)
        inputs = (q, k, v)
        self._verdicts.poll()
        if not is_checkpointing():
            return attention(*inputs, *extra)  # not inside a full-layer checkpoint: plain attention
        if not torch.is_grad_enabled():  # first pass of a checkpointed layer: record
            kept = KeptForward(self.keep, inputs)
            out = attention(*inputs, *extra, kept=kept)
            self._fifo.append(_Kept(kept, tuple(x.shape for x in inputs), tuple(_fingerprint(x) for x in inputs)))
            return out
        if not self._fifo:
            raise RuntimeError(
                "Selective Checkpoint++: a recompute pass found no kept attention for this layer; "
                "the layer's first pass did not run inside megatron's checkpoint"
            )
        entry = self._fifo.popleft()
        for name, x, shape, fp in zip(names, inputs, entry.shapes, entry.fingerprints):
            if x.shape != shape:
                raise RuntimeError(
                    f"Selective Checkpoint++: the recomputed {name} has shape {tuple(x.shape)}, the "
                    f"first pass {tuple(shape)} (micro-batches replayed out of order?); disable "
                    f"selective_checkpoint_plus_plus for this run"
                )
            bound = 0.0 if self.check == RecomputeCheck.BITWISE else RECOMPUTE_RTOL.get(x.dtype, 4e-2)
            self._verdicts.add(_relative_difference(x, fp), name, bound)
        entry.forward.start_replay()
        return attention(*inputs, *extra, kept=entry.forward)


def check_checkpoint_plus_config(config) -> str | None:
    """Why Selective Checkpoint++ cannot be used with ``config`` (None if it can)."""
    if config.recompute_granularity != "full":
        return (
            f"selective_checkpoint_plus_plus keeps attention across megatron's full-layer recompute, but "
            f"recompute_granularity is {config.recompute_granularity!r}; set recompute_granularity='full' with "
            f"recompute_method 'uniform' or 'block' and recompute_num_layers (--recompute-granularity full "
            f"--recompute-method uniform --recompute-num-layers 1)"
        )
    values = fields_2d(config)
    for f, setting in table():  # the values of its settings (check, keep); as check_values, with the flag
        if setting.needs == NEEDS_CHECKPOINT_PLUS and getattr(values, f.name) != f.default:
            try:
                setting.validate(f.name, getattr(values, f.name))
            except ValueError as error:
                return f"{error} ({flag(f.name)})"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return (
            "selective_checkpoint_plus_plus is not supported with fp8/fp4 recompute (megatron then uses "
            "Transformer Engine's checkpoint, which does not mark its passes)"
        )
    return None
