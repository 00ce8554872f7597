"""Performance model and layout planner for 2D-Attention (pure Python: no torch, no torch.distributed).

    from megatron_2d.plan import Job, plan, ParallelSpec
    cands = plan(Job("7B-GQA", "8xH100", ParallelSpec(gpus=64), seq=131072))   # fastest feasible first
    best = cands[0]; best.scheme, best.time_ms, best.flags, best.to_dict()

Each layout is estimated under every memory option (how model states are held: the distributed optimizer,
megatron-fsdp, Hybrid ZeRO for 2D) and recompute mode its kind supports (none, Megatron selective, full, Selective
Checkpoint++ for 2D) and gets the fastest that fits in GPU memory; ``recommended(cands)`` is the first feasible row
(None when nothing fits). An MLA model (``ModelSpec.mla``, preset DSV3-MLA) gets each 2D layout with
per-head K/V on the ring and with the latent (``--cp-2d-mla-ring latent``).

Modules: hardware (specs, presets), errors (PlanError), links (link efficiency), link_classes (which links each path
uses), windows / packed / hybrid (sliding windows, packed documents, Mamba/GDN layers as the op runs them),
attention_time (one layer's work, ring / neighbour exchange times, traffic), memory (peak memory by recompute mode),
step (the estimate: attention, step time with recompute, MFU), memory_options (sharded model states and their
communication), candidates (layouts, feasibility, Megatron flags), job (what the planner is asked: ``Job``),
planner (plan/evaluate), calibrate (fit rates and link factors to measurements), report (text/JSON), plot
(matplotlib), grid (best 2D vs best stock over models, GPUs and lengths), paper (LoongTrain's reported figures),
console (terminal helpers), cli (``python -m megatron_2d.plan``, ``... grid``, ``... paper``).
"""

from ..layout.heads import replicated_kv_heads
from .attention_time import layer_work
from .calibrate import FitResult, WorkCounts, calibrate, fit_rates, work_counts
from .candidates import KINDS, Scheme, check_scheme, enumerate_schemes, megatron_flags
from .hardware import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    PRESETS,
    ClusterSpec,
    MLASpec,
    ModelSpec,
    ParallelSpec,
    PlanError,
    get_cluster,
    get_model,
)
from .job import Job
from .links import IDEAL_LINKS, LinkEfficiency
from .memory import RECOMPUTE_MODES, MemoryBreakdown, memory_breakdown
from .memory_options import MemoryPolicy
from .planner import AUTO, Candidate, best_by_kind, evaluate, plan, recommended
from .step import Estimate, estimate, with_recompute

__all__ = [
    "AUTO",
    "CLUSTER_PRESETS",
    "Candidate",
    "ClusterSpec",
    "Estimate",
    "FitResult",
    "IDEAL_LINKS",
    "Job",
    "KINDS",
    "Scheme",
    "LinkEfficiency",
    "MLASpec",
    "MODEL_PRESETS",
    "MemoryBreakdown",
    "MemoryPolicy",
    "ModelSpec",
    "PRESETS",
    "ParallelSpec",
    "PlanError",
    "RECOMPUTE_MODES",
    "WorkCounts",
    "best_by_kind",
    "calibrate",
    "check_scheme",
    "enumerate_schemes",
    "estimate",
    "evaluate",
    "fit_rates",
    "get_cluster",
    "get_model",
    "layer_work",
    "megatron_flags",
    "memory_breakdown",
    "plan",
    "recommended",
    "replicated_kv_heads",
    "with_recompute",
    "work_counts",
]
