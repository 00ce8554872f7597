"""PyTorch's context parallelism on CPU: a CP sharding rule for the CPU SDPA op that runs torch's own ring.

torch 2.13's context parallelism (torch.distributed.tensor.experimental._context_parallel) dispatches SDPA on
sequence-sharded DTensors to its templated ring (``_templated_ring_attention`` and its backward twin: the K/V
rotation, the per-block calls, the log-sum-exp merge), but only for the CUDA ops (flash, efficient, cuDNN). On CPU
``F.scaled_dot_product_attention`` lowers to ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward), for which DTensor has no rule. :func:`cpu_sdpa_context_parallel` registers one, scoped: a Shard(2)
strategy for each op and a handler that calls torch's templated ring with :func:`block_forward` /
:func:`block_backward` as the per-block op. Those adapt megatron_2d's ``CpuFlashKernel`` ([b, s, h, d], fp32 lse)
to aten's [b, h, s, d] signatures, so the per-block kernel is the one every other CPU row of bench_compare uses.
K/V with fewer heads than Q (SDPA's ``enable_gqa``) pass through: the kernel expands them per block.

    with cpu_sdpa_context_parallel():      # or enable_in_this_process() once in a forked rank
        out = sdpa_module(q, k, v)         # a module under parallelize_module(..., _ContextParallel(...))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
from torch.distributed.tensor.placement_types import Shard

from megatron_2d.kernels import CpuFlashKernel
from megatron_2d.layout.band import Band

CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # [b, h, s, d]
_KERNEL = CpuFlashKernel()
_ENABLED: list[contextlib.ExitStack] = []


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [b, h, s, d] <-> [b, s, h, d] (views)


def _band(is_causal: bool) -> Band | None:
    return Band(None, 0) if is_causal else None  # top-left causal on a square block, as aten's is_causal


def block_forward(query, key, value, is_causal=False, dropout_p=0.0, scale=None, attn_mask=None):
    """aten._scaled_dot_product_flash_attention_for_cpu's signature over CpuFlashKernel.forward:
    (out [b, h, s, d], lse [b, h, s] fp32)."""
    if dropout_p or attn_mask is not None:
        raise NotImplementedError(f"CPU CP block: dropout_p={dropout_p}, attn_mask={attn_mask is not None}")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _KERNEL.forward(_t(query), _t(key), _t(value), _band(is_causal), scale)
    return _t(out), lse


def block_backward(grad_out, query, key, value, out, logsumexp, is_causal=False, dropout_p=0.0, scale=None, **_):
    """aten._scaled_dot_product_flash_attention_for_cpu_backward's signature over CpuFlashKernel.backward:
    (dq, dk, dv) in [b, h, s, d]."""
    if dropout_p:
        raise NotImplementedError(f"CPU CP block: dropout_p={dropout_p}")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = _KERNEL.backward(
        _t(grad_out), _t(query), _t(key), _t(value), _t(out), logsumexp, _band(is_causal), scale
    )  # [b, s, h, d] each
    return tuple(_t(g) for g in grads)


def _forward_strategy(op_schema):
    """out, lse, q, k, v all Shard(2) (the sequence): the only placement this rule offers."""
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_strategy(op_schema):
    """dq, dk, dv, grad_out, q, k, v, out, lse all Shard(2)."""
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _handler(op_call, args, kwargs):
    """DTensor custom-op handler (as torch's _sdpa_handler): propagate the sharding, run torch's templated ring
    on the local shards with the CPU block op, wrap the results."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(f"CPU CP rule: {op_call} needs its q, k, v sharded on the sequence (Shard(2))")
    group = info.compute_mesh.get_group()
    local_kwargs = dict(info.local_kwargs)
    if local_kwargs.get("attn_mask") is not None:
        raise NotImplementedError("CPU CP rule: attn_mask")
    scale = local_kwargs.get("scale")
    if op_call is CPU_SDPA:
        q, k, v, dropout_p, is_causal = (list(info.local_args) + [0.0, False])[:5]
        results = cp_attention._templated_ring_attention(
            group, SEQ_DIM, block_forward, q, k, v, is_causal=is_causal, dropout_p=dropout_p, scale=scale
        )
    else:
        grad_out, q, k, v, out, lse, dropout_p, is_causal = info.local_args
        results = cp_attention._templated_ring_attention_backward(
            group,
            SEQ_DIM,
            block_backward,
            grad_out,
            "grad_out",
            q,
            k,
            v,
            out,
            lse,
            is_causal,
            dropout_p=dropout_p,
            scale=scale,
        )
    return dispatcher.wrap(results, sharding.output_spec)


@contextlib.contextmanager
def cpu_sdpa_context_parallel() -> Iterator[None]:
    """Register the CP rule and handler of the CPU SDPA op and its backward for the block; restore what was there.

    Enter it after torch's ``_enable_context_parallel_dispatcher()`` (which replaces DTensor's handler table)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = ((CPU_SDPA, _forward_strategy, RuntimeSchemaInfo(3)), (CPU_SDPA_BACKWARD, _backward_strategy, None))
    saved = {
        op: (propagator.op_strategy_funcs.get(op), propagator.op_to_schema_info.get(op), handlers.get(op))
        for op, _, _ in ops
    }
    try:
        for op, strategy, schema_info in ops:
            register_op_strategy(op, schema_info=schema_info)(strategy)
            handlers[op] = _handler
        yield
    finally:
        for op, (strategy, schema_info, handler) in saved.items():
            for table, value in (
                (propagator.op_strategy_funcs, strategy),
                (propagator.op_to_schema_info, schema_info),
                (handlers, handler),
            ):
                if value is None:
                    table.pop(op, None)
                else:
                    table[op] = value


def enable_in_this_process() -> None:
    """torch's CP dispatcher and, on top, the CPU rule, for the rest of this process (a forked benchmark rank);
    idempotent."""
    if not _ENABLED:
        cp_attention._enable_context_parallel_dispatcher()
        stack = contextlib.ExitStack()
        stack.enter_context(cpu_sdpa_context_parallel())
        _ENABLED.append(stack)
