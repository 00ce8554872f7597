"""``plan``: evaluate every candidate layout for a job and rank them by predicted attention time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from .candidates import KINDS, Layout, check_layout, enumerate_layouts, megatron_flags
from .cost_model import Estimate, estimate
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError, get_cluster, get_model


@dataclass(frozen=True)
class Candidate:
    """A layout with its verdict: ``feasible`` and ``reason``, and when feasible the ``estimate``."""

    layout: Layout
    feasible: bool
    reason: str
    flags: str
    estimate: Optional[Estimate] = None

    kind = property(lambda self: self.layout.kind)
    hp = property(lambda self: self.layout.hp)
    cp = property(lambda self: self.layout.cp)
    w = property(lambda self: self.layout.w)
    placement = property(lambda self: self.layout.placement)

    @property
    def time_ms(self) -> Optional[float]:
        """Attention forward + backward of one layer, ms (None when infeasible)."""
        return self.estimate.time_s * 1e3 if self.estimate else None

    def to_dict(self) -> Dict[str, object]:
        """A JSON-ready record (times in ms, memory in GB, MFU as a fraction, links as nvlink/network/mixed/-)."""
        e = self.estimate
        ms = (lambda s: round(s * 1e3, 4)) if e else (lambda s: None)
        d: Dict[str, object] = {
            "kind": self.kind, "hp": self.hp, "cp": self.cp, "w": self.w, "placement": self.placement,
            "feasible": self.feasible, "reason": self.reason, "flags": self.flags,
            "time_ms": ms(e.time_s) if e else None,
            "compute_ms": ms(e.compute_s) if e else None,
            "comm_ms": ms(e.comm_s) if e else None,
            "a2a_ms": ms(e.a2a_s) if e else None,
            "ring_exposed_ms": ms(e.ring_exposed_s) if e else None,
            "comm_total_ms": ms(e.comm_total_s) if e else None,
            "mfu": round(e.mfu, 4) if e else None,
            "tokens_per_gpu_s": round(e.tokens_per_gpu_s, 1) if e else None,
            "step_ms": ms(e.step_s) if e else None,
            "memory_gb": round(e.memory_gb, 2) if e else None,
            "activation_gb": round(e.activation_gb, 2) if e else None,
            "kv_heads_per_rank": e.work.kv_heads_per_rank if e else None,
            "nvlink_mb": round(e.intra_bytes / 1e6, 2) if e else None,
            "network_mb": round(e.inter_bytes / 1e6, 2) if e else None,
        }
        if e:
            d["links"] = {p: e.links.describe(getattr(e.links, p)) for p in ("a2a", "inner", "outer")}
        return d


def _resolve(model, cluster):
    m = get_model(model) if isinstance(model, str) else model
    c = get_cluster(cluster) if isinstance(cluster, str) else cluster
    if not isinstance(m, ModelSpec):
        raise PlanError(f"model must be a ModelSpec or a preset name, got {type(m).__name__}")
    if not isinstance(c, ClusterSpec):
        raise PlanError(f"cluster must be a ClusterSpec or a preset name, got {type(c).__name__}")
    return m, c


def validate_job(model: ModelSpec, parallel: ParallelSpec, seq: int) -> None:
    """Errors no layout can fix: TP must divide the heads and KV heads, PP the layers; seq must be positive."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise PlanError(f"sequence length must be a positive integer, got {seq!r}")
    if model.heads % parallel.tp or model.kv_heads % parallel.tp:
        raise PlanError(f"tp={parallel.tp} must divide heads={model.heads} and kv_heads={model.kv_heads}; valid tp: "
                        f"{[t for t in range(1, model.kv_heads + 1) if model.kv_heads % t == 0]}")
    if model.layers % parallel.pp:
        raise PlanError(f"pp={parallel.pp} does not divide layers={model.layers}; valid pp: "
                        f"{[p for p in range(1, model.layers + 1) if model.layers % p == 0]}")


def evaluate(layout: Layout, model: Union[ModelSpec, str], cluster: Union[ClusterSpec, str],
             parallel: ParallelSpec, seq: int, causal: bool = True, window: Optional[int] = None) -> Candidate:
    """Check and, when feasible, estimate one layout (``window``: causal sliding window in tokens, or None)."""
    model, cluster = _resolve(model, cluster)
    validate_job(model, parallel, seq)
    reason = check_layout(layout, model, parallel, seq, window)
    flags = megatron_flags(layout, parallel)
    if reason:
        return Candidate(layout, False, reason, flags)
    est = estimate(model, cluster, parallel, layout.hp, layout.cp, layout.w, layout.placement, seq, causal, window)
    return Candidate(layout, True, "", flags, est)


def _sort_key(c: Candidate):
    # Ties (e.g. all-hidden rings) go to stock kinds first (fewer moving parts), then less network traffic.
    e = c.estimate
    return (round(e.time_s, 9), KINDS.index(c.kind) == 0, round(e.inter_bytes), c.hp, -c.w, c.placement)


def plan(model: Union[ModelSpec, str], cluster: Union[ClusterSpec, str], parallel: ParallelSpec, seq: int,
         causal: bool = True, window: Optional[int] = None) -> List[Candidate]:
    """All candidate layouts for the job: feasible ones fastest first, then the infeasible ones with reasons.

    >>> from megatron_2d.plan import plan, ParallelSpec
    >>> cands = plan("7B-GQA", "8xH100", ParallelSpec(gpus=64), seq=131072)
    >>> best = cands[0]
    >>> best.feasible, best.time_ms <= min(c.time_ms for c in cands if c.kind == "p2p")
    (True, True)
    >>> [c.reason for c in cands if c.kind == "a2a"]
    ['hp=64 does not divide the 32 query heads per TP rank; valid hp: [1, 2, 4, 8, 16, 32]']
    """
    model, cluster = _resolve(model, cluster)
    validate_job(model, parallel, seq)
    cands = [evaluate(l, model, cluster, parallel, seq, causal, window) for l in enumerate_layouts(model, parallel)]
    ok = sorted((c for c in cands if c.feasible), key=_sort_key)
    return ok + [c for c in cands if not c.feasible]


def best_by_kind(candidates: List[Candidate]) -> Dict[str, Candidate]:
    """The first (fastest) candidate of each kind; an infeasible one when a kind has no feasible layout."""
    out: Dict[str, Candidate] = {}
    for c in candidates:
        if c.kind not in out or (c.feasible and not out[c.kind].feasible):
            out[c.kind] = c
    return out
