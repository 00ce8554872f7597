"""The benchmarks on an emulated multi-node cluster: presets from real clusters scaled to this CPU, the flags every
benchmark takes, and the cluster's measured figures (link rates, all-to-alls, latency) for the planner.

    python tools/bench_compare.py --ranks 8 --cluster dgx-h100 --nodes 2 --gpu-seq 65536   # a preset, scaled
    python tools/bench_compare.py --ranks 8 --nodes 2 --net-mbit 50 --nvl-mbit 450         # rates by hand
    python tools/emulated_cluster.py measure --ranks 8 --nodes 2 --cluster dgx-h100        # the figures alone

The cluster (:mod:`megatron_2d_dev.emulated_cluster`): --nodes nodes of N / nodes ranks, a NIC per rank (or
the preset's NICs per node, scaled to the ranks per node) and a node link per rank, each shaped by tc tbf.

Scaling a preset. What decides a ring step's overlap is its communication / compute ratio,
``(bytes / link rate) / (FLOPs / attention rate)``. For the same attention shape at the GPU job's length S_g
(``--gpu-seq``, default the benchmark's S) the bytes grow as S and the FLOPs as S^2, so the emulation has the GPU
cluster's ratio when each link runs at

    emulated rate = GPU link rate x (R_cpu / R_gpu) x (S_g / S)

R_gpu the GPU's attention rate as the planner prices it (peak x the selected kernel's efficiency,
megatron_2d.plan.kernel_rates), R_cpu this machine's: the CPU kernel's fwd+bwd FLOP/s per rank measured with N
ranks running at once on the cores (planner FLOPs: 3.5 x forward, causal halved). Link rates are the preset's
nominal ones (NVLink per GPU, one NIC), so their ratio stays the preset's (DGX H100 9:1). The cluster's figures,
measured once it is up (:func:`measure_links`: ring sends inside a node and between nodes with every rank sending,
all-to-alls inside a node and over all ranks, a small ring step's latency), make it the planner's cluster
(:func:`emulated_cluster_spec`): gpus_per_node = ranks per node, nvlink / network rates = the shaped rates, link
factors = measured / shaped, peak = R_cpu (attention efficiency 1), HBM = this CPU's copy rate per rank, latency
as measured. gloo's all-to-all has its own efficiency there (it is not NCCL's), fitted from the all-to-alls.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_2d.kernels import select_kernel
from megatron_2d.layout.band import Band
from megatron_2d.plan import ClusterSpec, LinkEfficiency, get_cluster
from megatron_2d.plan.attention_time import BWD_FACTOR, GB, class_time, flow_gbps
from megatron_2d.plan.kernel_rates import SELECTED_KERNEL
from megatron_2d.plan.link_classes import LinkClass
from megatron_2d.testing.distributed import run_on_ranks

from ..emulated_cluster import ClusterShape, EmulatedCluster
from .harness import measure_copy_bandwidth

GPU_PRESETS: dict[str, ClusterSpec] = {
    "dgx-h100": get_cluster("8xH100"),
    "a100-4nic": get_cluster("8xA100").with_(name="8xA100, 4 NICs", net_gbps_per_node=100.0, nics_per_node=4),
}
"""--cluster: 8 x H100 SXM per node (NVLink 4 450 GB/s per GPU, 8 x 400 Gb/s NICs: the planner's 8xH100), and 8
x A100 SXM (NVLink 3 300 GB/s) with 4 x 200 Gb/s NICs per node (the planner's 8xA100 has 8; the NICs here are
shared by two GPUs each)."""


def add_cluster_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The emulated cluster's flags (none given: the flat network, every rank on loopback)."""
    g = parser.add_argument_group("emulated cluster (network namespaces; root only)")
    g.add_argument("--cluster", choices=sorted(GPU_PRESETS), help="a GPU cluster preset, rates scaled to this CPU")
    g.add_argument("--nodes", type=int, default=2, help="nodes of the emulated cluster (ranks / nodes each)")
    g.add_argument("--net-mbit", type=float, help="one NIC's rate by hand, Mbit/s (instead of a preset's)")
    g.add_argument("--nvl-mbit", type=float, help="one rank's node link by hand, Mbit/s (default 9 x --net-mbit)")
    g.add_argument("--nics-per-node", type=int, help="NICs per node (default: the preset's, scaled; else one a rank)")
    g.add_argument("--gpu-seq", type=int, help="the GPU job's sequence length the rates are scaled for (default --seq)")
    g.add_argument("--burst-kib", type=int, default=16, help="tbf bucket (default 16 KiB)")
    g.add_argument("--keep", action="store_true", help="leave the cluster up (tools/emulated_cluster.py down)")
    return parser


def on_cluster(args) -> bool:
    return bool(getattr(args, "cluster", None) or getattr(args, "net_mbit", None))


# -- the CPU kernel's rate --------------------------------------------------------------------------------------


def block_flops(tokens: int, batch: int, heads: int, dim: int) -> float:
    """Planner FLOPs of one causal block's fwd+bwd: 3.5 x (4 b T^2 hq d / 2)."""
    return (1.0 + BWD_FACTOR) * 2.0 * batch * tokens * tokens * heads * dim


@dataclass(frozen=True)
class Job:
    """The attention shape a benchmark runs (what the kernel's rate and the scaling are measured on)."""

    seq: int
    batch: int
    heads: int
    kv_heads: int
    dim: int

    @classmethod
    def of(cls, args) -> Job:
        """From a benchmark's flags: --seq (bench_packed: --tokens), --batch (1), --heads, --kv-heads (= heads)."""
        seq = getattr(args, "seq", None) or args.tokens
        heads = args.heads
        kv_heads = getattr(args, "kv_heads", None) or heads
        if heads % kv_heads:
            raise SystemExit(f"--kv-heads {kv_heads} must divide --heads {heads}")
        return cls(seq, getattr(args, "batch", 1), heads, kv_heads, args.dim)


def _kernel_seconds(rank, world, args, dtype, repeats):
    kernel = select_kernel(torch.device("cpu"), dtype)
    tokens = args.seq // world  # the rank's share, one ring step's worth of causal work
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(args.batch, tokens, args.heads, args.dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(args.batch, tokens, args.kv_heads, args.dim, generator=g).to(dtype) for _ in range(2))
    band, scale, times = Band(None, 0), args.dim**-0.5, []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        out, lse = kernel.forward(q, k, v, band, scale)
        kernel.backward(dout, q, k, v, out, lse, band, scale)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_kernel_rate(args: Job, world: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """R_cpu: FLOP/s per rank of the CPU kernel's fwd+bwd on each rank's S/N causal block, ``world`` forked ranks
    at once on this machine's cores (the slowest rank's median)."""
    seconds = max(run_on_ranks(world, _kernel_seconds, args, dtype, repeats, timeout_s=600))
    return block_flops(args.seq // world, args.batch, args.heads, args.dim) / seconds


def gpu_attention_flops(gpu: ClusterSpec) -> float:
    """R_gpu: the planner's attention rate on the preset (peak x the kernel the op selects there)."""
    return gpu.peak_tflops * 1e12 * gpu.kernel_efficiency(SELECTED_KERNEL[gpu.arch])


# -- the shape --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scaling:
    """How a preset's rates became the emulated ones (see the module docstring)."""

    gpu: ClusterSpec
    cpu_flops: float
    seq: int
    gpu_seq: int

    @property
    def factor(self) -> float:
        """emulated / GPU rate = (R_cpu / R_gpu) x (S_g / S)."""
        return self.cpu_flops / gpu_attention_flops(self.gpu) * self.gpu_seq / self.seq

    def nic_mbit(self) -> float:
        return self.gpu.nic_gbps * GB * 8 / 1e6 * self.factor

    def nvl_mbit(self) -> float:
        return self.gpu.nvlink_gbps * GB * 8 / 1e6 * self.factor

    def describe(self) -> str:
        return (
            f"{self.gpu.name} scaled by {self.factor:.3g} = R_cpu {self.cpu_flops / 1e9:.2f} GFLOP/s per rank / "
            f"R_gpu {gpu_attention_flops(self.gpu) / 1e12:.0f} TFLOP/s x S_g {self.gpu_seq} / S {self.seq}: "
            f"a ring step's comm/compute equals the GPU cluster's at S = {self.gpu_seq}"
        )


def equivalent_gpu_seq(gpu: ClusterSpec, nic_mbit: float, cpu_flops: float, seq: int) -> float:
    """The GPU job length at which ``gpu``'s ring steps have the comm/compute of a NIC at ``nic_mbit`` here."""
    return seq * (nic_mbit * 1e6 / 8) / (gpu.nic_gbps * GB) * gpu_attention_flops(gpu) / cpu_flops


def cluster_shape(args, world: int, cpu_flops: float | None) -> tuple[ClusterShape, Scaling | None]:
    """The emulated cluster the flags ask for (``cpu_flops`` needed for a preset); ``args.seq``: the job's."""
    nodes = args.nodes
    if nodes < 1 or world % nodes:
        raise SystemExit(f"--nodes {nodes} must divide the ranks ({world})")
    per_node = world // nodes
    if args.net_mbit:
        nvl = args.nvl_mbit or 9 * args.net_mbit
        return ClusterShape(nodes, per_node, args.net_mbit, nvl, args.nics_per_node, args.burst_kib), None
    gpu = GPU_PRESETS[args.cluster]
    scaling = Scaling(gpu, cpu_flops, args.seq, args.gpu_seq or args.seq)
    nics = args.nics_per_node or max(1, gpu.nics_per_node * per_node // gpu.gpus_per_node)
    return ClusterShape(nodes, per_node, scaling.nic_mbit(), scaling.nvl_mbit(), nics, args.burst_kib), scaling


# -- the cluster's figures --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFigures:
    """Measured on the built cluster with gloo, every rank at once (seconds, messages of ``nbytes`` per peer)."""

    nbytes: int
    intra_ring_s: float
    """A ring step inside each node (every rank sends to its node's next rank)."""
    inter_ring_s: float
    """A ring step between nodes (every rank sends to the same local rank of the next node)."""
    node_a2a_s: float
    """An all-to-all over each node's ranks."""
    world_a2a_s: float
    """An all-to-all over every rank."""
    latency_s: float
    """One ring step of 4 bytes between nodes."""


def _ring_step(send, recv, dst, src, group=None):
    ops = [dist.P2POp(dist.irecv, recv, src, group), dist.P2POp(dist.isend, send, dst, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _timed(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _link_rank(rank, world, per_node, nbytes, repeats):
    node, local = divmod(rank, per_node)
    nodes = world // per_node
    block = torch.zeros(nbytes // 4)
    recv = torch.empty_like(block)
    node_groups = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
    intra = (
        _timed(
            lambda: _ring_step(
                block, recv, node * per_node + (local + 1) % per_node, node * per_node + (local - 1) % per_node
            ),
            repeats,
        )
        if per_node > 1
        else math.nan
    )
    inter = (
        _timed(
            lambda: _ring_step(
                block, recv, ((node + 1) % nodes) * per_node + local, ((node - 1) % nodes) * per_node + local
            ),
            repeats,
        )
        if nodes > 1
        else math.nan
    )
    a2a_node = torch.zeros(per_node * nbytes // 4)
    node_a2a = (
        _timed(lambda: dist.all_to_all_single(torch.empty_like(a2a_node), a2a_node, group=node_groups[node]), repeats)
        if per_node > 1
        else math.nan
    )
    a2a_world = torch.zeros(world * nbytes // 4)
    world_a2a = _timed(lambda: dist.all_to_all_single(torch.empty_like(a2a_world), a2a_world), repeats)
    tiny, tiny_recv = torch.zeros(1), torch.empty(1)
    peer = ((node + 1) % nodes) * per_node + local if nodes > 1 else (rank + 1) % world
    back = ((node - 1) % nodes) * per_node + local if nodes > 1 else (rank - 1) % world
    steps = 20
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        _ring_step(tiny, tiny_recv, peer, back)
    latency = (time.perf_counter() - t0) / steps
    return intra, inter, node_a2a, world_a2a, latency


def measure_links(cluster: EmulatedCluster, nbytes: int = 256 << 10, repeats: int = 3) -> LinkFigures:
    """:class:`LinkFigures` of ``cluster`` (forked ranks in its namespaces; the slowest rank's medians)."""
    from ..cluster_launch import run_on_cluster

    shape = cluster.shape
    per_rank = run_on_cluster(cluster, _link_rank, shape.ranks_per_node, nbytes, repeats, timeout_s=600)
    worst = [max(values) for values in zip(*per_rank)]
    return LinkFigures(nbytes, *worst)


def emulated_cluster_spec(shape: ClusterShape, figures: LinkFigures, cpu_flops: float, copy_bytes_per_s: float):
    """The emulated cluster as the planner's :class:`ClusterSpec` (module docstring), and the measured link
    factors by name (for the report)."""
    nominal = ClusterSpec(
        f"emulated {shape.nodes}x{shape.ranks_per_node}",
        gpus_per_node=shape.ranks_per_node,
        peak_tflops=cpu_flops / 1e12,
        attn_efficiency=1.0,
        nvlink_gbps=shape.nvl_mbit * 1e6 / 8 / GB,
        net_gbps_per_node=shape.nic_mbit * shape.nics * 1e6 / 8 / GB,
        nics_per_node=shape.nics,
        hbm_gbps=copy_bytes_per_s / GB,
        step_latency_us=figures.latency_s * 1e6,
        gpu_memory_gb=1e3,
        links=LinkEfficiency(1.0, 1.0, 1.0, 1.0, 0.0),
    )
    b, g, n = figures.nbytes, shape.ranks_per_node, shape.world
    factors = {}
    if g > 1:
        factors["nvlink_p2p"] = b / (nominal.nvlink_gbps * GB) / figures.intra_ring_s
        factors["nvlink_a2a"] = class_time(LinkClass(g - 1, 0, 0), b, nominal, "a2a") / figures.node_a2a_s
    if shape.nodes > 1:
        factors["network_p2p"] = b / (flow_gbps(nominal, g) * GB) / figures.inter_ring_s
        # the all-to-all over every rank: its node part at the fitted NVLink factor, the rest is the network's
        intra_s = (g - 1) * b / (nominal.nvlink_gbps * GB * factors.get("nvlink_a2a", 1.0))
        inter_s = (n - g) * b / (flow_gbps(nominal, g) * GB)
        factors["network_a2a"] = inter_s / max(figures.world_a2a_s, intra_s)
    factors = {k: min(1.0, v) for k, v in factors.items()}
    return nominal.with_(links=LinkEfficiency(**{**_IDEAL, **factors})), factors


_IDEAL = {"nvlink_p2p": 1.0, "nvlink_a2a": 1.0, "network_p2p": 1.0, "network_a2a": 1.0, "interference": 0.0}


# -- the benchmarks' cluster ------------------------------------------------------------------------------------


@dataclass
class BenchCluster:
    """A built cluster with what was measured on it: the flags' shape, the scaling (presets), the CPU kernel's
    rate, the links' figures and the planner's view of it."""

    cluster: EmulatedCluster
    cpu_flops: float
    scaling: Scaling | None
    figures: LinkFigures
    spec: ClusterSpec
    seq: int
    """The benchmark's sequence length."""
    factors: dict[str, float] = field(default_factory=dict)

    @property
    def shape(self) -> ClusterShape:
        return self.cluster.shape

    def rank_setup(self, rank: int) -> None:
        self.cluster.enter_rank(rank)

    def describe(self) -> list[str]:
        f = self.figures
        lines = [f"emulated cluster: {self.shape.describe()}"]
        if self.scaling is not None:
            lines.append(f"  rates: {self.scaling.describe()}")
        else:
            lines.append(
                f"  rates by hand; R_cpu {self.cpu_flops / 1e9:.2f} GFLOP/s per rank: the NIC's comm/compute is an "
                + ", ".join(
                    f"{gpu.name}'s at S = {equivalent_gpu_seq(gpu, self.shape.nic_mbit, self.cpu_flops, self.seq):.0f}"
                    for gpu in GPU_PRESETS.values()
                )
            )
        lines.append(
            f"  measured ({f.nbytes >> 10} KiB messages, every rank at once): ring step in a node "
            f"{f.intra_ring_s * 1e3:.1f} ms, between nodes {f.inter_ring_s * 1e3:.1f} ms; all-to-all in a node "
            f"{f.node_a2a_s * 1e3:.1f} ms, over all ranks {f.world_a2a_s * 1e3:.1f} ms; latency "
            f"{f.latency_s * 1e3:.2f} ms; link factors (measured / shaped) "
            + ", ".join(f"{k} {v:.2f}" for k, v in self.factors.items())
        )
        lines += [f"  warning: {w}" for w in self.shape.warnings()]
        return lines

    def to_dict(self) -> dict[str, object]:
        s = self.shape
        return {
            "nodes": s.nodes,
            "ranks_per_node": s.ranks_per_node,
            "nic_mbit": s.nic_mbit,
            "nvl_mbit": s.nvl_mbit,
            "nics_per_node": s.nics,
            "burst_kib": s.burst_kib,
            "preset": self.scaling.gpu.name if self.scaling else None,
            "scale_factor": self.scaling.factor if self.scaling else None,
            "gpu_seq": self.scaling.gpu_seq if self.scaling else None,
            "cpu_flops_per_rank": self.cpu_flops,
            "figures": self.figures.__dict__,
            "link_factors": self.factors,
        }


@contextlib.contextmanager
def bench_cluster(args, world: int, dtype: torch.dtype) -> Iterator[BenchCluster | None]:
    """Build the cluster the flags ask for (None: the flat network), measure it, and tear it down afterwards."""
    if not on_cluster(args):
        yield None
        return
    if getattr(args, "device", "cpu") != "cpu":
        raise SystemExit("the emulated cluster runs CPU ranks: --device cpu")
    from ..netns import namespaces_problem

    problem = namespaces_problem()
    if problem:
        raise SystemExit(f"the emulated cluster cannot be built here: {problem}")
    job = Job.of(args)
    print(f"measuring the CPU kernel's rate with {world} ranks at once ...", file=sys.stderr)
    cpu_flops = measure_kernel_rate(job, world, dtype)
    shape, scaling = cluster_shape(argparse.Namespace(**{**vars(args), "seq": job.seq}), world, cpu_flops)
    copy = measure_copy_bandwidth() * min(world, os.cpu_count() or 1) / world
    with EmulatedCluster(shape, keep=args.keep) as cluster:
        print(f"measuring the links of {shape.describe()} ...", file=sys.stderr)
        figures = measure_links(cluster)
        spec, factors = emulated_cluster_spec(shape, figures, cpu_flops, copy)
        bc = BenchCluster(cluster, cpu_flops, scaling, figures, spec, job.seq, factors)
        for line in bc.describe():
            print(line)
        yield bc
        if args.keep:
            print(f"kept: namespaces {cluster.owner.tag}-*; remove with python tools/emulated_cluster.py down")
