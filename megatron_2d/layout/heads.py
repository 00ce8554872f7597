"""How one rank's attention heads split over the head-parallel group: the one rule the op, the Megatron settings
and the planner share (pure Python).

hp ranks split hq query heads evenly only when hp divides hq. K/V heads (hkv, dividing hq as GQA needs) are
repeated r = lcm(hkv, hp) / hkv times so that each head rank gets whole K/V heads: L = r * hkv = lcm(hkv, hp) of
them in all, which is max(hkv, hp) whenever one divides the other (the paper's max(H_kv, d_hp)).

    >>> kv_replication(num_q_heads=32, num_kv_heads=8, head_parallel_size=16)
    2
    >>> replicated_kv_heads(8, 3)
    24
    >>> head_split_problem(6, 4)
    'head-parallel size 4 does not divide the 6 query heads on this rank; valid head-parallel sizes: [1, 2, 3, 6]'
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .topology import divisors


def valid_head_parallel_sizes(query_heads: int, sizes: Iterable[int] | None = None) -> list[int]:
    """The head-parallel sizes among ``sizes`` (None: every divisor of ``query_heads``) that split the heads evenly."""
    return [d for d in (divisors(query_heads) if sizes is None else sizes) if query_heads % d == 0]


def head_split_problem(
    query_heads: int,
    head_parallel_size: int,
    heads: str = "query heads on this rank",
    sizes: Iterable[int] | None = None,
    sizes_for: str = "",
) -> str | None:
    """None when ``head_parallel_size`` ranks split ``query_heads`` evenly, else why, naming the valid sizes.

    ``heads`` says which heads these are, ``sizes`` which sizes the caller could choose (None: every divisor of
    ``query_heads``), ``sizes_for`` what those sizes are for (appended to "valid head-parallel sizes")."""
    if query_heads % head_parallel_size == 0:
        return None
    valid = valid_head_parallel_sizes(query_heads, sizes)
    return (
        f"head-parallel size {head_parallel_size} does not divide the {query_heads} {heads}; "
        f"valid head-parallel sizes{sizes_for}: {valid}"
    )


def check_head_split(query_heads: int, head_parallel_size: int, **wording) -> None:
    """Raise ValueError with :func:`head_split_problem`'s reason when the heads do not split evenly."""
    problem = head_split_problem(query_heads, head_parallel_size, **wording)
    if problem:
        raise ValueError(problem)


def replicated_kv_heads(kv_heads: int, head_parallel_size: int) -> int:
    """L = lcm(hkv, hp): the K/V heads after replication (factor L / hkv), so that hp ranks each get whole heads."""
    return math.lcm(kv_heads, head_parallel_size)


def kv_replication(num_q_heads: int, num_kv_heads: int, head_parallel_size: int) -> int:
    """How many times each K/V head is repeated so that hp ranks split them evenly; raises if impossible."""
    hq, hkv, hp = num_q_heads, num_kv_heads, head_parallel_size
    check_head_split(hq, hp)
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} K/V heads; GQA needs hkv dividing hq")
    return replicated_kv_heads(hkv, hp) // hkv
