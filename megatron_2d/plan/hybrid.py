"""HybridModel patterns in the planner (``--hybrid-pattern 'M*-M*-'``).

What changes against a GPT of the same ``ModelSpec``:

* **Attention layers only are 2D (or stock CP) attention.** Each ``*`` is costed as one GPT layer of the model
  (its attention with the choice of layout, and one MLP), so ``'*-' * N`` is the GPT of N layers; the ``-`` layers
  are not costed again (an ``E``/``-`` beyond one per attention layer is not modelled).
* **Mamba (``M``) and GDN (``G``) layers use Megatron's own context parallelism**: an all-to-all over the *whole*
  CP group (hp x cp ranks, every layout alike) before and after their scan, forward and backward, plus their
  projections' matmuls. Both are added to every layout's step time; their activation memory is not modelled.
* A layout whose CP size the Mamba / GDN heads cannot split over is infeasible, with Megatron's rule in our words
  (:mod:`megatron_2d.layout.hybrid_layers`).

Mamba/GDN sizes are megatron-core's defaults (Mamba: expand 2, head dim 64, state 128, 8 groups; GDN: 16 key heads
and 32 value heads of 128), Nemotron-H / Qwen3-Next-like.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layout.choices import Placement
from ..layout.hybrid_layers import HybridLayerCounts, gdn_cp_problem, mamba_cp_problem, mamba_num_heads
from .attention_time import path_time
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError
from .link_classes import link_map

BF16 = 2
MAMBA = dict(expand=2, head_dim=64, state=128, groups=8)
GDN = dict(key_heads=16, value_heads=32, head_dim=128)


@dataclass(frozen=True)
class HybridPattern:
    """A parsed ``--hybrid-layer-pattern`` and the per-layer work of its Mamba / GDN layers."""

    pattern: str
    counts: HybridLayerCounts

    @classmethod
    def parse(cls, pattern: str) -> HybridPattern:
        try:
            counts = HybridLayerCounts.of(pattern)
        except ValueError as err:
            raise PlanError(str(err)) from None
        if counts.attention == 0:
            raise PlanError(f"hybrid pattern {pattern!r} has no attention layer ('*'): nothing for 2D attention")
        return cls(pattern, counts)

    def attention_model(self, model: ModelSpec) -> ModelSpec:
        """The model as the attention cost sees it: one GPT layer per attention layer."""
        return dataclasses.replace(model, layers=self.counts.attention)

    def problem(self, model: ModelSpec, tp: int, context_parallel: int) -> str | None:
        """Why Megatron's Mamba / GDN context parallelism cannot run at this CP size, or None."""
        problems = []
        if self.counts.mamba:
            heads = mamba_num_heads(model.hidden, MAMBA["head_dim"], None, MAMBA["expand"])
            problems.append(mamba_cp_problem(heads, MAMBA["groups"], tp, context_parallel))
        if self.counts.gdn:
            problems.append(gdn_cp_problem(GDN["key_heads"], GDN["value_heads"], tp, context_parallel))
        return "; ".join(p for p in problems if p) or None

    def _channels(self, model: ModelSpec) -> dict:
        """Per SSM family: (channels into the scan, channels out of it, projection weights) per layer."""
        D = model.hidden
        d_inner = MAMBA["expand"] * D
        heads = d_inner // MAMBA["head_dim"]
        mamba_in = 2 * d_inner + 2 * MAMBA["groups"] * MAMBA["state"] + heads
        qk, v = GDN["key_heads"] * GDN["head_dim"], GDN["value_heads"] * GDN["head_dim"]
        gdn_in = 2 * qk + 2 * v + 2 * GDN["value_heads"]
        return {"mamba": (mamba_in, d_inner, D * mamba_in + d_inner * D), "gdn": (gdn_in, v, D * gdn_in + v * D)}

    def ssm_step_s(
        self, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, context_parallel: int, seq: int
    ) -> float:
        """Seconds per step of all Mamba / GDN layers: their all-to-alls over the whole CP group (in and out of the
        scan, forward and backward) and their projections' matmuls (6 x weights x tokens)."""
        tp, CP = parallel.tp, context_parallel
        tokens = parallel.micro_batch * seq
        group = tp * CP
        dense_rate = cluster.peak_tflops * 1e12 * cluster.dense_efficiency
        links = link_map(CP, 1, 1, Placement.HEAD_FIRST, tp, cluster.gpus_per_node, parallel.gpus).a2a if CP > 1 else ()
        total = 0.0
        for family, layers in (("mamba", self.counts.mamba), ("gdn", self.counts.gdn)):
            channels_in, channels_out, weights = self._channels(model)[family]
            a2a = 0.0
            if CP > 1:  # each rank sends 1/CP of its local tokens' channels to every CP peer
                for channels in (channels_in, channels_out):
                    a2a += 2 * path_time(links, BF16 * tokens / CP * channels / tp / CP, cluster, "a2a")  # fwd+bwd
            total += layers * (a2a + 6.0 * weights * tokens / group / dense_rate)
        return total


def with_extra_step(e, seconds: float):
    """Estimate ``e`` with ``seconds`` more per step (layout-independent layers): tokens/s and MFU follow (MFU keeps
    counting the attention model's FLOPs only)."""
    step = e.step_s + seconds
    return dataclasses.replace(
        e, step_s=step, mfu=e.mfu * e.step_s / step, tokens_per_gpu_s=e.tokens_per_gpu_s * e.step_s / step
    )
