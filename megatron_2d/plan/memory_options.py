"""Memory options as a planned dimension: how each side holds its model states, what that leaves in memory, and
what the sharding costs in communication.

Every option is a :class:`megatron_2d.layout.zero_sharding.HybridZeRO` choice (which states are sharded over how many of
the D = DP x CP ranks of Megatron's dp_cp group) and its bytes come from that module's ``state_bytes_per_rank``, the
function the library's own memory accounting uses (bf16 params, fp32 grads, Adam):

    side     option        HybridZeRO                                   Megatron flags
    stock    dist-opt      optimizer over D                             --use-distributed-optimizer
             fsdp-z2       optimizer+grads over D (megatron-fsdp)        --use-megatron-fsdp ... optim_grads
             fsdp-z3       optimizer+grads+params over D                 ... optim_grads_params
    2d       the above and hz-zN/S: ZeRO-N over S in {CP, ranks of the group on one node} below D: LoongTrain's
                           Hybrid ZeRO partial sharding (num_distributed_optimizer_instances = D/S)
             hz-z3/S+opt   optimizer+grads+params over S < D, optimizer over D: only with ``MemoryPolicy(choice=
                           "all")``, because megatron-core 0.19.2 then needs gradient clipping off (--clip-grad 0)

Stock Megatron users can pass the Hybrid ZeRO flags too (they are megatron-core's own); the stock side lists what
Megatron documents as its memory options. ``MemoryPolicy(fair=True)`` (``--fair-memory``) gives the stock kinds the
2D side's options and, hypothetically, Selective Checkpoint++, so that a plan shows what 2D gains by itself.

Communication (per micro-batch; m = micro-batches per optimizer step on each data-parallel rank, from the global
batch: ceil(global_batch_tokens / (seq x micro-batch x DP)); P, G = one layer's bf16 params
and fp32 grads on this rank, the embedding and output layer spread over the layers; AG/RS/AR = ring all-gather /
reduce-scatter / all-reduce of that many bytes over the shard group of S ranks, or across the D/S instances):

    option                    forward, per layer        backward, per layer
    optimizer (ZeRO-1)        AG(P)/m                   RS(G)/m + AR_out(G/S)/m
    optimizer+grads (ZeRO-2)  AG(P)/m                   RS(G) + AR_out(G/S)/m
    optimizer+grads+params    AG(P)                     AG(P) + RS(G) + AR_out(G/S)/m

(ZeRO-1's reduce-scatter of the gradients and all-gather of the updated params happen once per step, overlapped
with the last backward and the next forward; AR_out is the all-reduce of each shard across the D/S instances of
partial sharding, none when S = D.) Each phase's communication overlaps that phase's compute (Megatron's
overlap_grad_reduce / overlap_param_gather, megatron-fsdp's prefetch); what is left, and the compute slowed by the
links' interference while it runs, is added to the step: per layer
``overlapped(fwd compute, fwd comm) - fwd compute + overlapped(bwd compute, bwd comm) - bwd compute``.

A ring collective over n ranks, k of them on each node, moves (n - 1)/n of the buffer through every rank at
min(NVLink, k/gpus_per_node of the node's network) bandwidth, each with the links' all-to-all (collective) factor
(NCCL spreads the rings over the k ranks' NICs; every GPU of a node is in one such group at the same time); on one
node, at the NVLink rate. Shard groups are S consecutive dp_cp ranks (global ranks TP apart, Megatron's order
tp-cp-ep-dp-pp), instance groups D/S ranks TP x S apart.

Transient memory: megatron-fsdp's ZeRO-3 holds two gathered layers of bf16 params (the running one and the
prefetched one); ZeRO-2 and ZeRO-3 one layer of unsharded fp32 grads before its reduce-scatter.
"""

from __future__ import annotations

import dataclasses

from ..layout.choices import PlanKind, RecomputeMode
from ..layout.zero_sharding import HybridZeRO, state_bytes_per_rank
from .attention_time import BF16, FP32, GB
from .hardware import ClusterSpec, ModelSpec, ParallelSpec
from .job import CHOICES, MemoryPolicy
from .links import overlapped
from .model_states import MemoryOption, ShardingCost
from .step import Estimate

STATE_BYTES = {"param": BF16, "grad": FP32}
"""Bytes per element of the params and of the grad buffer the planner assumes (bf16 training, fp32 grads)."""
DIST_OPT = MemoryPolicy(choice="dist-opt")
"""Everyone the distributed optimizer over all dp x cp ranks (the planner before memory options)."""


def _zero(states: str, shard: int | None, opt_shard: int | None = None) -> HybridZeRO:
    return HybridZeRO(
        sharded_states=states, shard_size=shard, optimizer_shard_size=opt_shard, overlap_param_gather=True
    )


def stock_options(dp: int, cp: int) -> tuple[MemoryOption, ...]:
    """Megatron's own: the distributed optimizer, and megatron-fsdp's two sharding strategies over all D ranks."""
    out = [MemoryOption("dist-opt", _zero("optimizer", None), 0)]
    if dp * cp > 1:
        out += [
            MemoryOption("fsdp-z2", _zero("optimizer+grads", None), 4),
            MemoryOption("fsdp-z3", _zero("optimizer+grads+params", None), 8),
        ]
    return tuple(out)


def hybrid_zero_options(dp: int, cp: int, ranks_per_node: int, wider_optimizer: bool) -> tuple[MemoryOption, ...]:
    """LoongTrain's Hybrid ZeRO: Megatron's own options (over all D ranks) and each sharded_states over S in {CP,
    ranks of the group on one node} (1 < S < D, dividing D); ``wider_optimizer``: also ZeRO-3 over S < D with the
    optimizer states over all D."""
    D = dp * cp
    sizes = sorted({s for s in (cp, ranks_per_node) if 1 < s < D and D % s == 0}, reverse=True)
    out = list(stock_options(dp, cp))  # over all D ranks: Megatron's own options
    for stage, states in ((1, "optimizer"), (2, "optimizer+grads"), (3, "optimizer+grads+params")):
        out += [MemoryOption(f"hz-z{stage}/{s}", _zero(states, s), 4 * (stage - 1) + 1) for s in sizes]
    if wider_optimizer:
        out += [
            MemoryOption(f"hz-z3/{s}+opt/{D}", _zero("optimizer+grads+params", s, opt_shard=D), 11)
            for s in sizes
            if s < D
        ]
    return tuple(out)


def memory_options(
    kind: str, parallel: ParallelSpec, cluster: ClusterSpec, policy: MemoryPolicy, cp_size: int | None = None
) -> tuple[MemoryOption, ...]:
    """The options ``kind`` tries under ``policy`` (see the module docstring)."""
    dp, cp = parallel.dp_size, cp_size or parallel.cp_size
    if policy.choice == "dist-opt":
        return stock_options(dp, cp)[:1]
    if policy.choice != "stock" and (kind == PlanKind.TWO_D or policy.fair):
        ranks_per_node = max(1, cluster.gpus_per_node // parallel.tp)
        return hybrid_zero_options(dp, cp, ranks_per_node, policy.choice == "all")
    return stock_options(dp, cp)


# -- communication --------------------------------------------------------------------------------------------------


def collective_s(buffer_bytes: float, n: int, stride: int, cluster: ClusterSpec) -> float:
    """Seconds of a ring all-gather or reduce-scatter of a ``buffer_bytes`` buffer (the gathered size) over ``n``
    ranks whose global ranks are ``stride`` apart (see the module docstring)."""
    if n <= 1 or buffer_bytes <= 0:
        return 0.0
    per_node = max(1, min(n, cluster.gpus_per_node // stride)) if stride < cluster.gpus_per_node else 1
    nvl = cluster.nvlink_gbps * cluster.links.factor("nvlink", "a2a") * GB
    if n <= per_node:
        rate = nvl
    else:
        net = cluster.net_gbps_per_node * per_node / cluster.gpus_per_node * cluster.links.factor("network", "a2a")
        rate = min(nvl, net * GB) if per_node > 1 else net * GB
    return (n - 1) / n * buffer_bytes / rate


def collective_links(n: int, stride: int, cluster: ClusterSpec) -> str:
    """'nvlink', 'network' or 'mixed': the links a collective over ``n`` ranks ``stride`` apart uses ('-': none)."""
    if n <= 1:
        return "-"
    per_node = max(1, min(n, cluster.gpus_per_node // stride)) if stride < cluster.gpus_per_node else 1
    return "nvlink" if n <= per_node else ("network" if per_node == 1 else "mixed")


def sharding_cost(
    option: MemoryOption,
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    cp_size: int,
    fwd_compute_s: float,
    bwd_compute_s: float,
    accum_steps: int = 1,
) -> ShardingCost:
    """The memory parts and per-layer communication of ``option`` for a layout with ``cp_size`` (see the module
    docstring); ``fwd_compute_s`` / ``bwd_compute_s``: one layer's forward / backward compute it overlaps."""
    tp, dp = parallel.tp, parallel.dp_size
    D = dp * cp_size
    n_rank = -(-model.total_params() // (tp * parallel.pp))
    parts = state_bytes_per_rank(n_rank, option.zero, dp, cp_size, STATE_BYTES["param"], STATE_BYTES["grad"])
    z = option.zero
    S, stage, m = z.resolved_shard_size(dp, cp_size), option.zero_stage, accum_steps
    layer = model.layer_params() / tp
    gathered = (2 * layer * BF16 if stage == 3 else 0.0) + (layer * FP32 if stage >= 2 else 0.0)
    P, G = model.total_params() / (tp * model.layers) * BF16, model.total_params() / (tp * model.layers) * FP32
    ag, rs = collective_s(P, S, tp, cluster), collective_s(G, S, tp, cluster)
    outer = D // S  # instances of each shard (partial sharding; 1 when S = D)
    ar_out = 2 * collective_s(G / S, outer, tp * S, cluster)
    fwd = ag if stage == 3 else ag / m
    bwd = {1: rs / m, 2: rs, 3: ag + rs}[stage] + ar_out / m
    x = cluster.links.interference
    exposed = (overlapped(fwd_compute_s, fwd, x) - fwd_compute_s) + (overlapped(bwd_compute_s, bwd, x) - bwd_compute_s)

    def frac(n: int) -> float:  # the share of a collective over n ranks that crosses links
        return (n - 1) / n if n > 1 else 0.0

    per_mb_ag = (2 if stage == 3 else 1 / m) * frac(S) * P
    per_mb_rs = (1 if stage >= 2 else 1 / m) * frac(S) * G + 2 * frac(outer) * G / S / m
    return ShardingCost(
        option,
        float(parts["params"]),
        float(parts["grads"]),
        float(parts["optimizer"]),
        gathered,
        gather_bytes=per_mb_ag * model.layers,
        scatter_bytes=per_mb_rs * model.layers,
        fwd_comm_s=fwd,
        bwd_comm_s=bwd,
        exposed_s=exposed,
        links=collective_links(S, tp, cluster),
    )


def with_memory(
    e: Estimate,
    option: MemoryOption,
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    cp_size: int,
    accum_steps: int = 1,
) -> Estimate:
    """``e`` (recompute none) with its model states held as ``option``: memory parts from the option, its exposed
    sharding communication added to every layer of the step (MFU and tokens/s follow)."""
    if e.recompute != RecomputeMode.NONE:
        raise ValueError("with_memory takes an estimate without recompute (apply with_recompute after it)")
    fwd = e.attn_fwd_s + e.dense_layer_s / 3.0
    bwd = e.time_s - e.attn_fwd_s + 2.0 * e.dense_layer_s / 3.0
    cost = sharding_cost(option, model, cluster, parallel, cp_size, fwd, bwd, accum_steps)
    before = e.states.exposed_s if e.states is not None else 0.0
    step = e.step_s + e.layers * (cost.exposed_s - before)
    mem = dataclasses.replace(e.memory, model_states=cost.model_states, sharded_states=cost.sharded)
    return dataclasses.replace(
        e,
        memory=mem,
        states=cost,
        step_s=step,
        mfu=e.mfu * e.step_s / step,
        tokens_per_gpu_s=e.tokens_per_gpu_s * e.step_s / step,
        memory_gb=mem.total(RecomputeMode.NONE) / GB,
    )


def states_record(cost: ShardingCost | None) -> dict[str, object] | None:
    """The JSON form of a ShardingCost (GB, MB, ms), None for None."""
    if cost is None:
        return None
    return {
        "option": cost.option.label,
        "sharded_states": cost.option.zero.sharded_states,
        "params_gb": round(cost.params / GB, 3),
        "grads_gb": round(cost.grads / GB, 3),
        "optimizer_gb": round(cost.optimizer / GB, 3),
        "gathered_gb": round(cost.gathered / GB, 3),
        "all_gather_mb": round(cost.gather_bytes / 1e6, 2),
        "reduce_scatter_mb": round(cost.scatter_bytes / 1e6, 2),
        "exposed_ms_per_layer": round(cost.exposed_s * 1e3, 4),
        "links": cost.links,
    }


def describe(cost: ShardingCost, layers: int) -> str:
    """One line: the option, its state parts and its traffic."""
    return (
        f"{cost.option.label}: params {cost.params / GB:.1f} + grads {cost.grads / GB:.1f} + optimizer "
        f"{cost.optimizer / GB:.1f} + gathered {cost.gathered / GB:.1f} GB; per micro-batch all-gather "
        f"{cost.gather_bytes / GB:.2f} GB, reduce-scatter {cost.scatter_bytes / GB:.2f} GB on {cost.links}, "
        f"exposed {layers * cost.exposed_s * 1e3:.1f} ms"
    )


__all__ = [
    "CHOICES",
    "DIST_OPT",
    "MemoryOption",
    "MemoryPolicy",
    "ShardingCost",
    "collective_s",
    "hybrid_zero_options",
    "memory_options",
    "sharding_cost",
    "states_record",
    "stock_options",
    "with_memory",
]
