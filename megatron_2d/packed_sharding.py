"""``PackedSharding``: which packed-document tokens each rank holds, and the kernel calls that follow from it.

    layout = megatron_2d.PackedSharding(cu_seqlens, groups, mode="zigzag")   # or mode="documents"
    idx = layout.local_indices()     # LongTensor [t_local]: packed-stream index of each local slot, -1 = padding
    q_local = layout.shard(q)        # [T, hq, d] -> [t_local, hq, d] (padding slots zero)
    out = megatron_2d.attention_2d(q_local, k_local, v_local, groups, packing=layout)

Modes: "zigzag" (Megatron / Transformer Engine THD), "documents" (short documents whole on one context rank, long
ones zigzag-sharded) and "sequence" (Megatron's per-sequence zigzag), each a class of
:mod:`megatron_2d.packing.modes`, which lays the batch out (pure numpy); this object adds the torch side.
Building a layout is collective over the CP group (it checks that every rank passed the same ``cu_seqlens``);
everything else is numpy over all ranks at once (no per-rank loops), describing every view by its runs. It holds
what the op needs for this batch (calls, index tensors), so calls on it make no host work and no host-device
synchronisation; build it ahead of the step (see the README, "Packed documents") to keep it off the critical path.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .call.options import BoundedCache
from .groups import Groups2D
from .layout.band import SlidingWindow
from .layout.block_calls import BlockCall
from .layout.choices import HeadUnit, TransportKind
from .layout.choices import PackingMode as Mode
from .packing.calls import Runs, key_intervals, view_calls
from .packing.modes import PackingMode, mode_class
from .packing.sharding import DocumentSharding, PackingCost
from .packing.views import materialise
from .transport.comm import check_same_on_every_rank, to_device
from .transport.neighbour_exchange import KeyIntervals


class NeighbourKeys(NamedTuple):
    """The neighbour exchange of one packed batch and mask (see :meth:`PackedSharding.neighbour_keys`)."""

    keys: dict[tuple[int, int], KeyIntervals]  # (dst, src) -> the keys of src's block dst's calls read
    offsets: list[int]  # the offsets dst - src (mod cp) some pair needs
    calls: dict[int, tuple[BlockCall, ...]]  # this rank's calls, neighbours' keys in packed coordinates


def _as_cu_seqlens(cu_seqlens, name: str) -> np.ndarray:
    """cu_seqlens as int64 numpy, checked: 1-D integers, starting at 0, strictly increasing."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"{name} must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(
            f"{name} must be a 1-D integer sequence [0, len_0, len_0 + len_1, ...] of at least two "
            f"entries, got shape {cu.shape} dtype {cu.dtype}"
        )
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    steps = np.diff(cu)
    if (steps <= 0).any():
        j = int(np.flatnonzero(steps <= 0)[0])
        raise ValueError(
            f"{name} must be strictly increasing (every document at least one token), but "
            f"{name}[{j}] = {cu[j]} and {name}[{j + 1}] = {cu[j + 1]}"
        )
    return cu


class PackedSharding:
    """The layout of one packed batch over the 2D CP group of ``groups`` (see the module docstring).

    Args:
        cu_seqlens: cumulative real document lengths [D + 1], from 0, identical on every rank (int32/int64; a
            host array or CPU tensor keeps the build free of device reads).
        groups: from :func:`megatron_2d.build_2d_groups`; the layout only serves these groups.
        mode: "zigzag", "documents" or "sequence" (:data:`megatron_2d.layout.choices.PACKING_MODES`; any mode of
            :mod:`megatron_2d.packing.modes`' registry).
        cu_seqlens_padded: zigzag only: Megatron's padded cumulative lengths (each document a multiple of
            2*CP and at least its real length); default: each length rounded up to a multiple of 2*CP.
        long_threshold: documents only: shard documents longer than this (default: the cost rule of
            :func:`megatron_2d.packing.sharding.shard_documents`).
        cost: documents only: the :class:`megatron_2d.packing.sharding.PackingCost` that rule predicts step
            times with (default: the planner's H100 figures); identical on every rank.
    """

    def __init__(
        self,
        cu_seqlens,
        groups: Groups2D,
        mode: Mode = Mode.ZIGZAG,
        *,
        cu_seqlens_padded=None,
        long_threshold: int | None = None,
        cost: PackingCost | None = None,
    ) -> None:
        mode = mode_class(mode, "PackedSharding mode").name  # a string becomes its member
        if not isinstance(groups, Groups2D):
            raise TypeError(f"PackedSharding needs the Groups2D of build_2d_groups, got {type(groups).__name__}")
        cu = _as_cu_seqlens(cu_seqlens, "cu_seqlens")
        self.cu_seqlens, self.groups, self.mode = cu, groups, mode
        layout = groups.layout
        padded = None
        if cu_seqlens_padded is not None:
            if not mode_class(mode).takes_padded_lengths:
                raise ValueError(
                    f"cu_seqlens_padded describes Megatron's per-document zigzag padding; the "
                    f"{mode} mode pads on its own: pass it only with mode='zigzag'"
                )
            padded = np.diff(_as_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded"))
        self._batch: PackingMode = mode_class(mode)(
            cu, layout, padded_lengths=padded, long_threshold=long_threshold, cost=cost
        )
        self.runs: Runs = self._batch.runs
        self.view_len, self.ring_tokens = self._batch.view_len, self._batch.ring_tokens
        self.sharding: DocumentSharding | None = self._batch.sharding
        order = None if layout.head_parallel_size == 1 else self._batch.head_order(groups.place.context_rank)
        self.head_order: torch.Tensor | None = None if order is None else torch.from_numpy(order)
        """The order of this context rank's head all-to-all (a CPU tensor): ascending unit i of the ring's view is
        unit head_order[i] as received (by head rank, then zigzag half); None when the received order is the
        ring's."""
        self.head_unit = HeadUnit.TOKEN if order is None else self._batch.head_unit
        """What ``head_order`` sorts: single tokens or chunks (of T / 2CP tokens)."""
        fingerprint = zlib.crc32(cu.tobytes()) ^ (
            zlib.crc32(repr((mode, long_threshold, cost, None if padded is None else padded.tolist())).encode()) << 31
        )
        # every rank of the CP group (its head and context groups span it) must pass the same batch
        check_same_on_every_rank(
            (mode, cu, long_threshold, cost, padded),
            [groups.head_group, groups.context_kv_group],
            "PackedSharding: cu_seqlens (or the layout options) differ across the ranks of this CP group",
            fingerprint=fingerprint,
        )
        self._local_indices = torch.from_numpy(self.slots_of([groups.place.cp_index])[0])
        self._device_copies: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._plans: dict[tuple, dict[int, tuple[BlockCall, ...]]] = {}
        self.op_cache = BoundedCache()
        """attention_2d's call plans for this layout, per groups object and signature (like ``Groups2D.op_cache``,
        but per batch; :mod:`megatron_2d.call.plan`)."""

    # -- slots -------------------------------------------------------------------------------------
    def slots_of(self, cp_indices) -> np.ndarray:
        """[len(cp_indices), t_local] the slots of these CP ranks (stream index, -1 = padding)."""
        return self._batch.slots_of(cp_indices)

    @functools.cached_property
    def slots(self) -> np.ndarray:
        """[CP, t_local] every rank's slots (materialised on first use: CP * t_local entries)."""
        return self._batch.all_slots()

    @functools.cached_property
    def views(self) -> np.ndarray:
        """[cp, hp * t_local] every context rank's ring view (materialised on first use)."""
        return materialise(self.runs, self.cu_seqlens, self.groups.layout.context_size, self.view_len)

    # -- tokens ------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        """T: real tokens of the packed batch (cu_seqlens[-1])."""
        return int(self.cu_seqlens[-1])

    @property
    def local_tokens(self) -> int:
        """t_local: slots per rank (real and padding)."""
        return self.view_len // self.groups.layout.head_parallel_size

    @property
    def padding_fraction(self) -> float:
        """Padding slots / all slots over the CP group."""
        return 1.0 - self.total_tokens / (self.local_tokens * self.groups.layout.cp_size)

    @property
    def max_document_length(self) -> int:
        return int(np.diff(self.cu_seqlens).max())

    def local_indices(self) -> torch.Tensor:
        """LongTensor [t_local] (CPU): the packed-stream index of each local slot, -1 for padding."""
        return self._local_indices.clone()

    def device_tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """A host index array of this layout on ``device``, copied once (pinned, non-blocking on a GPU) and kept:
        "local_indices" (the slots of this rank)."""
        key = (name, torch.device(device))
        if key not in self._device_copies:
            self._device_copies[key] = to_device(getattr(self, f"_{name}"), key[1])
        return self._device_copies[key]

    def position_ids(self) -> torch.Tensor:
        """LongTensor [t_local] (CPU): each local token's position within its document (0 for padding)."""
        idx = self._local_indices.numpy()
        doc = np.searchsorted(self.cu_seqlens, np.maximum(idx, 0), side="right") - 1
        return torch.from_numpy(np.where(idx >= 0, idx - self.cu_seqlens[doc], 0))

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slots of the packed tensor ``x`` [T, ...] -> [t_local, ...]; padding slots are zero."""
        if x.shape[0] != self.total_tokens:
            raise ValueError(
                f"PackedSharding.shard: the tensor has {x.shape[0]} tokens along dim 0, but cu_seqlens "
                f"describes T = {self.total_tokens}"
            )
        idx = self.device_tensor("local_indices", x.device)
        out = x.index_select(0, idx.clamp(min=0))
        return out.masked_fill((idx < 0).view(-1, *([1] * (x.dim() - 1))), 0)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The packed tensor [T, ...] from the shards [t_local, ...] of CP ranks 0..CP-1 (padding dropped)."""
        if len(shards) != self.groups.layout.cp_size:
            raise ValueError(f"unshard needs one shard per CP rank ({self.groups.layout.cp_size}), got {len(shards)}")
        stacked = torch.cat(list(shards), dim=0)
        flat = torch.from_numpy(self.slots.reshape(-1)).to(stacked.device)
        real = flat >= 0
        out = stacked.new_zeros((self.total_tokens, *stacked.shape[1:]))
        out[flat[real]] = stacked[real]
        return out

    # -- load --------------------------------------------------------------------------------------
    def rank_pairs(self) -> np.ndarray:
        """[cp] causal attention pairs each context rank computes (its queries' visible keys)."""
        return self.runs.pairs_per_view(self.groups.layout.context_size)

    def stats(self) -> dict[str, float]:
        """Balance and padding: max/mean attention pairs and real tokens per context rank, padding fraction."""
        p = self.rank_pairs()
        t = self.runs.tokens_per_view(self.groups.layout.context_size)
        return {
            "pairs_max_over_mean": float(p.max() / max(p.mean(), 1)),
            "tokens_max_over_mean": float(t.max() / max(t.mean(), 1)),
            "padding_fraction": self.padding_fraction,
            "ring_tokens": self.ring_tokens,
            "view_tokens": self.view_len,
            "long_documents": self._batch.long_documents,
        }

    # -- calls -------------------------------------------------------------------------------------
    def calls(self, causal: bool, window: SlidingWindow) -> dict[int, tuple[BlockCall, ...]]:
        """This context rank's kernel calls against every context rank's block (cached per mask)."""
        key = (causal, window)
        if key not in self._plans:
            me, cp = self.groups.place.context_rank, self.groups.layout.context_size
            found = view_calls(self.runs, me, window.band(causal), ring_keys=self.ring_tokens)
            self._plans[key] = {src: found.get(src, ()) for src in range(cp)}
        return self._plans[key]

    def neighbour_keys(self, causal: bool, window: SlidingWindow) -> NeighbourKeys | None:
        """What the neighbour exchange needs when some pair of context ranks sees nothing of each other under this
        mask (None when every pair sees something, or when finding out would take too long: the ring then):
        which keys of each block travel to whom, as :class:`KeyIntervals` packed back to back (only what the
        calls read, so bytes follow the window), and this rank's calls in the packed coordinates (cached)."""
        key = (TransportKind.NEIGHBOUR, causal, window)
        if key not in self._plans:
            self._plans[key] = self._neighbour_keys(causal, window)
        return self._plans[key]

    def _neighbour_keys(self, causal: bool, window: SlidingWindow) -> NeighbourKeys | None:
        cp, me = self.groups.layout.context_size, self.groups.place.context_rank
        found = None if cp == 1 else key_intervals(self.runs, window.band(causal))
        if found is None:
            return None
        dst, src = found[:, 0], found[:, 1]
        pairs = np.unique(dst[dst != src] * cp + src[dst != src])
        if len(pairs) == cp * (cp - 1):
            return None  # every pair sees something: the ring
        offsets = np.unique((pairs // cp - pairs % cp) % cp).tolist()
        keys: dict[tuple[int, int], KeyIntervals] = {}
        mine = np.flatnonzero((dst != src) & ((dst == me) | (src == me)))
        pair_of = dst[mine] * cp + src[mine]
        starts = np.flatnonzero(np.concatenate(([True], pair_of[1:] != pair_of[:-1]))) if len(mine) else mine
        for first, end in zip(starts.tolist(), np.append(starts[1:], len(mine)).tolist()):
            rows = found[mine[first:end]]
            keys[(int(rows[0, 0]), int(rows[0, 1]))] = KeyIntervals(tuple(map(tuple, rows[:, 2:4].tolist())))
        by_source = dict(self.calls(causal, window))
        for src_rank, calls in by_source.items():
            sel = keys.get((me, src_rank))
            if src_rank == me or sel is None or len(sel.intervals) == 1 or not calls:
                continue
            k = np.array([(c.k_start, c.k_end - 1) for c in calls])
            k = sel.packed(k.reshape(-1)).reshape(-1, 2)
            by_source[src_rank] = tuple(c._replace(k_start=int(a), k_end=int(b) + 1) for c, (a, b) in zip(calls, k))
        return NeighbourKeys(keys, offsets, by_source)

    def __repr__(self) -> str:
        return (
            f"PackedSharding(mode={self.mode!r}, documents={len(self.cu_seqlens) - 1}, T={self.total_tokens}, "
            f"t_local={self.local_tokens}, padding={self.padding_fraction:.3f})"
        )


__all__ = ["PackedSharding"]
