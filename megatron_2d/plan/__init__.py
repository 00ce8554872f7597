"""Performance model and layout planner for 2D-Attention (pure Python: no torch, no torch.distributed).

    from megatron_2d.plan import plan, ParallelSpec
    cands = plan("7B-GQA", "8xH100", ParallelSpec(gpus=64), seq=131072)   # fastest feasible first
    best = cands[0]; best.layout, best.time_ms, best.flags, best.to_dict()

Modules: hardware (specs, presets, PlanError), placement (which links each path uses), cost_model (formulas),
candidates (layouts, feasibility, Megatron flags), planner (plan/evaluate), calibrate (fit rates to measurements),
report (text/JSON), plot (matplotlib), cli (``python -m megatron_2d.plan``).
"""

from .calibrate import FitResult, WorkCounts, calibrate, fit_rates, work_counts
from .candidates import KINDS, Layout, check_layout, enumerate_layouts, megatron_flags
from .cost_model import Estimate, estimate, layer_work, replicated_kv_heads
from .hardware import (CLUSTER_PRESETS, MODEL_PRESETS, PRESETS, ClusterSpec, ModelSpec, ParallelSpec, PlanError,
                       get_cluster, get_model)
from .planner import Candidate, best_by_kind, evaluate, plan

__all__ = [
    "CLUSTER_PRESETS", "Candidate", "ClusterSpec", "Estimate", "FitResult", "KINDS", "Layout", "MODEL_PRESETS",
    "ModelSpec", "PRESETS", "ParallelSpec", "PlanError", "WorkCounts", "best_by_kind", "calibrate",
    "check_layout", "enumerate_layouts", "estimate", "evaluate", "fit_rates", "get_cluster", "get_model",
    "layer_work", "megatron_flags", "plan", "replicated_kv_heads", "work_counts",
]
