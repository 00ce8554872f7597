"""What Selective Checkpoint++ keeps of one attention call: intermediates the first pass records and the recompute
returns in place of computing them.

The op's autograd Functions each take a :class:`KeptForward` (None for a plain call) at one named point:

    to_heads    the head all-to-all's outputs: q [b, S, hq/hp, dk] and the K/V block [b, S, hkv'/hp, dk + dv]
                (MLA's latent ring: q alone)
    gather      MLA's latent ring: the latent gathered over the head group [b, S, r + dr]
    ring        the ring's output [b, S, hq/hp, dv] and its log-sum-exp [b, hq/hp, S] (accumulator dtype)
    to_tokens   the output after the inverse all-to-all [s, b, hq, dv]
    max_logit   the max logit [hq] over the CP group (``return_max_logit``), after its reductions

At a point it keeps, the first pass records the Function's results; in the recompute the Function returns them
instead of running (no message, no kernel) and saves for its backward what a run would have saved, so the backward
is the Function's own. What each keep policy (:data:`megatron_2d.layout.choices.CHECKPOINT_KEEPS`) keeps:

    outputs           ring (and max_logit): the recompute runs both head exchanges again, as full recompute does,
                      but neither the ring nor the kernels' forward; the ring's backward starts from the kept out
                      and lse
    attention-inputs  every point: the recompute sends nothing and runs no attention; the exchanges' backward runs
                      inside the replay's backward

Nothing kept shares storage with the call's token-layout inputs (a recorded view of them is copied), so neither
Megatron's QKV projection output (of which v is a view) nor the rotated q and k outlive the first pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from .layout.choices import CHECKPOINT_KEEPS, CheckpointKeep, StrEnum, check_choice


class Point(StrEnum):
    """The named points of one attention call at which Selective Checkpoint++ may keep results (see the module)."""

    TO_HEADS = "to_heads"
    GATHER = "gather"
    RING = "ring"
    TO_TOKENS = "to_tokens"
    MAX_LOGIT = "max_logit"


POINTS = tuple(Point)
KEPT_POINTS = {CheckpointKeep.OUTPUTS: (Point.RING, Point.MAX_LOGIT), CheckpointKeep.ATTENTION_INPUTS: POINTS}
assert set(KEPT_POINTS) == set(CHECKPOINT_KEEPS)


class KeptForward:
    """The kept intermediates of one attention call: recorded while ``replaying`` is False (the first pass), then
    given back once each (:meth:`start_replay`, the recompute)."""

    def __init__(self, keep: str, inputs: Iterable[torch.Tensor]) -> None:
        self.points = frozenset(KEPT_POINTS[check_choice("keep", keep, CHECKPOINT_KEEPS)])
        self._inputs = {_storage(t) for t in inputs}  # storages that must not be kept
        self._kept: dict[str, tuple[torch.Tensor, ...]] = {}
        self.replaying = False

    def record(self, point: str, tensors: Sequence[torch.Tensor]) -> None:
        """Keep ``tensors`` at ``point`` (first pass, a point of the policy; otherwise nothing)."""
        if not self.replaying and point in self.points:
            self._kept[point] = tuple(_own(t) if _storage(t) in self._inputs else t.detach() for t in tensors)

    def replay(self, point: str) -> tuple[torch.Tensor, ...] | None:
        """The tensors kept at ``point`` (recompute; given once), or None where the Function must run."""
        if not self.replaying or point not in self.points:
            return None
        if point not in self._kept:
            raise RuntimeError(
                f"Selective Checkpoint++: the recompute reached {point!r}, which its first pass did not "
                f"(recorded: {sorted(self._kept)}); the two passes ran different attention paths"
            )
        return self._kept.pop(point)

    def start_replay(self) -> None:
        self.replaying = True

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor kept now (what this call holds between its first pass and its recompute)."""
        for kept in self._kept.values():
            yield from kept


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in storage of its own (a recorded view of an input, e.g. hp = 1's head layout of q)."""
    return t.detach().clone()
