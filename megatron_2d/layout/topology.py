"""Pure rank math for 2D context parallelism: no torch.distributed here.

Notation
    CP   size of one context-parallel group (a list of global ranks, Megatron's CP group)
    hp   head-parallel size: ranks in a head group (all-to-all over heads, Ulysses style)
    cp   context size = CP / hp: ranks in a context group (ring attention)
    w    inner ring size: context ranks per inner ring (Double-Ring); cp / w inner rings form the outer ring
    i    a rank's index in its CP rank list (its Megatron CP rank)
    hr   head rank: index inside the head group, 0 <= hr < hp
    cr   context rank: index inside the context group, 0 <= cr < cp

Placement maps (hr, cr) to i:
    head_first     i = cr * hp + hr   (a head group is hp adjacent ranks: the all-to-all stays on fast links)
    context_first  i = hr * cp + cr   (a context group is cp adjacent ranks: the ring stays on fast links)

Inner rings cut a context group by context rank: ring = cr // w, slot = cr % w.

    >>> layout = Layout2D(cp_size=8, head_parallel_size=2, inner_ring_size=2, placement="head_first")
    >>> layout.head_groups([0, 1, 2, 3, 4, 5, 6, 7])
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> layout.context_groups([0, 1, 2, 3, 4, 5, 6, 7])
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    >>> layout.inner_ring_groups([0, 1, 2, 3, 4, 5, 6, 7])
    [[0, 2], [4, 6], [1, 3], [5, 7]]
    >>> layout.outer_ring_groups([0, 1, 2, 3, 4, 5, 6, 7])
    [[0, 4], [2, 6], [1, 5], [3, 7]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .choices import PLACEMENTS, Placement


class LayoutError(ValueError):
    """An invalid 2D layout: the message names the offending values and what would be valid."""


def check_placement(placement, setting: str = "placement") -> Placement:
    """The :class:`Placement` ``placement`` names (one of :data:`PLACEMENTS`), else LayoutError naming ``setting``."""
    if placement not in PLACEMENTS:
        raise LayoutError(f"{setting} {placement!r} is not valid; choose one of {list(PLACEMENTS)}")
    return Placement(placement)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (the valid sizes every layout error lists)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def zigzag_chunks(cp_index: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk ids (of 2*CP) held by CP rank ``cp_index`` (Megatron's get_batch_on_this_cp_rank).

    >>> zigzag_chunks(cp_index=1, cp_size=4)
    (1, 6)
    """
    return cp_index, 2 * cp_size - 1 - cp_index


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout2D:
    """The shape of 2D context parallelism inside one CP group of ``cp_size`` ranks: ``head_parallel_size`` (hp),
    ``inner_ring_size`` (w, the Double-Ring inner ring size; None, the default: w = cp, one ring) and
    ``placement``.

    w = 1 and w = cp are the same ring (the same ranks in the same order, the same schedule and bytes; only the
    byte counter's label differs, outer_ring vs inner_ring); the default is the one ring of all cp ranks.

    >>> Layout2D(8, 2).inner_ring_size
    4
    """

    cp_size: int
    head_parallel_size: int
    inner_ring_size: int | None = None
    placement: Placement = Placement.HEAD_FIRST

    def __post_init__(self) -> None:
        CP, hp = self.cp_size, self.head_parallel_size
        for name, value in (("context-parallel size", CP), ("head-parallel size", hp)):
            _check_positive(name, value)
        object.__setattr__(self, "placement", check_placement(self.placement))  # a string becomes its member
        if CP % hp != 0:
            raise LayoutError(
                f"head-parallel size {hp} does not divide the context-parallel size {CP}; "
                f"valid head-parallel sizes for CP={CP}: {divisors(CP)}"
            )
        cp = CP // hp
        if self.inner_ring_size is None:
            object.__setattr__(self, "inner_ring_size", cp)  # one ring
        w = self.inner_ring_size
        _check_positive("inner ring size", w)
        if cp % w != 0:
            raise LayoutError(
                f"inner ring size {w} does not divide the context size cp = CP/hp = {CP}/{hp} = {cp}; "
                f"valid inner ring sizes: {divisors(cp)}"
            )

    @property
    def context_size(self) -> int:
        """cp: ranks in one context group (the ring)."""
        return self.cp_size // self.head_parallel_size

    @property
    def num_inner_rings(self) -> int:
        """cp / w: ranks in the outer ring."""
        return self.context_size // self.inner_ring_size

    # -- index maps -------------------------------------------------------------------------------
    def index_of(self, head_rank: int, context_rank: int) -> int:
        """CP index i of the rank at (hr, cr)."""
        if self.placement == Placement.HEAD_FIRST:
            return context_rank * self.head_parallel_size + head_rank
        return head_rank * self.context_size + context_rank

    def coords_of(self, index: int) -> tuple[int, int]:
        """(hr, cr) of CP index i."""
        if not 0 <= index < self.cp_size:
            raise LayoutError(f"CP index {index} is outside [0, {self.cp_size})")
        if self.placement == Placement.HEAD_FIRST:
            return index % self.head_parallel_size, index // self.head_parallel_size
        return index // self.context_size, index % self.context_size

    def send_peers(self, index: int) -> dict[str, list[int]]:
        """CP indices CP index i sends to, per path: 'a2a' the rest of its head group; 'inner' the next rank of its
        inner ring, (hr, ring*w + (slot+1) % w), when w > 1; 'outer' the next rank of its outer ring,
        (hr, (cr + w) % cp), when cp / w > 1.

        >>> Layout2D(cp_size=8, head_parallel_size=2, inner_ring_size=2).send_peers(0)
        {'a2a': [1], 'inner': [2], 'outer': [4]}
        """
        hp, cp, w = self.head_parallel_size, self.context_size, self.inner_ring_size
        hr, cr = self.coords_of(index)
        ring, slot = divmod(cr, w)
        return {
            "a2a": [self.index_of(h, cr) for h in range(hp) if h != hr],
            "inner": [self.index_of(hr, ring * w + (slot + 1) % w)] if w > 1 else [],
            "outer": [self.index_of(hr, (cr + w) % cp)] if cp // w > 1 else [],
        }

    # -- groups, as lists of CP indices ---------------------------------------------------------------
    def _head_group_indices(self) -> list[list[int]]:
        hp, cp = self.head_parallel_size, self.context_size
        return [[self.index_of(hr, cr) for hr in range(hp)] for cr in range(cp)]

    def _context_group_indices(self) -> list[list[int]]:
        hp, cp = self.head_parallel_size, self.context_size
        return [[self.index_of(hr, cr) for cr in range(cp)] for hr in range(hp)]

    def _inner_ring_indices(self) -> list[list[int]]:
        w = self.inner_ring_size
        return [ctx[k * w : (k + 1) * w] for ctx in self._context_group_indices() for k in range(self.num_inner_rings)]

    def _outer_ring_indices(self) -> list[list[int]]:
        w = self.inner_ring_size
        return [ctx[slot::w] for ctx in self._context_group_indices() for slot in range(w)]

    # -- groups, as lists of global ranks -----------------------------------------------------------
    def _map(self, cp_ranks: Sequence[int], groups: list[list[int]]) -> list[list[int]]:
        if len(cp_ranks) != self.cp_size:
            raise LayoutError(f"a CP rank list has {len(cp_ranks)} ranks, expected CP={self.cp_size}: {list(cp_ranks)}")
        return [[cp_ranks[i] for i in g] for g in groups]

    def head_groups(self, cp_ranks: Sequence[int]) -> list[list[int]]:
        """The cp head groups (hp ranks each, ordered by head rank) of one CP rank list."""
        return self._map(cp_ranks, self._head_group_indices())

    def context_groups(self, cp_ranks: Sequence[int]) -> list[list[int]]:
        """The hp context groups (cp ranks each, ordered by context rank)."""
        return self._map(cp_ranks, self._context_group_indices())

    def inner_ring_groups(self, cp_ranks: Sequence[int]) -> list[list[int]]:
        """The inner rings: w consecutive context ranks of each context group."""
        return self._map(cp_ranks, self._inner_ring_indices())

    def outer_ring_groups(self, cp_ranks: Sequence[int]) -> list[list[int]]:
        """The outer rings: the context ranks with the same slot in every inner ring (cp / w ranks each)."""
        return self._map(cp_ranks, self._outer_ring_indices())


def every_layout(cp_size: int) -> list[Layout2D]:
    """Every layout of a CP group of ``cp_size`` ranks, by hp, then w, then placement; the two placements are the
    same layout when hp or cp is 1 (listed once, as head_first).

    >>> [(l.head_parallel_size, l.inner_ring_size, l.placement) for l in every_layout(4)][:4]
    [(1, 1, 'head_first'), (1, 2, 'head_first'), (1, 4, 'head_first'), (2, 1, 'head_first')]
    """
    out = []
    for hp in divisors(cp_size):
        cp = cp_size // hp
        placements = PLACEMENTS if hp > 1 and cp > 1 else PLACEMENTS[:1]
        out.extend(Layout2D(cp_size, hp, w, p) for w in divisors(cp) for p in placements)
    return out


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the 2D layout of its CP group."""

    cp_ranks: tuple[int, ...]  # its CP rank list (global ranks)
    cp_index: int  # i, its Megatron CP rank
    head_rank: int  # hr
    context_rank: int  # cr
    head_group: tuple[int, ...]  # global ranks, by head rank
    context_group: tuple[int, ...]  # global ranks, by context rank
    inner_ring_group: tuple[int, ...]
    outer_ring_group: tuple[int, ...]


def validate_cp_rank_lists(cp_rank_lists: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """Check that the CP rank lists partition range(world_size) into equal-sized groups."""
    lists = [list(r) for r in cp_rank_lists]
    if not lists:
        raise LayoutError("cp_rank_lists is empty; give one list of global ranks per CP group")
    sizes = sorted({len(r) for r in lists})
    if len(sizes) != 1:
        raise LayoutError(f"CP rank lists have different sizes {sizes}; every CP group must have the same size")
    seen: dict[int, int] = {}
    for r in (x for lst in lists for x in lst):
        if not isinstance(r, int) or not 0 <= r < world_size:
            raise LayoutError(f"rank {r!r} in cp_rank_lists is not a valid rank of a world of size {world_size}")
        seen[r] = seen.get(r, 0) + 1
    repeated = sorted(r for r, n in seen.items() if n > 1)
    if repeated:
        raise LayoutError(f"ranks {repeated} appear more than once in cp_rank_lists; each rank belongs to one CP group")
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        raise LayoutError(
            f"ranks {missing} are missing from cp_rank_lists; together they must cover all {world_size} ranks"
        )
    return lists


def place_all_ranks(layout: Layout2D, cp_rank_lists: Sequence[Sequence[int]], world_size: int) -> dict[int, RankPlace]:
    """The RankPlace of every global rank, for every CP group."""
    lists = validate_cp_rank_lists(cp_rank_lists, world_size)
    if len(lists[0]) != layout.cp_size:
        raise LayoutError(f"CP groups have {len(lists[0])} ranks but the layout expects CP={layout.cp_size}")
    places: dict[int, RankPlace] = {}
    for cp_ranks in lists:
        heads = layout.head_groups(cp_ranks)
        ctxs = layout.context_groups(cp_ranks)
        intra = layout.inner_ring_groups(cp_ranks)
        inter = layout.outer_ring_groups(cp_ranks)
        group_of = {}
        for kind, groups in (("head", heads), ("context", ctxs), ("intra", intra), ("inter", inter)):
            for g in groups:
                for r in g:
                    group_of[(kind, r)] = tuple(g)
        for i, rank in enumerate(cp_ranks):
            hr, cr = layout.coords_of(i)
            places[rank] = RankPlace(
                cp_ranks=tuple(cp_ranks),
                cp_index=i,
                head_rank=hr,
                context_rank=cr,
                head_group=group_of[("head", rank)],
                context_group=group_of[("context", rank)],
                inner_ring_group=group_of[("intra", rank)],
                outer_ring_group=group_of[("inter", rank)],
            )
    return places
