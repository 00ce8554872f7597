"""How model states are held: one memory option and what it holds and sends, per rank.

The types :mod:`.memory_options` computes and :class:`.step.Estimate` carries, in a module of their own:
memory_options imports the estimate, and the estimate needs only these types back (pure Python).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.choices import PlanKind
from ..layout.zero_sharding import HybridZeRO


@dataclass(frozen=True)
class MemoryOption:
    """One way to hold the model states: a HybridZeRO choice with a short label; ``rank`` orders ties (simpler
    first)."""

    label: str
    zero: HybridZeRO
    rank: int

    @property
    def zero_stage(self) -> int:
        """1, 2 or 3: what is sharded (optimizer; + grads; + params)."""
        return {"optimizer": 1, "optimizer+grads": 2, "optimizer+grads+params": 3}[self.zero.sharded_states]

    def flags(self, kind: str, dp: int, cp: int) -> str:
        """The command-line arguments that turn this option on for ``kind`` (DeepSpeed's config for ds-ulysses)."""
        if kind == PlanKind.DS_ULYSSES:
            return (
                f"; DeepSpeed zero_optimization.stage {self.zero_stage} over "
                f"{self.zero.resolved_shard_size(dp, cp)} ranks"
            )
        return " ".join(self.zero.megatron_cli_args(dp, cp))


@dataclass(frozen=True)
class ShardingCost:
    """What one memory option holds and sends, per rank (bytes; seconds per layer and micro-batch)."""

    option: MemoryOption
    params: float
    grads: float
    optimizer: float
    gathered: float
    """Transient: gathered layers of ZeRO-3 and unsharded grads of ZeRO-2/3 (see :mod:`.memory_options`)."""
    gather_bytes: float
    """Bytes this rank receives by all-gathers in one micro-batch (every layer)."""
    scatter_bytes: float
    """Bytes this rank sends by reduce-scatters and all-reduces in one micro-batch (every layer)."""
    fwd_comm_s: float
    bwd_comm_s: float
    exposed_s: float
    """Per layer: communication not hidden behind its phase's compute, plus the compute slowed while it runs."""
    links: str
    """Links of the shard group's collectives: nvlink | network | mixed | -."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered

    @property
    def sharded(self) -> float:
        """The part of the states that shrinks with the shard size (optimizer; + grads; + params)."""
        stage = self.option.zero_stage
        return self.optimizer + (self.grads if stage >= 2 else 0.0) + (self.params if stage == 3 else 0.0)
