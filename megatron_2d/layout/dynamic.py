"""Dynamic (hybrid) context parallelism as pure rank math: the group sizes Megatron builds, their rank slices, the
CP size Megatron gives a sequence, and the 2D layout each group size runs (standard library only).

Megatron's hybrid context parallelism (``--hybrid-context-parallel``, megatron-core 0.19) gives every sequence of a
global batch its own CP group: a contiguous slice of the DP x CP rank list (N ranks) of size g, where g is the
power of two ``max(1, 2^ceil(log2(L / max_seqlen_per_dp_cp_rank)))`` for a sequence of L tokens. It builds the
slices of sizes 2, 4, ..., below N (``parallel_state.create_hybrid_dp_cp_groups``) and uses the whole DP x CP group
for g = N; g = 1 needs no group. The 2d backend runs each size with its own head x context layout.

    >>> hybrid_group_sizes(8)
    (1, 2, 4, 8)
    >>> hybrid_group_sizes(6)
    (1, 2, 6)
    >>> hybrid_slices([0, 1, 2, 3, 4, 5, 6, 7], 4)
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> megatron_cp_size(length=3000, max_seqlen_per_rank=1024)
    4

Per-size layouts are written as ``SIZE=HP[xCP][/W][@PLACEMENT]`` entries separated by commas (the flag
``--cp-2d-dynamic-layouts``): hp ranks per head group, cp = SIZE / hp ranks per context ring (checked when given),
inner ring size W (default cp, one ring), placement (default the run's ``--cp-2d-placement``).

    >>> layouts = parse_dynamic_layouts("2=2,8=2x4/2@context_first")
    >>> layouts[8]
    Layout2D(cp_size=8, head_parallel_size=2, inner_ring_size=2, placement='context_first')
    >>> format_dynamic_layouts(layouts)
    '2=2x1,8=2x4/2@context_first'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .choices import PLACEMENTS
from .topology import Layout2D, LayoutError, check_placement, divisors

FLAG = "--cp-2d-dynamic-layouts"


def hybrid_group_sizes(dp_cp_size: int) -> tuple[int, ...]:
    """The CP sizes a sequence can get among ``dp_cp_size`` ranks: 1 (no group), the powers of two 2, 4, ... below
    2^floor(log2 N) that megatron-core 0.19.2 builds groups of, and N itself (its whole DP x CP group)."""
    if isinstance(dp_cp_size, bool) or not isinstance(dp_cp_size, int) or dp_cp_size < 1:
        raise LayoutError(f"the data-parallel x context-parallel size must be a positive integer, got {dp_cp_size!r}")
    built = [2**i for i in range(int(math.log2(dp_cp_size)))][1:]  # parallel_state.create_hybrid_dp_cp_groups
    return tuple(sorted({1, *built, dp_cp_size}))


def hybrid_slices(dp_cp_ranks: Sequence[int], size: int) -> list[list[int]]:
    """The groups of ``size`` ranks of one DP x CP rank list: contiguous slices, in order."""
    ranks = list(dp_cp_ranks)
    if size < 1 or len(ranks) % size:
        raise LayoutError(f"group size {size} does not divide the {len(ranks)} ranks of the DP x CP group {ranks}")
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def megatron_cp_size(length: int, max_seqlen_per_rank: int) -> int:
    """The CP size Megatron's BalancedCPScheduler gives a sequence of ``length`` tokens (``gpus_needed``):
    max(1, 2^ceil(log2(length / max_seqlen_per_rank)))."""
    if max_seqlen_per_rank < 1:
        raise LayoutError(f"max_seqlen_per_dp_cp_rank must be positive, got {max_seqlen_per_rank!r}")
    return max(1, 2 ** math.ceil(math.log2(length / max_seqlen_per_rank)))


def _entry(text: str, placement: str) -> tuple[int, Layout2D]:
    """One ``SIZE=HP[xCP][/W][@PLACEMENT]`` entry."""
    spec = text.strip()
    where = f"{FLAG} entry {spec!r}"
    if "=" not in spec:
        raise LayoutError(f"{where}: write SIZE=HP[xCP][/W][@PLACEMENT], e.g. 8=2x4/2")
    size_text, rest = spec.split("=", 1)
    if "@" in rest:
        rest, placement = rest.split("@", 1)
        check_placement(placement, f"{where}: placement")
    ring = None
    if "/" in rest:
        rest, ring = rest.split("/", 1)
    parts = rest.split("x")
    numbers = [size_text, *parts] + ([ring] if ring is not None else [])
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) > 0 for p in numbers):
        raise LayoutError(f"{where}: SIZE, HP, CP and W must be positive integers (SIZE=HP[xCP][/W][@PLACEMENT])")
    size, hp = int(size_text), int(parts[0])
    if len(parts) == 2 and hp * int(parts[1]) != size:
        raise LayoutError(
            f"{where}: hp x cp = {hp} x {parts[1]} = {hp * int(parts[1])} is not the group size {size}; "
            f"choose hp among {divisors(size)}"
        )
    try:
        return size, Layout2D(size, hp, None if ring is None else int(ring), placement)
    except LayoutError as err:
        raise LayoutError(f"{where}: {err}") from None


def parse_dynamic_layouts(text: str | None, placement: str = PLACEMENTS[0]) -> dict[int, Layout2D]:
    """The per-size layouts of ``text`` (see the module docstring; None or "" gives none), each checked; a size
    given twice is refused. ``placement``: the placement of entries that name none."""
    if not text or not text.strip():
        return {}
    layouts: dict[int, Layout2D] = {}
    for item in text.split(","):
        size, layout = _entry(item, placement)
        if size in layouts:
            raise LayoutError(f"{FLAG} gives group size {size} twice ({text!r}); give each size once")
        layouts[size] = layout
    return dict(sorted(layouts.items()))


def format_dynamic_layouts(layouts: Mapping[int, Layout2D], placement: str = PLACEMENTS[0]) -> str:
    """``layouts`` in the flag's syntax (sizes ascending; the inner ring and placement only when not the default
    one ring and ``placement``); parse_dynamic_layouts reads it back."""
    entries = []
    for size, layout in sorted(layouts.items()):
        entry = f"{size}={layout.head_parallel_size}x{layout.context_size}"
        if layout.inner_ring_size != layout.context_size:
            entry += f"/{layout.inner_ring_size}"
        if layout.placement != placement:
            entry += f"@{layout.placement}"
        entries.append(entry)
    return ",".join(entries)


def check_dynamic_sizes(layouts: Mapping[int, Layout2D], sizes: Sequence[int]) -> None:
    """LayoutError when ``layouts`` names a size that is not one of ``sizes`` (the group sizes of the run)."""
    unknown = sorted(set(layouts) - set(sizes))
    if unknown:
        raise LayoutError(
            f"{FLAG} gives layouts for group sizes {unknown}, which this run has no groups of; its group sizes "
            f"are {list(sizes)} (1, the powers of two Megatron builds, and the whole DP x CP group)"
        )
