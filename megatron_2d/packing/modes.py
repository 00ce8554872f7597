"""Packing modes: how one packed batch (THD) is laid out over a CP group, one class per mode, in one registry.

    zigzag     Megatron / Transformer Engine THD: every document padded to a multiple of 2*CP, CP rank i holds its
               chunks i and 2*CP-1-i; every document's K/V travel the whole ring (Megatron's per-document split)
    documents  short documents whole on one context rank (local attention, no ring traffic), long ones
               zigzag-sharded over the context ranks; the ring carries the long tokens only (our own data path)
    sequence   Megatron's per-sequence zigzag (``--dataloader-inter-document-masking``): the whole stream of T
               tokens (T divisible by 2*CP) cut into 2*CP chunks, CP rank i holding chunks i and 2*CP-1-i,
               documents masked; no padding, every token travels the ring

An instance is one batch in that mode (pure numpy, no torch; the sharding math is in :mod:`.sharding`, the views in
:mod:`.views`): every context rank's view as :class:`.calls.Runs` (from which the kernel calls follow), the view's
length and the prefix of it that travels the ring, which tokens a CP rank holds (:meth:`PackingMode.slots_of`) and
the order the head all-to-all delivers them in (:meth:`PackingMode.head_order`). The class answers what the mode
needs elsewhere: which of Megatron's batch splits gives it (``megatron_split``), whether Megatron's Mamba / GDN
layers can read its tokens (:meth:`PackingMode.ssm_problem`), its loss and launch rules, and what the planner models
(``planned``, ``stock``, its flags). :class:`megatron_2d.PackedSharding` (torch), the Megatron glue and the planner
consult these classes.

A new mode is a subclass decorated with :func:`register` (:mod:`megatron_2d.layout.registry`, the registry style of
kernels and transports too); a library mode's name is a member of :class:`megatron_2d.layout.choices.PackingMode`
(the flag's choices; checked here at import), a test's own mode is registered by the test
(tests/test_packed_attention.py registers one).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..layout.choices import PACKING_MODES, HeadUnit, MegatronSplit, Placement
from ..layout.choices import PackingMode as Mode
from ..layout.registry import Registry
from ..layout.topology import Layout2D
from .calls import Runs
from .sharding import DocumentSharding, PackingCost, documents_slots, sequence_rows, shard_documents, zigzag_rows
from .views import context_rank_of, materialise, sequence_runs, zigzag_runs, zigzag_view_len

MEGATRON_SPLITS = tuple(MegatronSplit)
"""Megatron's own splits of a THD batch over the CP ranks: per document (``get_batch_on_this_cp_rank`` of --sft
batches, Transformer Engine's partitioning) and per sequence (``use_per_sequence_balancing``, what
--dataloader-inter-document-masking without --sft runs)."""


class PackingMode:
    """One packed batch laid out in one mode over a 2D ``layout`` (see the module docstring); subclasses set the
    class attributes and :meth:`__init__`'s sharding.

    Attributes of an instance: ``cu_seqlens`` [D + 1] (int64), ``layout``, ``runs`` (every context rank's view, in
    the order its ring uses, sorted by (doc, pos)), ``view_len`` (slots of every view, hp * t_local),
    ``ring_tokens`` (the prefix of every view the ring carries: every key a context rank's queries see in another
    context rank's view lies in it; 0: nothing travels), ``long_documents`` (documents spread over the context
    ranks), ``sharding`` (the documents mode's :class:`.sharding.DocumentSharding`, else None)."""

    name: ClassVar[Mode]
    """The mode's name: ``PackedSharding(mode=)``, ``cp_2d_packing``, ``--cp-2d-packing``."""
    takes_padded_lengths: ClassVar[bool] = False
    """It lays documents out padded as Megatron's ``cu_seqlens_padded`` says
    (``PackedSharding(cu_seqlens_padded=)``)."""
    head_unit: ClassVar[HeadUnit] = HeadUnit.TOKEN
    """What :meth:`head_order` sorts: single tokens or zigzag chunks of equal length."""
    megatron_split: ClassVar[MegatronSplit | None] = None
    """Which of :data:`MEGATRON_SPLITS` gives batches in this layout; None: only this library's data path builds them
    (:mod:`megatron_2d.megatron.packed_data`), and each batch carries its layout."""
    data_path: ClassVar[str] = ""
    """Where batches of a mode without a Megatron split come from (named in the error for a batch that does not)."""
    token_weighted_loss: ClassVar[bool] = False
    """Its data path's loss weighs every token equally by itself (``packed_data.token_weighted_loss``), so uneven loss
    masks over the CP ranks need no --calculate-per-token-loss."""
    planned: ClassVar[bool] = False
    """The planner models 2D layouts in this mode (``python -m megatron_2d.plan --packed-lengths``)."""
    stock: ClassVar[bool] = False
    """The stock kinds (Transformer Engine's THD) run in this mode: the planner models them in it."""
    planner_flags: ClassVar[str] = ""
    """The Megatron flags the planner adds to a row in this mode."""
    planner_note: ClassVar[str] = ""
    """The planner's note on a 2D row in this mode."""

    runs: Runs
    view_len: int
    ring_tokens: int

    def __init__(
        self,
        cu_seqlens,
        layout: Layout2D,
        *,
        padded_lengths: np.ndarray | None = None,
        long_threshold: int | None = None,
        cost: PackingCost | None = None,
    ) -> None:
        """Lay out the batch of ``cu_seqlens`` over ``layout``; ``padded_lengths`` (modes that take them), or the
        documents mode's ``long_threshold`` and ``cost`` (see :func:`.sharding.shard_documents`); the other modes
        ignore them."""
        self.cu_seqlens = np.asarray(cu_seqlens, dtype=np.int64)
        self.layout = layout
        self.padded_lengths = padded_lengths
        self.sharding: DocumentSharding | None = None
        self.long_documents = len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def slots_of(self, cp_indices) -> np.ndarray:
        """[len(cp_indices), t_local] the slots of these CP ranks (stream index, -1 = padding), from the runs of
        their views: head rank hr of a context rank holds slice hr of its view (the views are in ring order)."""
        layout = self.layout
        idx = np.asarray(cp_indices, dtype=np.int64)
        hp, t_local = layout.head_parallel_size, self.view_len // layout.head_parallel_size
        cr = context_rank_of(layout, idx)
        hr = idx % hp if layout.placement == Placement.HEAD_FIRST else idx // layout.context_size
        wanted, row_view = np.unique(cr, return_inverse=True)  # the views asked for, materialised
        runs = self.runs.select(np.isin(self.runs.view, wanted))
        full = materialise(
            Runs(np.searchsorted(wanted, runs.view), runs.start, runs.length, runs.doc, runs.pos),
            self.cu_seqlens,
            len(wanted),
            self.view_len,
        )
        return full.reshape(len(wanted), hp, t_local)[row_view, hr]

    def all_slots(self) -> np.ndarray:
        """[CP, t_local] every CP rank's slots."""
        return self.slots_of(np.arange(self.layout.cp_size))

    def head_order(self, context_rank: int) -> np.ndarray | None:
        """At hp > 1: the order of context rank ``context_rank``'s head all-to-all, unit i of the ring's view
        being unit order[i] as received (by head rank, then zigzag half; units: ``head_unit``); None when the
        received order is the ring's (the views are built in it)."""
        return None

    @classmethod
    def ssm_problem(cls, layers: str) -> str | None:
        """Why Megatron's Mamba / GDN layers (``layers``, e.g. "Mamba (M) and GDN (G)") cannot run on tokens in this
        layout at CP > 1, or None. Their context parallelism reads THD batches in Megatron's per-document zigzag
        order; a mode that does not keep it refuses (the default)."""
        return (
            f"cp_2d_packing={cls.name!r} cannot run a model with {layers} layers: Megatron's Mamba/GDN context "
            f"parallelism reads THD batches in its per-document zigzag order, which the {cls.name} layout does not "
            f"keep; use cp_2d_packing='zigzag' (--cp-2d-packing zigzag, Megatron's THD split, e.g. --sft batches)"
        )

    @classmethod
    def launch_problem(cls, args) -> str | None:
        """Why a Megatron launch (``args``: megatron.training's parsed arguments) contradicts this mode, or None."""
        return None


MODES: Registry[type[PackingMode]] = Registry("packing mode", Mode, PackingMode, key="name", extras=True)
"""PackingMode (the enum) -> its class; names outside the enum are a test's own modes."""


def register(cls: type[PackingMode]) -> type[PackingMode]:
    """Class decorator: make ``cls``, a :class:`PackingMode` with a name not registered yet, a packing mode."""
    split = getattr(cls, "megatron_split", None)
    if split not in (None, *MEGATRON_SPLITS):
        raise ValueError(f"{cls.__qualname__}.megatron_split {split!r} is not one of {MEGATRON_SPLITS}")
    return MODES.register(cls)


def unregister(name: str) -> None:
    """Remove the mode ``name`` from the registry (a test's own mode, after the test)."""
    MODES.unregister(name)


def mode_names() -> tuple[str, ...]:
    """The registered modes' names: the library's in the enum's order, then a test's own in registration order."""
    return tuple(MODES)


def mode_class(name: str, setting: str = "packing mode") -> type[PackingMode]:
    """The mode registered as ``name``, or ValueError naming ``setting``, the value and the registered names: the
    one check of a packing mode's name, on every route (``PackedSharding(mode=)``, ``cp_2d_packing``, the flag)."""
    return MODES.lookup(name, setting)


def megatron_split_mode(split: str) -> type[PackingMode]:
    """The mode of Megatron's own ``split`` (one of :data:`MEGATRON_SPLITS`)."""
    return next(cls for cls in MODES.values() if cls.megatron_split == split)


@register
class ZigzagMode(PackingMode):
    """Megatron / Transformer Engine THD (:func:`.sharding.zigzag_rows`, :func:`.views.zigzag_runs`)."""

    name = Mode.ZIGZAG
    takes_padded_lengths = True
    megatron_split = MegatronSplit.PER_DOCUMENT
    planned = stock = True

    def __init__(self, cu_seqlens, layout: Layout2D, *, padded_lengths=None, long_threshold=None, cost=None) -> None:
        super().__init__(cu_seqlens, layout, padded_lengths=padded_lengths)
        cu, CP = self.cu_seqlens, layout.cp_size
        if padded_lengths is not None:
            real = np.diff(cu)
            padded = padded_lengths
            if padded.shape != real.shape or (padded < real).any() or (padded % (2 * CP)).any():
                raise ValueError(
                    f"cu_seqlens_padded must give every document a length that is a multiple of "
                    f"2*CP = {2 * CP} and at least its real length; got padded lengths "
                    f"{padded[:8].tolist()} for real lengths {real[:8].tolist()} (first 8)"
                )
        self.runs = zigzag_runs(cu, layout, padded_lengths)
        self.view_len = self.ring_tokens = zigzag_view_len(cu, layout, padded_lengths)

    def slots_of(self, cp_indices) -> np.ndarray:
        idx = np.asarray(cp_indices, dtype=np.int64)
        if self.layout.cp_size == 1 and self.padded_lengths is None:
            return np.tile(np.arange(self.total_tokens, dtype=np.int64), (len(idx), 1))
        return zigzag_rows(self.cu_seqlens, self.layout.cp_size, idx, self.padded_lengths)

    def head_order(self, context_rank: int) -> np.ndarray:
        """Single tokens: each document's chunks from the hp head ranks become contiguous (padding last)."""
        layout = self.layout
        received = self.slots_of(layout.index_of(np.arange(layout.head_parallel_size), context_rank)).reshape(-1)
        return np.argsort(np.where(received < 0, np.iinfo(np.int64).max, received), kind="stable")

    @classmethod
    def ssm_problem(cls, layers: str) -> None:
        return None  # Megatron's own order


@register
class DocumentsMode(PackingMode):
    """Short documents whole, long ones zigzag over the context ranks (:func:`.sharding.shard_documents`)."""

    name = Mode.DOCUMENTS
    data_path = (
        "megatron_2d.megatron.packed_data.documents_batch_on_this_cp_rank (examples/pretrain_gpt_2d.py does with "
        "--cp-2d-packing documents)"
    )
    token_weighted_loss = True
    planned = True
    planner_flags = " --cp-2d-packing documents --dataloader-inter-document-masking --no-rope-fusion"
    planner_note = "documents mode: run examples/pretrain_gpt_2d.py (its data path splits the batch)"

    def __init__(self, cu_seqlens, layout: Layout2D, *, padded_lengths=None, long_threshold=None, cost=None) -> None:
        super().__init__(cu_seqlens, layout)
        cp, hp = layout.context_size, layout.head_parallel_size
        self.sharding = shard_documents(self.cu_seqlens, cp, hp, long_threshold=long_threshold, cost=cost)
        self.runs = self.sharding.runs
        self.view_len, self.ring_tokens = self.sharding.view_len, self.sharding.long_prefix
        self.long_documents = int(len(self.sharding.long_docs))

    def all_slots(self) -> np.ndarray:
        return documents_slots(self.sharding, self.layout)

    @classmethod
    def ssm_problem(cls, layers: str) -> str:
        return (
            f"cp_2d_packing='documents' cannot run a model with {layers}"
            f" layers: Megatron's Mamba/GDN context parallelism reads tokens in its zigzag order, and the"
            f" documents layout keeps short documents whole on one context rank; use cp_2d_packing="
            f"'zigzag' (--cp-2d-packing zigzag, Megatron's THD split, e.g. --sft batches)"
        )


@register
class SequenceMode(PackingMode):
    """Megatron's per-sequence zigzag of the whole stream (:func:`.sharding.sequence_rows`,
    :func:`.views.sequence_runs`)."""

    name = Mode.SEQUENCE
    head_unit = HeadUnit.CHUNK
    megatron_split = MegatronSplit.PER_SEQUENCE

    def __init__(self, cu_seqlens, layout: Layout2D, *, padded_lengths=None, long_threshold=None, cost=None) -> None:
        super().__init__(cu_seqlens, layout)
        T, CP = self.total_tokens, layout.cp_size
        if T % (2 * CP):
            raise ValueError(
                f"the sequence mode cuts the packed stream into 2*CP = {2 * CP} equal chunks, as "
                f"Megatron's per-sequence split does, but it holds T = {T} tokens; pad "
                f"the packed sequence to a multiple of {2 * CP} (Megatron's --seq-length must be)"
            )
        self.runs = sequence_runs(self.cu_seqlens, layout)
        self.view_len = self.ring_tokens = T // layout.context_size

    def slots_of(self, cp_indices) -> np.ndarray:
        return sequence_rows(self.total_tokens, self.layout.cp_size, cp_indices)

    def head_order(self, context_rank: int) -> np.ndarray:
        """Chunks of T / 2CP: the sbhd path's order."""
        layout = self.layout
        indices = layout.index_of(np.arange(layout.head_parallel_size), context_rank)
        received = np.stack([indices, 2 * layout.cp_size - 1 - indices], axis=1).reshape(-1)  # chunk ids
        return np.argsort(received, kind="stable")

    @classmethod
    def ssm_problem(cls, layers: str) -> str:
        return (
            f"Megatron's per-sequence split of packed documents (--dataloader-inter-document-masking "
            f"without --sft) cannot run a model with {layers} layers: "
            f"Megatron's Mamba/GDN context parallelism reads THD batches in the per-document order; use "
            f"--sft batches (Megatron's per-document split)"
        )

    @classmethod
    def launch_problem(cls, args) -> str | None:
        if getattr(args, "sft", False):
            return (
                "--cp-2d-packing sequence describes Megatron's per-sequence split, but --sft batches are "
                "split per document (zigzag): drop --cp-2d-packing or --sft"
            )
        return None


if mode_names() != PACKING_MODES or MODES.missing():
    raise ImportError(
        f"the library's packing modes {mode_names()} are not megatron_2d.layout.choices.PACKING_MODES "
        f"{PACKING_MODES}: list a new mode's name there too"
    )

__all__ = [
    "MEGATRON_SPLITS",
    "MODES",
    "DocumentsMode",
    "PackingMode",
    "SequenceMode",
    "ZigzagMode",
    "megatron_split_mode",
    "mode_class",
    "mode_names",
    "register",
    "unregister",
]
