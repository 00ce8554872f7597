"""``attention_2d``: head-parallel x context-parallel attention (LoongTrain's 2D-Attention).

Notation
    s_local  tokens on this rank (Megatron's zigzag shard: chunks i and 2*CP-1-i of 2*CP)     b batch   d head dim
    hq, hkv  query and K/V heads of the tensors passed in (after tensor parallelism)
    hp, cp   head-parallel and context sizes (CP = hp * cp)                                r  K/V replication factor

    dk  query/key head dim     dv  value head dim (equal, or narrower as in MLA: 192 / 128)

    q [s_local, b, hq, dk], k [s_local, b, hkv, dk], v [s_local, b, hkv, dv]
      --(repeat K/V heads r = lcm(hkv, hp) / hkv times when hp does not divide hkv)-->
      --one head all-to-all-->   q [b, S, hq/hp, dk], kv [b, S, r*hkv/hp, dk + dv]   (S = hp * s_local tokens of the
                                 head group; K and V side by side per head, the block the ring sends: no padding)
      --Double-Ring zigzag attention over the context group-->   out [b, S, hq/hp, dv]
      --inverse all-to-all-->   out [s_local, b, hq, dv]

The K/V transport: the Double-Ring when every context rank sees keys of every other (causal, full, wide
windows); the neighbour exchange (:mod:`megatron_2d.transport.neighbour_exchange`) when a sliding window leaves some
pairs with nothing to see, so that steps and bytes follow the window instead of the sequence.

Packed documents (THD, ``packing=PackedSharding``): q [t_local, hq, d], k/v [t_local, hkv, d] hold the slots of
:class:`megatron_2d.PackedSharding`; they run the same path with batch 1, the all-to-all keeping the received
order, and kernel calls planned per pair of same-document runs. The ring carries the layout's ring prefix
(all slots for zigzag and sequence, the long documents' for the documents mode); no ring at all when that is
empty; the neighbour exchange, with only the keys each rank's calls read packed together, when some context ranks
see nothing of others (windows, or documents that do not cross ranks).

The max logit (``return_max_logit``, QK-clip): each rank's ring gives the max of scale * q . k over its heads' rows
and every key they see, [hq/hp]; it goes into its heads' slots of a [hq] tensor (-inf elsewhere), which one MAX
all-reduce over the head group and one over the context group make the whole CP group's, equal on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .call.options import AttentionOptions
from .call.plan import packed_route as packed_route
from .call.plan import prepare
from .call.plan import rider_dtype as rider_dtype
from .call.plan import zigzag_route as zigzag_route
from .groups import Groups2D
from .head_all_to_all import Direction, HeadAllToAll, HeadCall
from .kept_forward import KeptForward, Point
from .layout.choices import DkvCommDtype
from .layout.choices import check_dkv_comm_dtype as check_dkv_comm_dtype
from .layout.heads import kv_replication
from .packed_sharding import PackedSharding
from .ring_attention import RingAttention, RingCall

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _refuse_thd_without_packing(q: torch.Tensor, names: str) -> None:
    if q.dim() == 3:
        raise ValueError(
            f"{names} must be 4-D [s, b, heads, d] (Megatron sbhd); a 3-D (THD) q {tuple(q.shape)} "
            f"needs packing=megatron_2d.PackedSharding(cu_seqlens, groups) to say which document each "
            f"token belongs to"
        )


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")


def _check_local_length(q: torch.Tensor, packed: bool) -> None:
    if q.shape[0] % 2 != 0 and not packed:
        raise ValueError(
            f"the local sequence length {q.shape[0]} must be even: it holds two zigzag chunks "
            f"(the global sequence must be divisible by 2*CP)"
        )


def check_query(q: torch.Tensor, packed: bool = False) -> None:
    """Refuse a q the op cannot take by itself (4-D [s, b, hq, dk], a supported dtype, an even s), naming the values
    (``packed``: THD's, as [t_local, 1, hq, dk]): MLA's check, whose latent is then checked against q."""
    if not packed:
        _refuse_thd_without_packing(q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [s, b, heads, d] (Megatron sbhd), got shape {tuple(q.shape)}")
    _check_dtype(q)
    _check_local_length(q, packed)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool = False) -> None:
    """Refuse q, k, v the op cannot take (shapes, dtypes, devices), naming the values (``packed``: THD's, as
    [t_local, 1, heads, d])."""
    if not packed:
        _refuse_thd_without_packing(q, "q, k, v")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [s, b, heads, d] (Megatron sbhd), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree on sequence, batch and heads, got {tuple(k.shape)} and "
            f"{tuple(v.shape)} (their head dims may differ, as in MLA)"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on sequence, batch and head dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_dtype(q)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    _check_local_length(q, packed)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Refuse sinks that are not one floating-point logit per query head of q, on q's device."""
    if sinks is None:
        return
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        raise ValueError(f"sinks must hold one logit per query head, shape [{q.shape[2]}], got {tuple(sinks.shape)}")
    if not sinks.is_floating_point() or sinks.device != q.device:
        raise ValueError(f"sinks must be a floating-point tensor on {q.device}, got {sinks.dtype} on {sinks.device}")


def check_not_capturing(device: torch.device) -> None:
    """Refuse to run inside a CUDA graph capture: the rings' point-to-point messages, the per-batch calls and the
    first-call setup run on the host, so a replayed graph would move stale data (megatron: keep attention out of
    cuda_graph_modules; the config check refuses training graphs that capture it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "attention_2d cannot run inside a CUDA graph capture; leave core attention out of the "
            "graph (megatron: cuda_graph_modules without 'attn', or cuda_graph_impl='none')"
        )


def check_packing(groups: Groups2D, packing) -> None:
    """Refuse a ``packing`` that is not a PackedSharding of these groups."""
    if not isinstance(packing, PackedSharding):
        raise TypeError(f"packing must be a megatron_2d.PackedSharding, got {type(packing).__name__}")
    if (packing.groups.layout, packing.groups.place) != (groups.layout, groups.place):
        raise ValueError(
            "this PackedSharding was built for other groups than the ones passed to attention_2d; "
            "build it with PackedSharding(cu_seqlens, groups) for these groups"
        )


def _check_packed_tokens(q: torch.Tensor, groups: Groups2D, packing: PackedSharding) -> None:
    """Refuse a THD q [t, hq, dk] whose t is not the layout's t_local."""
    if q.shape[0] != packing.local_tokens:
        raise ValueError(
            f"q holds {q.shape[0]} tokens, but the PackedSharding gives this rank t_local = "
            f"{packing.local_tokens} slots (T = {packing.total_tokens} over CP = "
            f"{groups.layout.cp_size}); shard the tensors with layout.shard"
        )


def check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Groups2D, packing) -> None:
    """Refuse THD q, k, v that do not fit ``packing`` (a PackedSharding of these groups), then :func:`check_inputs`."""
    check_packing(groups, packing)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"with packing, q, k, v must be 3-D [t_local, heads, d] (THD), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_packed_tokens(q, groups, packing)
    check_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), packed=True)


def check_packed_query(q: torch.Tensor, groups: Groups2D, packing) -> None:
    """Refuse a THD q [t_local, hq, dk] that does not fit ``packing``, then :func:`check_query` (MLA's check)."""
    check_packing(groups, packing)
    if q.dim() != 3:
        raise ValueError(f"with packing, q must be 3-D [t_local, heads, d] (THD), got shape {tuple(q.shape)}")
    _check_packed_tokens(q, groups, packing)
    check_query(q.unsqueeze(1), packed=True)


def attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Groups2D,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | None = None,
    sliding_window: tuple[int, int] | None = (-1, -1),
    sinks: torch.Tensor | None = None,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    packing: PackedSharding | None = None,
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the whole CP group for zigzag-sharded q [s, b, hq, dk], k [s, b, hkv, dk],
    v [s, b, hkv, dv], or for packed documents q [t_local, hq, dk], k [t_local, hkv, dk], v [t_local, hkv, dv] with
    ``packing``. dv may differ from dk (MLA: 192 / 128): K and V travel side by side, unpadded.

    Args:
        groups: from :func:`megatron_2d.build_2d_groups`.
        causal: causal mask over global positions (else full attention).
        softmax_scale: defaults to 1/sqrt(dk).
        kernel: local block kernel name (see :mod:`megatron_2d.kernels`); chosen by device when None.
        sliding_window: (left, right) in tokens, flash-attn's convention: the query at global position p sees
            keys p - left .. p + right; -1 = unbounded; (-1, -1) = no window. With causal, right is 0 or -1.
        sinks: [hq] one softmax logit per query head added to every row's denominator (gpt-oss attention sinks;
            zeros = "off-by-one"); differentiable. Each rank returns the gradient of its own rows: summed over
            the CP group (as Megatron reduces replicated weights) it is the full gradient.
        dkv_comm_dtype: how dK/dV partials travel the ring in backward: "accumulator" (fp32, fp64 for fp64
            inputs: exact, the default) or "input" (q's dtype: Transformer Engine's bytes, rounded once per hop).
            A hop adds its partials to the travelling rider in that dtype. The error of "input" grows with the
            ring (measured figures: docs/op.md, "Communication"), so "accumulator" stays the default; "input"
            saves a third of the backward ring bytes.
        packing: a :class:`megatron_2d.PackedSharding` of these groups: THD tensors of packed documents, attention
            within each document only (causal and the window over positions within the document); padding
            slots give exact zeros in the output and the gradients.
        return_max_logit: also return max_logit [hq], per query head of q (in q's head order), the max of
            softmax_scale * q . k over exactly the (query, key) pairs the mask lets see, over the whole CP group,
            equal on every rank of it; in the accumulator dtype (fp32; fp64 for fp64 inputs), not differentiable.
            Sinks are not q . k logits and stay out (as in Transformer Engine); a head that sees nothing gets
            -inf. Costs two all-reduces of hq values and, unless the kernel's launch gives it (te_fused on TE 2.9+),
            one more q k^T pass per block (:mod:`megatron_2d.kernels.max_logit`). Out and gradients are unchanged.
    Returns out [s, b, hq, dv] (or [t_local, hq, dv] with packing) in q's dtype, and max_logit [hq] when
    ``return_max_logit``. Bytes sent are added to ``groups.comm_bytes`` (the max logit's all-reduces are not).
    The keywords besides ``sinks`` and ``packing`` become one :class:`megatron_2d.call.options.AttentionOptions`
    (:func:`run_attention_2d` takes it directly).
    """
    options = AttentionOptions(
        causal=causal,
        softmax_scale=softmax_scale,
        kernel=kernel,
        sliding_window=sliding_window,
        dkv_comm_dtype=dkv_comm_dtype,
        return_max_logit=return_max_logit,
    )
    return run_attention_2d(q, k, v, groups, options, sinks, packing)


def run_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Groups2D,
    options: AttentionOptions,
    sinks: torch.Tensor | None = None,
    packing: PackedSharding | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_2d` with its settings as one :class:`~megatron_2d.call.options.AttentionOptions` (built once by
    a caller that makes many calls, e.g. Megatron's core attention), whose ``kept`` carries Selective Checkpoint++'s
    record of the call (:mod:`megatron_2d.kept_forward`: the first pass records into it, the recompute returns what
    it kept instead of computing)."""
    check_not_capturing(q.device)
    if packing is not None:
        check_packed(q, k, v, groups, packing)
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # [t_local, 1, heads, d]
    else:
        check_inputs(q, k, v)
    check_sinks(sinks, q)
    replicas = kv_replication(q.shape[2], k.shape[2], groups.head_parallel_size)
    if replicas > 1:
        k, v = k.repeat_interleave(replicas, dim=2), v.repeat_interleave(replicas, dim=2)
    plan = prepare(q, v.shape[-1], groups, options, packing)
    head_call, hq = HeadCall(plan.route, options.kept), q.shape[2]
    # one all-to-all for q, k and v: q [b, S, hq/hp, dk], K/V side by side as the ring sends them [b, S, hkv'/hp, dk+dv]
    q, kv = HeadAllToAll.apply(head_call, Direction.TO_HEADS, (1, 2), q, k, v)
    ring = RingCall(plan.ring, options.kept, options.return_max_logit)
    out, local_max = RingAttention.apply(q, kv, head_sinks(sinks, groups, hq), ring)  # [b, S, hq/hp, dv]
    (out,) = HeadAllToAll.apply(head_call, Direction.TO_TOKENS, None, out)  # [s, b, hq, dv]
    out = out.squeeze(1) if packing is not None else out
    return (out, group_max_logit(local_max, groups, hq, options.kept)) if options.return_max_logit else out


def head_sinks(sinks: torch.Tensor | None, groups: Groups2D, hq: int) -> torch.Tensor | None:
    """This rank's slice [hq/hp] of the sinks [hq] (its head rank's heads), or None."""
    if sinks is None:
        return None
    local_heads, head_rank = hq // groups.head_parallel_size, groups.place.head_rank
    return sinks[head_rank * local_heads : (head_rank + 1) * local_heads]


def group_max_logit(local_max: torch.Tensor | None, groups: Groups2D, hq: int, kept: KeptForward | None):
    """max_logit [hq] of the whole CP group from this rank's ring's [hq/hp] (see the module): this rank's heads'
    slots, -inf elsewhere, all-reduced (MAX) over the head group, then over the context group. Selective
    Checkpoint++'s recompute gives back the kept result (point "max_logit") without reducing again."""
    replayed = kept.replay(Point.MAX_LOGIT) if kept is not None else None
    if replayed is not None:
        return replayed[0]
    heads, rank = local_max.shape[0], groups.place.head_rank
    result = local_max.new_full((hq,), float("-inf"))
    result[rank * heads : (rank + 1) * heads] = local_max
    for group in (groups.head_group, groups.context_kv_group):
        if group is not None:
            dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
    if kept is not None:
        kept.record(Point.MAX_LOGIT, (result,))
    return result
