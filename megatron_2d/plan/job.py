"""What the planner is asked: one frozen ``Job`` for plan, evaluate and estimate, and its per-layer windows.

:func:`.planner.plan`, :func:`.planner.evaluate` and :func:`.step.estimate` take a :class:`Job`; its ``memory`` is a
:class:`MemoryPolicy` (which memory options a plan tries) and its ``window`` a :data:`Window`
(:func:`layer_windows` counts the layers of each).

    >>> from megatron_2d.plan import Job, ParallelSpec
    >>> job = Job("7B-GQA", "8xH100", ParallelSpec(gpus=64), 131072, window=(4096, None))
    >>> job.model.name, layer_windows(job.window, 4)
    ('7B-GQA', {4096: 2, None: 2})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..layout.choices import DkvCommDtype
from .hardware import ClusterSpec, ModelSpec, ParallelSpec, PlanError, get_cluster, get_model
from .hybrid import HybridPattern

AUTO = "auto"
"""``recompute=AUTO``: try every mode the kind supports and keep the fastest that fits in memory."""

CHOICES = ("auto", "dist-opt", "stock", "all")
"""``MemoryPolicy.choice``: each side its own options (auto), everyone the distributed optimizer only (dist-opt: the
planner before memory options), everyone Megatron's own options (stock: 2D without Hybrid ZeRO's partial sharding),
or auto plus the choices that change training (all: optimizer states sharded wider than params, with gradient
clipping off)."""


@dataclass(frozen=True)
class MemoryPolicy:
    """Which memory options a plan tries."""

    choice: str = "auto"
    """One of CHOICES."""
    fair: bool = False
    """Stock kinds get the 2D side's options and (hypothetical) Selective Checkpoint++ too (``--fair-memory``)."""
    global_batch_tokens: int = 4 << 20
    """Tokens per optimizer step (all data-parallel ranks): sets the micro-batches per step over which per-step
    communication is spread (:meth:`accum_steps`). 4M tokens: Llama 2's global batch."""

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise PlanError(f"memory choice {self.choice!r} is not one of {', '.join(CHOICES)}")
        g = self.global_batch_tokens
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise PlanError(f"global_batch_tokens must be a positive integer, got {g!r}")

    def accum_steps(self, seq: int, parallel: ParallelSpec) -> int:
        """Micro-batches per optimizer step on one data-parallel rank: ceil(global batch / (seq x micro-batch x
        DP)), at least 1."""
        return max(1, -(-self.global_batch_tokens // (seq * parallel.micro_batch * parallel.dp_size)))


Window = int | Sequence[int | None] | None
"""A sliding window for every layer (tokens back; None: full causal), or a per-layer pattern repeated over the
layers (e.g. (4096, None): every other layer windowed, as gpt-oss alternates)."""


@dataclass(frozen=True)
class Job:
    """A model trained on a cluster with the parallel sizes, at one sequence length, and the planner's options.

    ``model`` / ``cluster``: a spec or a preset name (resolved here). ``window``: see :data:`Window`.
    ``recompute``: AUTO (every mode the kind supports), one mode or a list (:class:`RecomputeMode`).
    ``dkv_comm_dtype``: how the 2D ring's dK/dV partials travel (:class:`DkvCommDtype`; stock kinds always send the
    input dtype). ``lengths``: document lengths of a packed batch, summing to ``seq``. ``hybrid_pattern``: a
    HybridModel's ``--hybrid-layer-pattern`` (:mod:`.hybrid`). ``memory``: which memory options each kind tries.
    ``kernel``: the kernel 2D layouts run (None: its selection's, :mod:`.kernel_rates`). ``qk_clip``: every
    forward also computes the max attention logit."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec
    seq: int
    causal: bool = True
    window: Window = None
    recompute: str | Sequence[str] = AUTO
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR
    lengths: Sequence[int] | None = None
    hybrid_pattern: str | None = None
    memory: MemoryPolicy = MemoryPolicy()
    kernel: str | None = None
    qk_clip: bool = False
    hybrid: HybridPattern | None = field(init=False, repr=False, compare=False)
    """``hybrid_pattern`` parsed (None without one)."""

    def __post_init__(self) -> None:
        model = get_model(self.model) if isinstance(self.model, str) else self.model
        cluster = get_cluster(self.cluster) if isinstance(self.cluster, str) else self.cluster
        if not isinstance(model, ModelSpec):
            raise PlanError(f"model must be a ModelSpec or a preset name, got {type(model).__name__}")
        if not isinstance(cluster, ClusterSpec):
            raise PlanError(f"cluster must be a ClusterSpec or a preset name, got {type(cluster).__name__}")
        hybrid = None if self.hybrid_pattern is None else HybridPattern.parse(self.hybrid_pattern)
        for name, value in (("model", model), ("cluster", cluster), ("hybrid", hybrid)):
            object.__setattr__(self, name, value)
        for name in ("window", "recompute"):  # a list given becomes a tuple: the job is a hashable value
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))

    @classmethod
    def of(cls, job: Job | ModelSpec | str | None, args: tuple, fields: dict) -> Job:
        """``job`` itself, or a Job of the fields given as before Job existed (``plan(model, cluster, parallel,
        seq, window=...)``)."""
        if isinstance(job, Job):
            if args or fields:
                raise TypeError(f"a Job takes no further fields here; got {len(args)} more and {sorted(fields)}")
            return job
        return cls(*(() if job is None else (job,)), *args, **fields)

    @property
    def attention_model(self) -> ModelSpec:
        """The model as the attention cost sees it: a hybrid model's attention layers only."""
        return self.model if self.hybrid is None else self.hybrid.attention_model(self.model)


def layer_windows(window: Window, layers: int) -> dict[int | None, int]:
    """{window: number of layers with it}; a sequence is a per-layer pattern, repeated cyclically over ``layers``."""
    if window is None or isinstance(window, int):
        return {window: layers}
    pattern = list(window)
    if not pattern:
        raise PlanError("a per-layer window pattern needs at least one entry (a window in tokens or None)")
    out: dict[int | None, int] = {}
    for i in range(layers):
        w = pattern[i % len(pattern)]
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise PlanError(f"window {w!r} must be a non-negative number of tokens or None (full causal)")
        out[w] = out.get(w, 0) + 1
    return out
