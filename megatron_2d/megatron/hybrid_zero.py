"""LoongTrain's Hybrid ZeRO as settings of megatron-core 0.19.2: which model states are sharded, over how many ranks.

Under context parallelism every weight is replicated over the CP ranks as well as the data-parallel ranks, so its
model states (parameters, gradients, optimizer states) can be sharded over all D = dp x cp ranks of Megatron's
``dp_cp`` group, or only over part of it. LoongTrain (arXiv 2406.18485) calls this Hybrid ZeRO and lets one pick
which states are sharded and how widely. megatron-core already implements every piece; this module
only validates a choice and writes it into megatron-core's own configs. It contains no sharding logic. The choice
and its byte counts live in the torch-free :mod:`megatron_2d.layout.zero_sharding` (re-exported here), which the planner
uses too.

Notation: ``cp`` in this module is Megatron's whole context-parallel size CP (context_parallel_size), not the
context-ring size cp = CP / hp of a 2D layout (:mod:`megatron_2d.layout.topology`); ``dp`` the data-parallel size.

What megatron-core does (read from its 0.19.2 source):

* ``DistributedDataParallel`` reduces gradients over ``dp_cp`` (``get_data_parallel_group(with_context_parallel=
  True)``), scaling by 1/(dp x cp) (or, with ``calculate_per_token_loss``, by 1/tokens in the global batch), so CP
  ranks are data-parallel replicas for the weights.
* ZeRO-1 is its distributed optimizer (``use_distributed_optimizer``): gradients are reduce-scattered and each rank
  keeps the Adam moments (and fp32 main params of 16-bit models) of 1/S of every bucket; updated params are
  all-gathered. Its param and grad buffers stay whole on every rank.
* Partial sharding is ``num_distributed_optimizer_instances`` = D / S, passed both to
  ``initialize_model_parallel`` (which cuts the dp_cp ranks into S-rank "intra" groups of consecutive dp_cp ranks)
  and to ``DistributedDataParallelConfig``: reduce-scatter inside the S-rank group, then all-reduce of the shard
  across the D/S instances. In Megatron's rank order (tp-cp-ep-dp-pp) CP is inside DP, so S = cp shards over
  exactly the CP group, S = dp x cp over everything.
* Sharding gradients and parameters too (ZeRO-2/3) is megatron-fsdp: ``use_megatron_fsdp`` with
  ``data_parallel_sharding_strategy`` 'optim' | 'optim_grads' | 'optim_grads_params'. With
  ``num_distributed_optimizer_instances`` > 1 it runs as HSDP: shards inside the S-rank group, replicas across
  groups; ``outer_dp_sharding_strategy='optim'`` additionally shards the optimizer state over all D ranks while
  params/grads stay sharded over S (only with 'optim_grads_params'): LoongTrain's "optimizer states sharded more
  widely than parameters and gradients". megatron-core 0.19.2 then reduces the gradient norm over S ranks only,
  so gradient clipping is refused for that choice (:func:`optimizer_config`).

Seen on 8 CPU ranks (tests/test_hybrid_zero.py, DP=2 x CP=4 with 2D attention): every choice below trains a tiny
GPT to the losses and gradient norms of unsharded training within 1e-5, and each rank holds 1/S of the sharded
state up to Megatron's padding. Overlap of communication with compute is not exercised there (CPU, gloo).

    hz = HybridZeRO(sharded_states="optimizer", shard_size=4)           # ZeRO-1 over each CP group of 4
    initialize_model_parallel(..., **hz.initialize_model_parallel_kwargs(dp=2, cp=4))
    ddp_model = DistributedDataParallel(config, distributed_data_parallel_config(hz, dp=2, cp=4), model)
    optimizer = get_megatron_optimizer(optimizer_config(hz, dp=2, cp=4, lr=1e-4), [ddp_model])
    # megatron-fsdp choices: FullyShardedDataParallel(config, ddp_config, model) instead (hz.backend says which)
    hz.megatron_cli_args(dp=2, cp=4)   # the same choice as Megatron-LM flags
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout.zero_sharding import (  # noqa: F401 (re-exported)
    IMPLEMENTATIONS,
    OPTIMIZERS,
    SHARDED_STATES,
    HybridZeRO,
    distributed_optimizer_padding_bound,
    state_bytes_per_rank,
)


def model_state_bytes_per_rank(
    num_params: int,
    hybrid_zero: HybridZeRO,
    dp: int,
    cp: int,
    param_dtype: torch.dtype = torch.bfloat16,
    grad_dtype: torch.dtype = torch.float32,
    optimizer: str = "adam",
) -> dict[str, int]:
    """Persistent bytes of model state one rank holds, as megatron-core keeps them: {params, grads, optimizer}.

    :func:`megatron_2d.layout.zero_sharding.state_bytes_per_rank` (its docstring has the table) with the bytes per
    element of ``param_dtype`` and ``grad_dtype``; the planner calls the same function with byte counts."""
    return state_bytes_per_rank(
        num_params,
        hybrid_zero,
        dp,
        cp,
        param_bytes=torch.empty((), dtype=param_dtype).element_size(),
        grad_bytes=torch.empty((), dtype=grad_dtype).element_size(),
        optimizer=optimizer,
    )


def distributed_data_parallel_config(hybrid_zero: HybridZeRO, dp: int, cp: int, **extra: Any):
    """A megatron-core ``DistributedDataParallelConfig`` with this choice; ``extra`` sets its other fields (e.g.
    ``grad_reduce_in_fp32``). A conflicting extra field is refused."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**_merge(hybrid_zero.ddp_config_kwargs(dp, cp), extra, "DDP config"))


def optimizer_config(hybrid_zero: HybridZeRO, dp: int, cp: int, **extra: Any):
    """A megatron-core ``OptimizerConfig`` with this choice; ``extra`` sets the rest (lr, optimizer, bf16, ...).

    With ``optimizer_shard_size`` wider than ``shard_size`` gradient clipping is refused: megatron-core 0.19.2
    reduces the gradient norm of megatron-fsdp over one optimizer instance (``shard_size`` ranks per TP/PP
    slot) while outer 'optim' spreads the gradient shards over all dp x cp ranks, so the norm misses
    (D - S)/D of the squared gradient (seen on CPU ranks: 0.70 instead of 0.97) and clipping would scale by a
    wrong factor. Pass ``clip_grad=0.0``.
    """
    from megatron.core.optimizer import OptimizerConfig

    kwargs = _merge(hybrid_zero.optimizer_config_kwargs(dp, cp), extra, "optimizer config")
    clip = kwargs.get("clip_grad", OptimizerConfig.clip_grad)
    if hybrid_zero.has_wider_optimizer_shard(dp, cp) and clip > 0:
        raise ValueError(
            f"clip_grad {clip} is not supported with optimizer_shard_size "
            f"{hybrid_zero.resolved_optimizer_shard_size(dp, cp)} > shard_size "
            f"{hybrid_zero.resolved_shard_size(dp, cp)}: "
            f"megatron-core 0.19.2 computes the gradient norm over one optimizer instance only, so clipping "
            f"would use a wrong norm; pass clip_grad=0.0 (OptimizerConfig defaults to 1.0; the launch checks refuse "
            f"--clip-grad with --outer-dp-sharding-strategy optim before this)"
        )
    return OptimizerConfig(**kwargs)


def _merge(base: dict[str, Any], extra: dict[str, Any], what: str) -> dict[str, Any]:
    clashes = {k: (base[k], v) for k, v in extra.items() if k in base and base[k] != v}
    if clashes:
        raise ValueError(
            f"{what}: these fields are set by HybridZeRO and conflict with the extra values "
            f"(HybridZeRO value, extra value): {clashes}"
        )
    return {**base, **extra}


__all__ = [
    "HybridZeRO",
    "IMPLEMENTATIONS",
    "SHARDED_STATES",
    "distributed_data_parallel_config",
    "distributed_optimizer_padding_bound",
    "model_state_bytes_per_rank",
    "optimizer_config",
]
