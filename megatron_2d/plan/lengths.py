"""Document-length distributions of packed batches (pure numpy): the benchmark's and the planner's inputs.

    document_lengths("lognormal", total=16384, seed=0)   # int64 lengths summing to exactly ``total``
    read_lengths("lengths.txt")                         # one length per line, or a JSON list

Distributions (every one deterministic for a seed, summing to exactly ``total``, every length >= 1):
    uniform     lengths uniform in [1, 2 * total / 32]: about 32 documents of similar size
    lognormal   heavy tail: lognormal with median total / 256 and sigma 2, each at most total / 2
    one-half    one document of total / 2 tokens at a random position, plus 200 short ones (uniform around
                the mean of the rest) sharing the other half
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

DISTRIBUTIONS = ("uniform", "lognormal", "one-half")
SEQUENCE_MIXES = ("long-tail", "equal")
"""Sequence-length mixes of one global batch (each sequence trained on its own, as hybrid CP runs them), for the
planner's ``--dynamic`` and tools/bench_dynamic.py (:func:`sequence_lengths`):

    long-tail   SFT-like: long sequences uniform in [total / 16, total / 8] until they hold a quarter of the
                tokens, the rest short ones uniform in [total / 256, total / 128], shuffled (at 256K tokens: a few
                of 16-32K among many of 1-2K)
    equal       every sequence total / 8 tokens (no tail and no packing waste: one CP size fits every sequence,
                and a static run packs one sequence per sample)
"""


def _fill(draw, total: int) -> np.ndarray:
    """Lengths from ``draw(n)`` until they reach ``total``; the last one is cut so that they sum to it."""
    out: list[int] = []
    acc = 0
    while acc < total:
        for x in draw(64):
            x = int(max(1, min(int(x), total - acc)))
            out.append(x)
            acc += x
            if acc >= total:
                break
    return np.asarray(out, dtype=np.int64)


def document_lengths(name: str, total: int, seed: int = 0) -> np.ndarray:
    """Document lengths of the named distribution (see the module docstring), summing to ``total``."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {name!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if isinstance(total, bool) or int(total) < 1:
        raise ValueError(f"the total token count must be a positive integer, got {total!r}")
    total = int(total)
    rng = np.random.default_rng(seed)
    if name == "uniform":
        hi = max(1, 2 * total // 32)
        return _fill(lambda n: rng.integers(1, hi + 1, size=n), total)
    if name == "lognormal":
        median = max(1.0, total / 256)
        cap = max(1, total // 2)
        return _fill(lambda n: np.minimum(np.ceil(rng.lognormal(np.log(median), 2.0, size=n)), cap), total)
    long = total // 2
    rest = total - long
    if rest == 0:
        return np.asarray([long], dtype=np.int64)
    count = min(200, rest)
    mean = rest / count
    short = _fill(lambda n: rng.integers(max(1, int(mean / 2)), max(1, int(1.5 * mean)) + 1, size=n), rest)
    at = int(rng.integers(0, len(short) + 1))
    return np.concatenate([short[:at], [long], short[at:]]).astype(np.int64)


def sequence_lengths(name: str, total: int, seed: int = 0) -> np.ndarray:
    """The sequence lengths of the named mix (:data:`SEQUENCE_MIXES`), int64, summing to exactly ``total`` (the last
    one cut), every length >= 1; deterministic for a seed."""
    if name not in SEQUENCE_MIXES:
        raise ValueError(f"unknown sequence mix {name!r}; choose one of {', '.join(SEQUENCE_MIXES)}")
    if isinstance(total, bool) or int(total) < 1:
        raise ValueError(f"the total token count must be a positive integer, got {total!r}")
    total = int(total)
    rng = np.random.default_rng(seed)
    long_lo, long_hi = max(1, total // 16), max(1, total // 8)
    if name == "equal":
        return _fill(lambda n: np.full(n, long_hi), total)
    long: list[int] = []
    while sum(long) < total // 4:  # whole long sequences (none cut) until a quarter of the tokens
        long.append(min(int(rng.integers(long_lo, long_hi + 1)), total - sum(long)))
    rest = total - sum(long)
    short = _fill(lambda n: rng.integers(max(1, total // 256), max(1, total // 128) + 1, size=n), rest) if rest else []
    return rng.permutation(np.concatenate([np.asarray(long, dtype=np.int64), short])).astype(np.int64)


def cu_seqlens_of(lengths: Sequence[int]) -> np.ndarray:
    """[0, L0, L0 + L1, ...] as int64."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])


def parse_lengths(text: str, source: str = "lengths") -> np.ndarray:
    """Document lengths from text: a JSON list, or one integer per line (blank lines and # comments skipped)."""
    stripped = text.strip()
    if stripped.startswith("["):
        values = json.loads(stripped)
    else:
        values = [line.split("#", 1)[0].strip() for line in stripped.splitlines()]
        values = [v for v in values if v]
    try:
        lengths = np.asarray([int(v) for v in values], dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: every document length must be an integer ({err})") from None
    if lengths.size == 0 or (lengths < 1).any():
        raise ValueError(f"{source}: need at least one document, every length >= 1")
    return lengths


def read_lengths(path: str) -> np.ndarray:
    """Document lengths from a file (see :func:`parse_lengths`)."""
    with open(path, encoding="utf-8") as fh:
        return parse_lengths(fh.read(), path)
