"""``PackedLayout``: which packed-document tokens each rank holds, and the kernel calls that follow from it.

    layout = megatron_2d.PackedLayout(cu_seqlens, groups, mode="zigzag")   # or mode="documents"
    idx = layout.local_indices()     # LongTensor [t_local]: packed-stream index of each local slot, -1 = padding
    q_local = layout.shard(q)        # [T, hq, d] -> [t_local, hq, d] (padding slots zero)
    out = megatron_2d.attention_2d(q_local, k_local, v_local, groups, packing=layout)

Modes (placement math in :mod:`megatron_2d.document_placement`):
    zigzag      Megatron / Transformer Engine THD: every document padded to a multiple of 2*CP, CP rank i holds
                its chunks i and 2*CP-1-i; every document's K/V travel the whole ring.
    documents   short documents whole on one context rank (local attention, no ring traffic), long ones
                zigzag-sharded over the context ranks; the ring carries the long tokens only.
Building a layout is collective over the CP group (it checks that every rank passed the same ``cu_seqlens``).
It holds everything the op needs for this batch (plans, index tensors), so calls on it make no host work.
"""

from __future__ import annotations

import zlib
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .band import SlidingWindow
from .block_plan import BlockCall
from .document_placement import (DEFAULT_TOLERANCE, DocumentPlacement, documents_slots, place_documents, row_pairs,
                                 views_of, zigzag_slots)
from .groups import Groups2D, collective_device
from .packed_plan import document_runs, plan_runs

MODES = ("zigzag", "documents")


def _as_cu_seqlens(cu_seqlens, name: str) -> np.ndarray:
    """cu_seqlens as int64 numpy, checked: 1-D integers, starting at 0, strictly increasing."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"{name} must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer sequence [0, len_0, len_0 + len_1, ...] of at least two "
                         f"entries, got shape {cu.shape} dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    steps = np.diff(cu)
    if (steps <= 0).any():
        j = int(np.flatnonzero(steps <= 0)[0])
        raise ValueError(f"{name} must be strictly increasing (every document at least one token), but "
                         f"{name}[{j}] = {cu[j]} and {name}[{j + 1}] = {cu[j + 1]}")
    return cu


def _check_same_on_every_rank(groups: Groups2D, fingerprint: int, what: str) -> None:
    """Raise on every rank unless all ranks of the CP group hold the same ``fingerprint`` (head group, then
    context group: together they span the CP group)."""
    span = [g for g in (groups.head_group, groups.context_kv_group) if g is not None]
    if not span:
        return
    value = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=collective_device(span[0]))
    for group in span:
        lo = value.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        value = lo
    if int(value[0]) != fingerprint or int(value[1]) != -fingerprint:
        raise ValueError(f"PackedLayout: {what} differ across the ranks of this CP group (rank "
                         f"{dist.get_rank()} has fingerprint {fingerprint}); every rank must pass the same "
                         f"global cu_seqlens")


class PackedLayout:
    """The layout of one packed batch over the 2D CP group of ``groups`` (see the module docstring).

    Args:
        cu_seqlens: cumulative real document lengths [D + 1], from 0, identical on every rank (int32/int64).
        groups: from :func:`megatron_2d.build_2d_groups`; the layout only serves these groups.
        mode: "zigzag" or "documents".
        cu_seqlens_padded: zigzag only: Megatron's padded cumulative lengths (each document a multiple of
            2*CP and at least its real length); default: each length rounded up to a multiple of 2*CP.
        long_threshold: documents only: shard documents longer than this (default: the cost rule of
            :func:`megatron_2d.document_placement.place_documents`).
        tolerance: documents only: the per-context-rank imbalance the placement may leave (pairs and tokens).
    """

    def __init__(self, cu_seqlens, groups: Groups2D, mode: str = "zigzag", *, cu_seqlens_padded=None,
                 long_threshold: Optional[int] = None, tolerance: float = DEFAULT_TOLERANCE) -> None:
        if mode not in MODES:
            raise ValueError(f"PackedLayout mode {mode!r} is not one of {list(MODES)}")
        if not isinstance(groups, Groups2D):
            raise TypeError(f"PackedLayout needs the Groups2D of build_2d_groups, got {type(groups).__name__}")
        cu = _as_cu_seqlens(cu_seqlens, "cu_seqlens")
        self.cu_seqlens, self.groups, self.mode = cu, groups, mode
        layout = groups.layout
        self.placement: Optional[DocumentPlacement] = None
        padded = None
        if cu_seqlens_padded is not None:
            if mode != "zigzag":
                raise ValueError("cu_seqlens_padded describes Megatron's zigzag padding; the documents mode pads "
                                 "on its own: pass it only with mode='zigzag'")
            padded = np.diff(_as_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded"))
            real = np.diff(cu)
            if padded.shape != real.shape or (padded < real).any() or (padded % (2 * layout.cp_size)).any():
                raise ValueError(f"cu_seqlens_padded must give every document a length that is a multiple of "
                                 f"2*CP = {2 * layout.cp_size} and at least its real length; got padded lengths "
                                 f"{padded[:8].tolist()} for real lengths {real[:8].tolist()} (first 8)")
        if mode == "zigzag":
            slots = zigzag_slots(cu, layout.cp_size, padded)
            self.ring_tokens = layout.head_parallel_size * slots.shape[1]
        else:
            self.placement = place_documents(cu, layout.context_size, layout.head_parallel_size,
                                             long_threshold=long_threshold, tolerance=tolerance)
            slots = documents_slots(self.placement, layout)
            self.ring_tokens = self.placement.long_prefix
        self.slots = slots                                   # [CP, t_local] numpy, every rank's
        received = views_of(slots, layout)                   # [cp, hp * t_local] as the all-to-all delivers them
        if mode == "zigzag" and layout.head_parallel_size > 1:
            # the ring takes each view sorted by stream index (padding last), so that every document's chunks
            # from the hp head ranks are contiguous and ascending: a few calls per document, not 2*hp
            self.ring_order: Optional[np.ndarray] = np.argsort(np.where(received < 0, np.iinfo(np.int64).max,
                                                                        received), axis=1, kind="stable")
            self.views = np.take_along_axis(received, self.ring_order, axis=1)
        else:                                                # the documents layout is built in ring order
            self.ring_order = None
            self.views = received                            # [cp, hp * t_local] each context rank's ring view
        fingerprint = zlib.crc32(cu.tobytes()) ^ (zlib.crc32(repr((mode, long_threshold, tolerance,
                                                                   None if padded is None else padded.tolist())
                                                                  ).encode()) << 31)
        _check_same_on_every_rank(groups, fingerprint, "cu_seqlens (or the layout options)")
        mine = torch.from_numpy(slots[groups.place.cp_index].copy())
        self._local_indices = mine
        self._plans: Dict[Tuple, Dict[int, Tuple[BlockCall, ...]]] = {}
        self.op_cache: dict = {}
        """attention_2d's setup for this layout (like ``Groups2D.op_cache``, but per batch)."""

    # -- tokens ------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        """T: real tokens of the packed batch (cu_seqlens[-1])."""
        return int(self.cu_seqlens[-1])

    @property
    def local_tokens(self) -> int:
        """t_local: slots per rank (real and padding)."""
        return int(self.slots.shape[1])

    @property
    def padding_fraction(self) -> float:
        """Padding slots / all slots over the CP group."""
        return float((self.slots < 0).sum()) / self.slots.size

    @property
    def max_document_length(self) -> int:
        return int(np.diff(self.cu_seqlens).max())

    def local_indices(self) -> torch.Tensor:
        """LongTensor [t_local] (CPU): the packed-stream index of each local slot, -1 for padding."""
        return self._local_indices.clone()

    def position_ids(self) -> torch.Tensor:
        """LongTensor [t_local] (CPU): each local token's position within its document (0 for padding)."""
        idx = self.slots[self.groups.place.cp_index]
        doc = np.searchsorted(self.cu_seqlens, np.maximum(idx, 0), side="right") - 1
        return torch.from_numpy(np.where(idx >= 0, idx - self.cu_seqlens[doc], 0))

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slots of the packed tensor ``x`` [T, ...] -> [t_local, ...]; padding slots are zero."""
        if x.shape[0] != self.total_tokens:
            raise ValueError(f"PackedLayout.shard: the tensor has {x.shape[0]} tokens along dim 0, but cu_seqlens "
                             f"describes T = {self.total_tokens}")
        idx = self._local_indices.to(x.device)
        out = x.index_select(0, idx.clamp(min=0))
        return out.masked_fill((idx < 0).view(-1, *([1] * (x.dim() - 1))), 0)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The packed tensor [T, ...] from the shards [t_local, ...] of CP ranks 0..CP-1 (padding dropped)."""
        if len(shards) != self.slots.shape[0]:
            raise ValueError(f"unshard needs one shard per CP rank ({self.slots.shape[0]}), got {len(shards)}")
        stacked = torch.cat(list(shards), dim=0)
        flat = torch.from_numpy(self.slots.reshape(-1)).to(stacked.device)
        real = flat >= 0
        out = stacked.new_zeros((self.total_tokens, *stacked.shape[1:]))
        out[flat[real]] = stacked[real]
        return out

    # -- load --------------------------------------------------------------------------------------
    def rank_pairs(self) -> np.ndarray:
        """[cp] causal attention pairs each context rank computes (its queries' visible keys)."""
        return row_pairs(self.views, self.cu_seqlens)

    def stats(self) -> Dict[str, float]:
        """Balance and padding: max/mean attention pairs and real tokens per context rank, padding fraction."""
        p = self.rank_pairs()
        t = (self.views >= 0).sum(axis=1)
        return {"pairs_max_over_mean": float(p.max() / max(p.mean(), 1)),
                "tokens_max_over_mean": float(t.max() / max(t.mean(), 1)),
                "padding_fraction": self.padding_fraction,
                "ring_tokens": self.ring_tokens, "view_tokens": int(self.views.shape[1]),
                "long_documents": (int(len(self.placement.long_docs)) if self.placement is not None
                                   else len(self.cu_seqlens) - 1)}

    # -- plans -------------------------------------------------------------------------------------
    def plans(self, causal: bool, window: SlidingWindow) -> Dict[int, Tuple[BlockCall, ...]]:
        """This context rank's kernel calls against every context rank's block (cached per mask)."""
        key = (causal, window)
        if key not in self._plans:
            me = self.groups.place.context_rank
            band = window.band(causal)
            runs = [document_runs(view, self.cu_seqlens) for view in self.views]
            calls = {src: plan_runs(runs[me], runs[src], band) for src in range(len(self.views))}
            for src, plan in calls.items():
                if src != me and any(c.k_end > self.ring_tokens for c in plan):
                    raise AssertionError(f"packed plan reads keys beyond the ring prefix {self.ring_tokens}")
            self._plans[key] = calls
        return self._plans[key]

    def __repr__(self) -> str:
        return (f"PackedLayout(mode={self.mode!r}, documents={len(self.cu_seqlens) - 1}, T={self.total_tokens}, "
                f"t_local={self.local_tokens}, padding={self.padding_fraction:.3f})")


__all__ = ["PackedLayout", "MODES"]
