"""The call plan of ``attention_2d``: what one call needs besides its tensors, built once per key and cached.

:func:`prepare` looks the plan up by a hashable key (the tensors' device, dtype and shapes, and the
:class:`~megatron_2d.call.options.AttentionOptions`) in the bounded cache
(:class:`~megatron_2d.call.options.BoundedCache`) of the groups, or, for packed documents, of the batch's
:class:`~megatron_2d.PackedSharding` (keyed by the groups object too: another Groups2D of the same layout has process
groups and a byte counter of its own). The cache holds its keys, so a Groups2D in a key stays alive while its entry
does, and no later object can meet a collected one's plan. A plan is the head route
(:class:`~megatron_2d.head_all_to_all.HeadRoute`) and the ring context
(:class:`~megatron_2d.ring_attention.RingContext`: transport, kernel, calls, scale, rider dtype), so a call that finds
its plan makes no host-device copy, builds no calls and creates no tensor from Python data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..groups import Groups2D
from ..head_all_to_all import HeadRoute, ascending_order
from ..kernels import select_kernel
from ..kernels.base import accumulator_dtype
from ..layout.band import SlidingWindow
from ..layout.block_calls import BlockCall, ContextCalls, context_calls
from ..layout.choices import DkvCommDtype, HeadUnit, TransportKind
from ..layout.transports import transport_kind
from ..packed_sharding import PackedSharding
from ..ring_attention import RingContext
from ..transport.base import KeyRoutes
from ..transport.kinds import transport_classes
from .options import AttentionOptions


class CallPlan(NamedTuple):
    """The head all-to-all's route and the ring's context of one call signature."""

    route: HeadRoute
    ring: RingContext


def zigzag_route(groups: Groups2D, s_local: int, group_calls: ContextCalls) -> tuple[TransportKind, KeyRoutes]:
    """(transport kind, routes) of zigzag shards of ``s_local`` tokens per rank under the mask of ``group_calls``:
    every key of a block may travel; the neighbour exchange sends the hull of the keys each pair's calls read."""
    kind = transport_kind(groups.context_size, groups.head_parallel_size * s_local, group_calls.dense)
    return kind, KeyRoutes(keys=group_calls.keys)


def packed_route(
    groups: Groups2D, packing: PackedSharding, causal: bool, window: SlidingWindow
) -> tuple[TransportKind, KeyRoutes, dict[int, tuple[BlockCall, ...]]]:
    """(transport kind, routes, this rank's calls per source) of one packed batch and mask: the ring carries the
    layout's ring prefix; the neighbour exchange the keys each pair's calls read, packed together (the calls then
    in those packed coordinates)."""
    ring_tokens, cp = packing.ring_tokens, groups.context_size
    neighbours = None if ring_tokens == 0 or cp == 1 else packing.neighbour_keys(causal, window)
    kind = transport_kind(cp, ring_tokens, neighbours is None)
    if kind == TransportKind.NEIGHBOUR:
        return kind, KeyRoutes(keys=neighbours.keys, offsets=neighbours.offsets), neighbours.calls
    ring_keys = ring_tokens if ring_tokens < packing.view_len else None
    return kind, KeyRoutes(ring_keys=ring_keys), packing.calls(causal, window)


def rider_dtype(dtype: torch.dtype, dkv_comm_dtype: str) -> torch.dtype:
    """The dtype dK/dV riders travel and accumulate in for inputs of ``dtype`` (see ``dkv_comm_dtype``)."""
    return accumulator_dtype(dtype) if dkv_comm_dtype == DkvCommDtype.ACCUMULATOR else dtype


class _Signature(NamedTuple):
    """What a plan is built from besides the groups and the packed layout: q [s_local, b, hq, dk]'s device, dtype,
    s_local and dk, the value head dim dv, and the options."""

    device: torch.device
    dtype: torch.dtype
    s_local: int
    head_dims: tuple[int, int]
    options: AttentionOptions

    def window(self, seq_len: int) -> SlidingWindow:
        return SlidingWindow.of(self.options.sliding_window, self.options.causal, seq_len)

    def ring(self, groups: Groups2D, kind: TransportKind, routes: KeyRoutes, calls) -> RingContext:
        """The ring context of this signature, on a transport of ``kind`` over ``routes``."""
        options, (dk, dv) = self.options, self.head_dims
        return RingContext(
            transport=transport_classes()[kind].for_routes(groups, routes),
            kernel=select_kernel(self.device, self.dtype, options.kernel, max(dk, dv)).for_head_dims(dk, dv),
            calls=calls,
            scale=dk**-0.5 if options.softmax_scale is None else float(options.softmax_scale),
            rider_dtype=rider_dtype(self.dtype, options.dkv_comm_dtype),
        )


def _zigzag_plan(groups: Groups2D, sig: _Signature) -> CallPlan:
    place = groups.place
    order = ascending_order(groups.received_chunks(place.context_rank))
    route = HeadRoute.build(
        groups.head_parallel_size, order, groups.head_group, groups.comm_bytes, sig.device, head_ranks=place.head_group
    )
    causal, window = sig.options.causal, sig.window(sig.s_local * groups.layout.cp_size)
    group_calls = context_calls(groups.layout, sig.s_local // 2, causal, window)
    kind, routes = zigzag_route(groups, sig.s_local, group_calls)
    calls = {src: group_calls.calls[(place.context_rank, src)] for src in range(groups.context_size)}
    return CallPlan(route, sig.ring(groups, kind, routes, calls))


def _packed_plan(groups: Groups2D, packing: PackedSharding, sig: _Signature) -> CallPlan:
    route = HeadRoute.build(
        groups.head_parallel_size,
        packing.head_order,
        groups.head_group,
        groups.comm_bytes,
        sig.device,
        per_token=packing.head_unit == HeadUnit.TOKEN,
        head_ranks=groups.place.head_group,
    )
    causal, window = sig.options.causal, sig.window(packing.max_document_length)
    kind, routes, calls = packed_route(groups, packing, causal, window)
    return CallPlan(route, sig.ring(groups, kind, routes, calls))


def prepare(
    q: torch.Tensor, value_dim: int, groups: Groups2D, options: AttentionOptions, packing: PackedSharding | None
) -> CallPlan:
    """The plan of a call on q [s_local, b, hq, dk] (THD: [t_local, 1, hq, dk]) with values of head dim
    ``value_dim``: built on first use, then found in the groups' cache (the layout's, with ``packing``)."""
    s_local, _, _, dk = q.shape
    sig = _Signature(q.device, q.dtype, s_local, (dk, value_dim), options)
    if packing is None:
        return groups.op_cache.get_or_build(sig, lambda: _zigzag_plan(groups, sig))
    return packing.op_cache.get_or_build((groups, sig), lambda: _packed_plan(groups, packing, sig))
