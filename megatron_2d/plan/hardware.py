"""What the planner is told: the model, the cluster, the fixed parallel sizes, and named presets.

Every dataclass validates itself on construction and raises :class:`PlanError` naming the offending value and
what would be valid. Hardware figures come from /work/shared/notes/field-and-peers.md ("Figures for cost models")
unless a field's docstring says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..layout.costs import H100
from ..layout.topology import divisors
from .errors import PlanError
from .kernel_rates import ARCHITECTURES, kernel_rate
from .links import LinkEfficiency


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise PlanError(f"{name} must be a positive finite number, got {value!r}")


def _fraction(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise PlanError(f"{name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3): per-head K and V made from a shared latent per token."""

    q_lora_rank: int
    """Width of the compressed query (its down/up projections)."""
    kv_lora_rank: int
    """r: width of the compressed KV, the latent (what the latent ring carries, with the rope key)."""
    qk_head_dim: int
    """dn: per-head query/key dim without RoPE."""
    qk_rope_dim: int
    """dr: the RoPE part of q/k; the rope key is shared by all heads."""
    v_head_dim: int
    """dv: per-head value dim."""

    def __post_init__(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_rope_dim", "v_head_dim"):
            _positive_int(f"mla {name}", getattr(self, name))

    @property
    def latent_width(self) -> int:
        """r + dr: values per token on the latent ring."""
        return self.kv_lora_rank + self.qk_rope_dim


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama-style: RMSNorm, SwiGLU MLP, untied output layer), optionally with
    multi-latent attention (``mla``)."""

    name: str
    layers: int
    """Transformer layers."""
    hidden: int
    """D, the model width; head dimension d = D / heads."""
    heads: int
    """H, query heads."""
    kv_heads: int
    """H_kv, key/value heads (H_kv < H is GQA, 1 is MQA); must divide H."""
    ffn_hidden: int
    """F, MLP intermediate size."""
    vocab: int
    """V, vocabulary size (output layer rows)."""
    gated_mlp: bool = True
    """SwiGLU: fc1 produces 2F (gate and up), so the MLP has 3*D*F weights instead of 2*D*F."""
    mla: MLASpec | None = None
    """Multi-latent attention's dims (None: standard attention with head dim D / H). With MLA, kv_heads must equal
    heads (every head has its own K and V, made from the latent)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            _positive_int(f"model {name}", getattr(self, name))
        if self.mla is None and self.hidden % self.heads:
            raise PlanError(f"model hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise PlanError(
                f"model kv_heads={self.kv_heads} must divide heads={self.heads} (valid: {divisors(self.heads)})"
            )
        if self.mla is not None and self.kv_heads != self.heads:
            raise PlanError(
                f"an MLA model has K/V per query head: kv_heads={self.kv_heads} must equal heads={self.heads}"
            )

    @property
    def head_dim(self) -> int:
        """d = D / H (standard attention; see qk_dim / v_dim)."""
        return self.hidden // self.heads

    @property
    def qk_dim(self) -> int:
        """Query/key head dim: d, or MLA's dn + dr."""
        return self.head_dim if self.mla is None else self.mla.qk_head_dim + self.mla.qk_rope_dim

    @property
    def v_dim(self) -> int:
        """Value head dim: d, or MLA's dv."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    def kv_up_params(self) -> int:
        """MLA's K/V up-projection weights of one layer, r x H*(dn + dv) (0 without MLA)."""
        m = self.mla
        return 0 if m is None else m.kv_lora_rank * self.heads * (m.qk_head_dim + m.v_head_dim)

    def layer_params(self) -> int:
        """Matmul weights of one layer: attention and MLP (3 or 2 x D*F). Standard attention: Q and O (D x H*d
        each), K and V (D x H_kv*d each). MLA: q down/up (D x q_lora, q_lora x H*(dn+dr)), kv down (D x (r+dr)),
        kv up (r x H*(dn+dv)), O (H*dv x D)."""
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden
        m, D, H = self.mla, self.hidden, self.heads
        if m is None:
            d = self.head_dim
            return 2 * D * H * d + 2 * D * self.kv_heads * d + mlp
        attn = (
            D * m.q_lora_rank
            + m.q_lora_rank * H * self.qk_dim
            + D * m.latent_width
            + self.kv_up_params()
            + H * m.v_head_dim * D
        )
        return attn + mlp

    def matmul_params(self) -> int:
        """N for the 6*N*tokens rule: all layers plus the output layer (the input embedding is a lookup)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def total_params(self) -> int:
        """All weights, including the input embedding (norm weights ignored), for memory estimates."""
        return self.matmul_params() + self.vocab * self.hidden


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous GPU cluster: identical nodes, NVLink inside a node, NICs between nodes."""

    name: str
    gpus_per_node: int
    """GPUs in one NVLink domain (one node)."""
    peak_tflops: float
    """Dense bf16 peak per GPU, TFLOP/s (H100/H200 SXM: 989; A100: 312)."""
    attn_efficiency: float | None
    """Fraction of peak the attention kernel reaches over forward+backward on zigzag half blocks, whatever kernel
    runs (a calibration's or --attn-eff's measured figure); None: each kernel's own rate on ``arch``
    (:mod:`megatron_2d.plan.kernel_rates`, cited there), as the presets leave it."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU per direction, GB/s (NVLink 4: 450; NVLink 3: 300)."""
    net_gbps_per_node: float
    """Network bandwidth leaving one node, GB/s, summed over its NICs (8 x 400 Gb/s = 400 GB/s)."""
    nics_per_node: int
    """NICs per node; one P2P flow is assumed to use one NIC (rail-local), so a node's bandwidth needs at least
    this many concurrent flows to be used in full."""
    dense_efficiency: float = 0.6
    """Fraction of peak reached by the non-attention GEMMs of a whole layer (H100: ~780/989 on large GEMMs;
    0.6 leaves room for norms, activations and TP communication, which are not modelled)."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU (GB). A layout fits when its estimated peak is at most ``usable_memory_fraction`` of it."""
    hbm_gbps: float = 3350.0
    """HBM bandwidth per GPU, GB/s (vendor spec sheets: H100 SXM 3350, H200 4800, A100 80GB 2039); prices the
    memory-bound work of a ring step (merging partial outputs, accumulating dQ/dK/dV) and all-to-all permutes."""
    step_latency_us: float = 10.0
    """Fixed cost of one ring step or all-to-all, microseconds: kernel launches and stream/event waits. An
    assumption (a few launches of ~2-5 us each); refine with calibrate(). 0 disables it."""

    usable_memory_fraction: float = 0.9
    """Fraction of ``gpu_memory_gb`` the estimate may use: the CUDA context, NCCL buffers, the caching
    allocator's fragmentation and what the estimate leaves out (norm weights, kernels' workspaces) take the rest.
    An assumption (a few GB of an 80 GB GPU); 1.0 trusts the estimate to the byte."""
    links: LinkEfficiency = field(default_factory=LinkEfficiency)
    """Share of the nominal NVLink / network bandwidth that ring sends (p2p) and collectives (a2a) get, and the
    slowdown of compute while transfers run (:mod:`megatron_2d.plan.links`: defaults from published NCCL
    measurements; ``links.IDEAL_LINKS`` for none)."""
    arch: str = "hopper"
    """GPU architecture, for the kernels' rates and which kernel each side runs: "hopper" (H100, H200: sm90) or
    "ampere" (A100: sm80)."""

    @property
    def memory_budget_gb(self) -> float:
        """What a layout's estimated peak memory must fit in: gpu_memory_gb * usable_memory_fraction."""
        return self.gpu_memory_gb * self.usable_memory_fraction

    def __post_init__(self) -> None:
        _positive_int("cluster gpus_per_node", self.gpus_per_node)
        _positive_int("cluster nics_per_node", self.nics_per_node)
        for name in ("peak_tflops", "nvlink_gbps", "net_gbps_per_node", "gpu_memory_gb", "hbm_gbps"):
            _positive(f"cluster {name}", getattr(self, name))
        if (
            isinstance(self.step_latency_us, bool)
            or not isinstance(self.step_latency_us, (int, float))
            or not 0 <= self.step_latency_us < math.inf
        ):
            raise PlanError(f"cluster step_latency_us must be a finite number >= 0, got {self.step_latency_us!r}")
        if self.attn_efficiency is not None:
            _fraction("cluster attn_efficiency", self.attn_efficiency)
        if self.arch not in ARCHITECTURES:
            raise PlanError(f"cluster arch {self.arch!r} is not one of {list(ARCHITECTURES)}")
        _fraction("cluster dense_efficiency", self.dense_efficiency)
        _fraction("cluster usable_memory_fraction", self.usable_memory_fraction)
        if not isinstance(self.links, LinkEfficiency):
            raise PlanError(f"cluster links must be a LinkEfficiency, got {type(self.links).__name__}")

    @property
    def nic_gbps(self) -> float:
        """Bandwidth of one NIC (GB/s): the most one network flow gets."""
        return self.net_gbps_per_node / self.nics_per_node

    def kernel_efficiency(self, kernel: str) -> float:
        """The share of peak ``kernel`` reaches here: ``attn_efficiency`` when set, else the kernel's rate on
        ``arch`` (:func:`megatron_2d.plan.kernel_rates.kernel_rate`)."""
        if self.attn_efficiency is not None:
            return self.attn_efficiency
        return kernel_rate(self.arch, kernel).efficiency

    def with_(self, **changes) -> ClusterSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class ParallelSpec:
    """The job's parallel sizes. TP and PP (and usually DP) are fixed before the planner runs; CP is what it plans.

    Rank order is Megatron's default ``tp-cp-ep-dp-pp``: TP ranks are innermost, so the CP ranks of one group are
    TP apart and a group with its TP peers fills TP*CP consecutive ranks (consecutive ranks fill a node first).
    """

    gpus: int
    """World size."""
    tp: int = 1
    pp: int = 1
    cp: int | None = None
    """Context-parallel size CP (Megatron's context_parallel_size, hp x cp of a 2D layout); None means all GPUs
    left: gpus / (tp * pp * dp)."""
    dp: int | None = None
    """Data-parallel size; None means gpus / (tp * pp * cp) (or 1 when cp is None too)."""
    micro_batch: int = 1
    """B, sequences per micro-batch."""
    sequence_parallel: bool = True
    """Megatron's --sequence-parallel (it takes effect at TP > 1): the activations outside attention and the MLP
    (norm inputs and outputs, the checkpointed layer input) are split over TP too. On by default, as TP jobs run."""

    def __post_init__(self) -> None:
        _positive_int("gpus", self.gpus)
        _positive_int("tp", self.tp)
        _positive_int("pp", self.pp)
        _positive_int("micro_batch", self.micro_batch)
        if self.cp is not None:
            _positive_int("cp (context-parallel size)", self.cp)
        if self.dp is not None:
            _positive_int("dp", self.dp)
        fixed = self.tp * self.pp * (self.dp or 1)
        if self.gpus % fixed:
            raise PlanError(
                f"gpus={self.gpus} is not divisible by tp*pp*dp={self.tp}*{self.pp}*{self.dp or 1}"
                f"={fixed}; the GPUs left for CP must be a whole number"
            )
        if self.cp is not None:
            if self.dp is None and self.gpus % (self.tp * self.pp * self.cp):
                raise PlanError(
                    f"gpus={self.gpus} is not divisible by tp*pp*cp={self.tp}*{self.pp}*{self.cp}"
                    f"={self.tp * self.pp * self.cp}; valid CP sizes: "
                    f"{divisors(self.gpus // (self.tp * self.pp))}"
                )
            if self.dp is not None and self.tp * self.pp * self.cp * self.dp != self.gpus:
                raise PlanError(
                    f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = "
                    f"{self.tp * self.pp * self.cp * self.dp} != gpus={self.gpus}"
                )

    @property
    def cp_size(self) -> int:
        """CP, resolved."""
        if self.cp is not None:
            return self.cp
        return self.gpus // (self.tp * self.pp * (self.dp or 1))

    @property
    def dp_size(self) -> int:
        """DP, resolved."""
        return self.gpus // (self.tp * self.pp * self.cp_size)


# -- presets ----------------------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("7B-MHA", layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000),
        ModelSpec("7B-GQA", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=11008, vocab=32000),
        ModelSpec("8B-GQA", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256),
        ModelSpec("70B-GQA", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256),
        ModelSpec("7B-KV4", layers=28, hidden=3584, heads=28, kv_heads=4, ffn_hidden=18944, vocab=152064),
        ModelSpec(
            "DSV3-MLA",
            layers=61,
            hidden=7168,
            heads=128,
            kv_heads=128,
            ffn_hidden=18432,
            vocab=129280,
            mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_rope_dim=64, v_head_dim=128),
        ),
    )
}
"""7B-MHA / 7B-GQA: Llama-2-7B shapes with all 32 KV heads or 8. 8B-GQA and 70B-GQA: Llama-3 8B and 70B shapes
(8 KV heads; at TP=8 the 70B has one KV head per TP rank). 7B-KV4: Qwen2-7B shapes (28 query heads, 4 KV heads:
head parallelism is capped at 4 by the KV heads for stock a2a, and at 4 by 28's power-of-two divisors for all).
DSV3-MLA: DeepSeek-V3's attention exactly (61 layers, hidden 7168, 128 heads, MLA with q_lora_rank 1536,
kv_lora_rank 512, qk 128 + rope 64, v 128); its MoE MLP as the dense SwiGLU of the active experts (1 shared + 8
routed of 2048 = 18432), about its 37B active parameters (expert parallelism and the other experts' memory are not
modelled)."""

GRID_MODELS: dict[str, dict[str, int]] = {
    "8B-GQA": {"tp": 1, "pp": 1},
    "70B-GQA": {"tp": 8, "pp": 2},
    "7B-KV4": {"tp": 1, "pp": 1},
    "7B-MHA": {"tp": 1, "pp": 1},
}
"""The parallel sizes the grid (``python -m megatron_2d.plan grid``) fixes for each model: 70B-GQA at TP=8 (one KV
head per TP rank) with PP=2 so that its model states leave room for activations on 80 GB GPUs."""

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        # H100 SXM: the GPU figures of megatron_2d.layout.costs, 8 x 400 Gb/s NICs (field-and-peers.md).
        ClusterSpec(
            "8xH100",
            gpus_per_node=8,
            peak_tflops=H100.peak_tflops,
            attn_efficiency=None,
            nvlink_gbps=H100.nvlink_gbps,
            net_gbps_per_node=400.0,
            nics_per_node=8,
            gpu_memory_gb=80.0,
        ),
        # H200 SXM: the H100's compute and links, 141 GB HBM3e.
        ClusterSpec(
            "8xH200",
            gpus_per_node=8,
            peak_tflops=H100.peak_tflops,
            attn_efficiency=None,
            nvlink_gbps=H100.nvlink_gbps,
            net_gbps_per_node=400.0,
            nics_per_node=8,
            gpu_memory_gb=141.0,
            hbm_gbps=4800.0,
        ),
        # A100 SXM: 312 TFLOP/s bf16, NVLink 3 300 GB/s/direction, 8 x 200 Gb/s NICs; its kernels' rates in
        # kernel_rates (FlashAttention-2 reports 50-73% of peak on A100, 0.5 assumed for forward+backward).
        ClusterSpec(
            "8xA100",
            gpus_per_node=8,
            peak_tflops=312.0,
            attn_efficiency=None,
            arch="ampere",
            nvlink_gbps=300.0,
            net_gbps_per_node=200.0,
            nics_per_node=8,
            gpu_memory_gb=80.0,
            hbm_gbps=2039.0,
        ),
    )
}

PRESETS: dict[str, dict[str, object]] = {"models": MODEL_PRESETS, "clusters": CLUSTER_PRESETS}
"""Both preset tables: ``PRESETS["models"]["7B-GQA"]``, ``PRESETS["clusters"]["8xH100"]``."""


def _lookup(table: dict[str, object], kind: str, name: str):
    for key, value in table.items():
        if key.lower() == str(name).lower():
            return value
    raise PlanError(f"unknown {kind} preset {name!r}; known {kind} presets: {', '.join(table)}")


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive), or PlanError listing the known ones."""
    return _lookup(MODEL_PRESETS, "model", name)


def get_cluster(name: str) -> ClusterSpec:
    """The cluster preset ``name`` (case-insensitive), or PlanError listing the known ones."""
    return _lookup(CLUSTER_PRESETS, "cluster", name)
