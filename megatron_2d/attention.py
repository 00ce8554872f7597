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

import weakref

import torch
import torch.distributed as dist

from .groups import Groups2D
from .head_all_to_all import Direction, HeadAllToAll, HeadRoute, ascending_order
from .kept_forward import KeptForward
from .kernels import select_kernel
from .kernels.base import accumulator_dtype
from .layout.band import SlidingWindow
from .layout.block_calls import BlockCall, ContextCalls, context_calls
from .layout.choices import check_dkv_comm_dtype
from .layout.heads import kv_replication
from .layout.transports import transport_kind
from .packed_sharding import PackedSharding
from .ring_attention import RingAttention, RingContext
from .transport.base import KeyRoutes
from .transport.kinds import transport_classes

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


def zigzag_route(groups: Groups2D, s_local: int, group_calls: ContextCalls) -> tuple[str, KeyRoutes]:
    """(transport kind, routes) of zigzag shards of ``s_local`` tokens per rank under the mask of ``group_calls``:
    every key of a block may travel; the neighbour exchange sends the hull of the keys each pair's calls read."""
    kind = transport_kind(groups.context_size, groups.head_parallel_size * s_local, group_calls.dense)
    return kind, KeyRoutes(keys=group_calls.keys)


def packed_route(
    groups: Groups2D, packing: PackedSharding, causal: bool, window: SlidingWindow
) -> tuple[str, KeyRoutes, dict[int, tuple[BlockCall, ...]]]:
    """(transport kind, routes, this rank's calls per source) of one packed batch and mask: the ring carries the
    layout's ring prefix; the neighbour exchange the keys each pair's calls read, packed together (the calls then
    in those packed coordinates)."""
    ring_tokens, cp = packing.ring_tokens, groups.context_size
    neighbours = None if ring_tokens == 0 or cp == 1 else packing.neighbour_keys(causal, window)
    kind = transport_kind(cp, ring_tokens, neighbours is None)
    if kind == "neighbour":
        return kind, KeyRoutes(keys=neighbours.keys, offsets=neighbours.offsets), neighbours.calls
    ring_keys = ring_tokens if ring_tokens < packing.view_len else None
    return kind, KeyRoutes(ring_keys=ring_keys), packing.calls(causal, window)


def rider_dtype(dtype: torch.dtype, dkv_comm_dtype: str) -> torch.dtype:
    """The dtype dK/dV riders travel and accumulate in for inputs of ``dtype`` (see ``dkv_comm_dtype``)."""
    return accumulator_dtype(dtype) if dkv_comm_dtype == "accumulator" else dtype


def _setup(
    groups: Groups2D,
    device: torch.device,
    dtype: torch.dtype,
    s_local: int,
    causal: bool,
    window: SlidingWindow,
    scale: float,
    kernel: str | None,
    dkv_comm_dtype: str,
    head_dims: tuple[int, int],
):
    """(head all-to-all, ring context) for one call signature: built on first use, then cached on ``groups``, so a
    call makes no host-device copy, builds no calls and creates no tensor from Python data."""
    key = (device, dtype, s_local, causal, window, scale, kernel, dkv_comm_dtype, head_dims)
    cached = groups.op_cache.get(key)
    if cached is None:
        place = groups.place
        order = ascending_order(groups.received_chunks(place.context_rank))
        heads = HeadRoute.build(
            groups.head_parallel_size, order, groups.head_group, groups.comm_bytes, device, head_ranks=place.head_group
        )
        group_calls = context_calls(groups.layout, s_local // 2, causal, window)
        kind, routes = zigzag_route(groups, s_local, group_calls)
        rc = RingContext(
            transport=transport_classes()[kind].for_routes(groups, routes),
            kernel=select_kernel(device, dtype, kernel, max(head_dims)).for_head_dims(*head_dims),
            calls={src: group_calls.calls[(place.context_rank, src)] for src in range(groups.context_size)},
            scale=scale,
            rider_dtype=rider_dtype(dtype, dkv_comm_dtype),
        )
        cached = groups.op_cache[key] = (heads, rc)
    return cached


class _GroupsKey:
    """A cache key naming one Groups2D object (a mutable dataclass: unhashable) without keeping it alive: equal only
    to a key of the same live object, so a Groups2D built after another was collected never meets its entries,
    even at the same address."""

    __slots__ = ("_ref", "_hash")

    def __init__(self, groups: Groups2D) -> None:
        self._ref, self._hash = weakref.ref(groups), id(groups)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _GroupsKey):
            return NotImplemented
        mine = self._ref()
        return mine is not None and mine is other._ref()


def _packed_setup(
    groups: Groups2D,
    packing: PackedSharding,
    device: torch.device,
    dtype: torch.dtype,
    causal: bool,
    window: SlidingWindow,
    scale: float,
    kernel: str | None,
    dkv_comm_dtype: str,
    head_dims: tuple[int, int],
):
    """(head all-to-all, ring context) for one packed batch and call signature, cached on the layout (per groups
    object: another Groups2D of the same layout has process groups and a byte counter of its own)."""
    key = (_GroupsKey(groups), device, dtype, causal, window, scale, kernel, dkv_comm_dtype, head_dims)
    cached = packing.op_cache.get(key)
    if cached is None:
        heads = HeadRoute.build(
            groups.head_parallel_size,
            packing.head_order,
            groups.head_group,
            groups.comm_bytes,
            device,
            per_token=packing.head_unit == "token",
            head_ranks=groups.place.head_group,
        )
        kind, routes, calls = packed_route(groups, packing, causal, window)
        rc = RingContext(
            transport=transport_classes()[kind].for_routes(groups, routes),
            kernel=select_kernel(device, dtype, kernel, max(head_dims)).for_head_dims(*head_dims),
            calls=calls,
            scale=scale,
            rider_dtype=rider_dtype(dtype, dkv_comm_dtype),
        )
        cached = packing.op_cache[key] = (heads, rc)
    return cached


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
    dkv_comm_dtype: str = "accumulator",
    packing: PackedSharding | None = None,
    kept: KeptForward | None = None,
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
        kept: Selective Checkpoint++'s record of this call (:class:`megatron_2d.kept_forward.KeptForward`): the
            first pass records into it, the recompute returns what it kept instead of computing (None: a plain
            call; see :mod:`megatron_2d.megatron.checkpoint_plus`).
        return_max_logit: also return max_logit [hq], per query head of q (in q's head order), the max of
            softmax_scale * q . k over exactly the (query, key) pairs the mask lets see, over the whole CP group,
            equal on every rank of it; in the accumulator dtype (fp32; fp64 for fp64 inputs), not differentiable.
            Sinks are not q . k logits and stay out (as in Transformer Engine); a head that sees nothing gets
            -inf. Costs two all-reduces of hq values and, unless the kernel's launch gives it (te_fused on TE 2.9+),
            one more q k^T pass per block (:mod:`megatron_2d.kernels.max_logit`). Out and gradients are unchanged.
    Returns out [s, b, hq, dv] (or [t_local, hq, dv] with packing) in q's dtype, and max_logit [hq] when
    ``return_max_logit``. Bytes sent are added to ``groups.comm_bytes`` (the max logit's all-reduces are not).
    """
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
    route, rc, local_sinks = prepare_call(
        q, groups, causal, softmax_scale, kernel, sliding_window, sinks, dkv_comm_dtype, packing, value_dim=v.shape[-1]
    )
    # one all-to-all for q, k and v: q [b, S, hq/hp, dk], K/V side by side as the ring sends them [b, S, hkv'/hp, dk+dv]
    hq = q.shape[2]
    q, kv = HeadAllToAll.apply(route, Direction.TO_HEADS, (1, 2), kept, q, k, v)
    out, local_max = RingAttention.apply(q, kv, local_sinks, rc, kept, return_max_logit)  # [b, S, hq/hp, dv]
    (out,) = HeadAllToAll.apply(route, Direction.TO_TOKENS, None, kept, out)  # [s, b, hq, dv]
    out = out.squeeze(1) if packing is not None else out
    return (out, group_max_logit(local_max, groups, hq, kept)) if return_max_logit else out


def group_max_logit(local_max: torch.Tensor | None, groups: Groups2D, hq: int, kept: KeptForward | None):
    """max_logit [hq] of the whole CP group from this rank's ring's [hq/hp] (see the module): this rank's heads'
    slots, -inf elsewhere, all-reduced (MAX) over the head group, then over the context group. Selective
    Checkpoint++'s recompute gives back the kept result (point "max_logit") without reducing again."""
    replayed = kept.replay("max_logit") if kept is not None else None
    if replayed is not None:
        return replayed[0]
    heads, rank = local_max.shape[0], groups.place.head_rank
    result = local_max.new_full((hq,), float("-inf"))
    result[rank * heads : (rank + 1) * heads] = local_max
    for group in (groups.head_group, groups.context_kv_group):
        if group is not None:
            dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
    if kept is not None:
        kept.record("max_logit", (result,))
    return result


def prepare_call(
    q: torch.Tensor,
    groups: Groups2D,
    causal: bool,
    softmax_scale: float | None,
    kernel: str | None,
    sliding_window,
    sinks: torch.Tensor | None,
    dkv_comm_dtype: str,
    packing: PackedSharding | None,
    value_dim: int,
):
    """What one call needs besides its tensors, from q [s_local, b, hq, dk]: (head all-to-all, ring context, this
    rank's sinks [hq/hp] or None); the setup is cached per signature (see :func:`_setup`)."""
    s_local, _, hq, dk = q.shape
    seq_len = packing.max_document_length if packing is not None else s_local * groups.layout.cp_size
    window = SlidingWindow.of(sliding_window, causal, seq_len)
    scale = dk**-0.5 if softmax_scale is None else float(softmax_scale)
    check_dkv_comm_dtype(dkv_comm_dtype)
    head_dims = (dk, value_dim)
    if packing is not None:
        route, rc = _packed_setup(
            groups, packing, q.device, q.dtype, causal, window, scale, kernel, dkv_comm_dtype, head_dims
        )
    else:
        route, rc = _setup(groups, q.device, q.dtype, s_local, causal, window, scale, kernel, dkv_comm_dtype, head_dims)
    local_heads, head_rank = hq // groups.head_parallel_size, groups.place.head_rank
    local_sinks = None if sinks is None else sinks[head_rank * local_heads : (head_rank + 1) * local_heads]
    return route, rc, local_sinks
