"""Hybrid ZeRO choices and the bytes they leave on each rank: pure Python (no torch), so that the megatron-core
integration (:mod:`megatron_2d.megatron.hybrid_zero`, which re-exports everything here) and the planner
(:mod:`megatron_2d.plan.memory_options`) share one definition and cannot disagree.

A choice (:class:`HybridZeRO`) says which model states are sharded over the D = dp x cp ranks of Megatron's
``dp_cp`` group and over how many of them; its methods give the fields of megatron-core's own configs (which
:mod:`megatron_2d.megatron.hybrid_zero` builds) or the Megatron-LM flags. :func:`state_bytes_per_rank` is the
persistent model state a rank holds under a choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .topology import divisors

SHARDED_STATES = ("none", "optimizer", "optimizer+grads", "optimizer+grads+params")
IMPLEMENTATIONS = ("auto", "distributed_optimizer", "megatron_fsdp")
OPTIMIZERS = ("adam", "sgd")

# sharded_states -> megatron-fsdp data_parallel_sharding_strategy
_FSDP_STRATEGY = {
    "none": "no_shard",
    "optimizer": "optim",
    "optimizer+grads": "optim_grads",
    "optimizer+grads+params": "optim_grads_params",
}
# bytes per element of the optimizer's own state tensors (kept in fp32 by Megatron): Adam m and v; SGD momentum
_STATE_BYTES = {"adam": 8, "sgd": 4}
_FP32_BYTES = 4


@dataclass(frozen=True)
class HybridZeRO:
    """Which model states are sharded over the dp x cp ranks, and over how many (see
    :mod:`megatron_2d.megatron.hybrid_zero` for what megatron-core does with each choice).

    Construction checks the fields on their own; every method taking ``dp, cp`` (the data-parallel and
    context-parallel sizes of the job) first checks them against D = dp x cp and raises ValueError naming the
    values and the valid choices.
    """

    sharded_states: str = "optimizer"
    """'none': every rank keeps every state (Megatron DDP, plain optimizer).
    'optimizer': ZeRO-1, Adam moments and fp32 main params sharded (Megatron's distributed optimizer).
    'optimizer+grads': ZeRO-2, gradients sharded too (megatron-fsdp 'optim_grads').
    'optimizer+grads+params': ZeRO-3, parameters sharded too, gathered per layer (megatron-fsdp
    'optim_grads_params')."""

    shard_size: int | None = None
    """Number of ranks the sharded states are split over; must divide D = dp x cp. None: all D ranks. Smaller values
    are partial sharding: D / shard_size replicas of each shard (megatron-core's
    ``num_distributed_optimizer_instances``), each shard group being shard_size consecutive dp_cp ranks, so
    shard_size = cp shards over the CP group alone."""

    optimizer_shard_size: int | None = None
    """Ranks the optimizer states are split over, when wider than ``shard_size``. None: the same as shard_size.
    megatron-core offers only D here (megatron-fsdp ``outer_dp_sharding_strategy='optim'``), and only for
    'optimizer+grads+params' with shard_size < D. Gradient clipping must then be off (see ``optimizer_config``)."""

    implementation: str = "auto"
    """'auto': 'none' and 'optimizer' use Megatron's DDP (+ distributed optimizer), the others megatron-fsdp.
    'distributed_optimizer': Megatron's DDP; only 'none' and 'optimizer'.
    'megatron_fsdp': megatron-fsdp for every choice ('optimizer' becomes its 'optim' strategy)."""

    overlap_grad_reduce: bool = True
    """Overlap the gradient reduce(-scatter) with the backward pass (megatron-core ``overlap_grad_reduce``).
    megatron-fsdp's 'optim' strategy requires it: without it 0.19.2 reduces the last micro-batch's gradients twice
    under Megatron's schedule (seen on CPU ranks: two reduce-scatters per step, losses off by 6e-5)."""

    overlap_param_gather: bool = False
    """Overlap the all-gather of updated/sharded parameters with the next forward (megatron-core
    ``overlap_param_gather``); needs ``overlap_grad_reduce`` and some sharding."""

    def __post_init__(self) -> None:
        if self.sharded_states not in SHARDED_STATES:
            raise ValueError(
                f"sharded_states {self.sharded_states!r} is not valid; choose one of {list(SHARDED_STATES)}"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation {self.implementation!r} is not valid; choose one of {list(IMPLEMENTATIONS)}"
            )
        for name in ("shard_size", "optimizer_shard_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} {value!r} must be a positive integer (or None for all dp x cp ranks)")
        if self.sharded_states == "none" and (self.shard_size, self.optimizer_shard_size) != (None, None):
            raise ValueError(
                f"sharded_states 'none' shards nothing, so shard_size {self.shard_size} / "
                f"optimizer_shard_size {self.optimizer_shard_size} mean nothing; leave them None or "
                f"choose one of {list(SHARDED_STATES[1:])}"
            )
        if self.backend == "distributed_optimizer" and self.sharded_states not in ("none", "optimizer"):
            raise ValueError(
                f"sharded_states {self.sharded_states!r} is not supported by implementation 'distributed_optimizer': "
                f"Megatron's distributed optimizer shards only optimizer states (its param and grad buffers stay "
                f"whole on every rank); use implementation 'megatron_fsdp' or 'auto' for gradient/parameter sharding"
            )
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather=True needs overlap_grad_reduce=True (megatron-core requires both)")
        if self.overlap_param_gather and self.sharded_states == "none":
            raise ValueError(
                "overlap_param_gather=True needs sharded states (nothing is gathered with sharded_states 'none')"
            )
        if self.backend == "megatron_fsdp" and self.sharded_states == "optimizer" and not self.overlap_grad_reduce:
            raise ValueError(
                "megatron-fsdp's 'optim' strategy (sharded_states 'optimizer', implementation 'megatron_fsdp') needs "
                "overlap_grad_reduce=True: with False, megatron-core 0.19.2 reduces the last micro-batch's gradients "
                "twice; use implementation 'distributed_optimizer' to run without overlap"
            )

    # ---- derived choices ----------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """'distributed_optimizer' (Megatron DDP) or 'megatron_fsdp', after resolving 'auto'."""
        if self.implementation != "auto":
            return self.implementation
        return "distributed_optimizer" if self.sharded_states in ("none", "optimizer") else "megatron_fsdp"

    def validate(self, dp: int, cp: int) -> None:
        """Check the sizes against D = dp x cp; raise ValueError naming the values and the valid choices."""
        for name, value in (("dp", dp), ("cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        total = dp * cp
        valid = divisors(total)[1:]
        if self.shard_size is not None and (total % self.shard_size or self.shard_size == 1):
            reason = (
                "shards nothing; use sharded_states 'none'"
                if self.shard_size == 1
                else f"does not divide dp x cp = {dp} x {cp} = {total}"
            )
            raise ValueError(f"shard_size {self.shard_size} {reason}; valid shard sizes: {valid}")
        shard = self.resolved_shard_size(dp, cp)
        opt = self.optimizer_shard_size
        if opt is None or opt == shard:
            return
        if opt != total:
            raise ValueError(
                f"optimizer_shard_size {opt} is not available: megatron-core shards optimizer states "
                f"over shard_size ({shard}) or over all dp x cp = {dp} x {cp} = {total} ranks; valid "
                f"optimizer shard sizes: {sorted({shard, total})}"
            )
        if self.sharded_states != "optimizer+grads+params" or self.backend != "megatron_fsdp":
            raise ValueError(
                f"optimizer_shard_size {opt} wider than shard_size {shard} needs sharded_states "
                f"'optimizer+grads+params' on megatron-fsdp (outer_dp_sharding_strategy 'optim'); "
                f"got sharded_states {self.sharded_states!r}, implementation {self.backend!r}"
            )

    def resolved_shard_size(self, dp: int, cp: int) -> int:
        """Ranks the sharded parameters/gradients (or, for 'optimizer', optimizer states) are split over; 1 if none."""
        if self.sharded_states == "none":
            return 1
        return self.shard_size if self.shard_size is not None else dp * cp

    def resolved_optimizer_shard_size(self, dp: int, cp: int) -> int:
        """Ranks the optimizer states are split over."""
        self.validate(dp, cp)
        return self.optimizer_shard_size or self.resolved_shard_size(dp, cp)

    def num_distributed_optimizer_instances(self, dp: int, cp: int) -> int:
        """megatron-core's ``num_distributed_optimizer_instances``: D / shard_size (1 when unsharded)."""
        self.validate(dp, cp)
        if self.sharded_states == "none":
            return 1
        return dp * cp // self.resolved_shard_size(dp, cp)

    # ---- megatron-core configs ----------------------------------------------------------------------------------
    def initialize_model_parallel_kwargs(self, dp: int, cp: int) -> dict[str, Any]:
        """Keyword arguments for ``parallel_state.initialize_model_parallel`` (it builds the shard groups)."""
        return {"num_distributed_optimizer_instances": self.num_distributed_optimizer_instances(dp, cp)}

    def ddp_config_kwargs(self, dp: int, cp: int) -> dict[str, Any]:
        """Fields of megatron-core's ``DistributedDataParallelConfig`` that express this choice."""
        instances = self.num_distributed_optimizer_instances(dp, cp)
        kwargs: dict[str, Any] = {
            "use_distributed_optimizer": self.sharded_states != "none" or self.backend == "megatron_fsdp",
            "num_distributed_optimizer_instances": instances,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
        }
        if self.backend == "megatron_fsdp":
            kwargs["use_megatron_fsdp"] = True
            kwargs["data_parallel_sharding_strategy"] = _FSDP_STRATEGY[self.sharded_states]
            kwargs["outer_dp_sharding_strategy"] = "optim" if self.has_wider_optimizer_shard(dp, cp) else "no_shard"
        return kwargs

    def optimizer_config_kwargs(self, dp: int, cp: int) -> dict[str, Any]:
        """Fields of megatron-core's ``OptimizerConfig`` that express this choice."""
        return {
            "use_distributed_optimizer": self.ddp_config_kwargs(dp, cp)["use_distributed_optimizer"],
            "overlap_param_gather": self.overlap_param_gather,
        }

    def has_wider_optimizer_shard(self, dp: int, cp: int) -> bool:
        """True when optimizer states are sharded over more ranks than parameters/gradients (HFSDP outer 'optim')."""
        return self.resolved_optimizer_shard_size(dp, cp) > self.resolved_shard_size(dp, cp)

    def megatron_cli_args(self, dp: int, cp: int) -> list[str]:
        """The same choice as Megatron-LM command-line flags (``pretrain_gpt.py``)."""
        kwargs = self.ddp_config_kwargs(dp, cp)
        args: list[str] = []
        if kwargs["use_distributed_optimizer"]:
            args.append("--use-distributed-optimizer")
        if kwargs["num_distributed_optimizer_instances"] > 1:
            args += ["--num-distributed-optimizer-instances", str(kwargs["num_distributed_optimizer_instances"])]
        if kwargs.get("use_megatron_fsdp"):
            args += [
                "--use-megatron-fsdp",
                "--data-parallel-sharding-strategy",
                kwargs["data_parallel_sharding_strategy"],
                "--ckpt-format",
                "fsdp_dtensor",
            ]
            if kwargs["outer_dp_sharding_strategy"] != "no_shard":
                # clip_grad 0: see optimizer_config (the gradient norm misses the other instances' shards)
                args += ["--outer-dp-sharding-strategy", kwargs["outer_dp_sharding_strategy"], "--clip-grad", "0.0"]
        if self.overlap_grad_reduce:
            args.append("--overlap-grad-reduce")
        if self.overlap_param_gather:
            args.append("--overlap-param-gather")
        return args


# ---- memory model -----------------------------------------------------------------------------------------------
def state_bytes_per_rank(
    num_params: int,
    hybrid_zero: HybridZeRO,
    dp: int,
    cp: int,
    param_bytes: int = 2,
    grad_bytes: int = _FP32_BYTES,
    optimizer: str = "adam",
) -> dict[str, int]:
    """Persistent bytes of model state one rank holds, as megatron-core keeps them: {params, grads, optimizer}.

    N = ``num_params`` (this rank's model-parallel share: parameters per TP/PP rank), P / G = ``param_bytes`` /
    ``grad_bytes``, bytes per element of the params and of the grad buffer (Megatron's grad buffer dtype: fp32 with
    ``grad_reduce_in_fp32``, else the param dtype; megatron-fsdp's ``megatron_fsdp_main_grads_dtype``), S = shard
    size, S_opt = optimizer shard size, M = 4 (fp32 main params) when they are a separate copy, else 0, K = 8 for
    Adam (fp32 exp_avg + exp_avg_sq), 4 for SGD (fp32 momentum). Divisions round up.

    =========================  ==========  ==========  =====================
    choice                     params      grads       optimizer
    =========================  ==========  ==========  =====================
    none (DDP)                 N*P         N*G         N*(K+M)
    optimizer (dist. opt.)     N*P         N*G         N*(K+M)/S
    optimizer (megatron-fsdp)  N*P         N*G         N*(K+4)/S
    optimizer+grads            N*P         N*G/S       N*(K+4)/S
    optimizer+grads+params     N*P/S       N*G/S       N*(K+4)/S_opt
    =========================  ==========  ==========  =====================

    With Megatron's DDP, M = 4 only for 16-bit params: for fp32 params the optimizer updates views of the
    params themselves. megatron-fsdp always keeps an fp32 main-weight shard (``megatron_fsdp_main_params_dtype``
    defaults to fp32), even for fp32 params. Not counted: activations, the transient all-gathered layer of
    'optimizer+grads+params', communication buffers, and padding. Padding per rank is below
    (64 * tensors + buckets * lcm(S, 128)) / S elements for the distributed optimizer (64-element tensor
    alignment, bucket ends divisible by S and 128), and below sum over megatron-fsdp parameter groups of
    row_size * (S + tensors in the group) / S elements for megatron-fsdp (groups padded to S x row size).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not valid; choose one of {list(OPTIMIZERS)}")
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params {num_params!r} must be a non-negative integer")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} {value!r} must be a positive integer (bytes per element)")
    hybrid_zero.validate(dp, cp)
    shard = hybrid_zero.resolved_shard_size(dp, cp)
    opt_shard = hybrid_zero.resolved_optimizer_shard_size(dp, cp)
    fsdp = hybrid_zero.backend == "megatron_fsdp"
    main = _FP32_BYTES if (fsdp or param_bytes != _FP32_BYTES) else 0
    states = hybrid_zero.sharded_states
    per_element_optimizer = _STATE_BYTES[optimizer] + main
    return {
        "params": _ceil_div(num_params * param_bytes, shard if states == "optimizer+grads+params" else 1),
        "grads": _ceil_div(
            num_params * grad_bytes, shard if states in ("optimizer+grads", "optimizer+grads+params") else 1
        ),
        "optimizer": _ceil_div(num_params * per_element_optimizer, opt_shard),
    }


def distributed_optimizer_padding_bound(num_tensors: int, shard_size: int, num_buckets: int = 1) -> int:
    """Upper bound on the padding elements per rank of Megatron's distributed optimizer: each tensor starts on a
    64-element boundary and each bucket end is padded to a multiple of lcm(shard_size, 128)."""
    return _ceil_div(64 * num_tensors + num_buckets * math.lcm(shard_size, 128), shard_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "HybridZeRO",
    "IMPLEMENTATIONS",
    "OPTIMIZERS",
    "SHARDED_STATES",
    "distributed_optimizer_padding_bound",
    "state_bytes_per_rank",
]
