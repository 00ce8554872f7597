"""Which keys a query sees, as a band of key-minus-query offsets (pure Python, no torch).

Notation
    i, j    query row and key column, local to one kernel call (0-based, top-left aligned)
    lo, hi  the band: key j is visible from query i iff lo <= j - i <= hi; None = unbounded on that side
    Band(None, 0) on a square block is the causal mask; no band at all (None) means every key is visible.

A sliding window (left, right) in flash-attn's convention (query p sees keys p - left .. p + right, -1 =
unbounded; causal caps right at 0) over global token positions becomes, for a query block starting at global
position p0 and a key block starting at k0, the band lo = -left - (k0 - p0), hi = right - (k0 - p0).

    >>> Band(None, 0).trim(4, 4)                   # causal square: already tight
    Trimmed(q_start=0, q_end=4, k_start=0, k_end=4, band=Band(lo=None, hi=0))
    >>> Band(-1, 0).trim(4, 4)                     # window of 1 key back
    Trimmed(q_start=0, q_end=4, k_start=0, k_end=4, band=Band(lo=-1, hi=0))
    >>> Band(2, None).trim(4, 4)                   # keys at least 2 after the query: rows 0-1, keys 2-3
    Trimmed(q_start=0, q_end=2, k_start=2, k_end=4, band=Band(lo=0, hi=None))
    >>> Band(-10, 10).trim(4, 4).band is None      # wider than the block: every key visible
    True
    >>> Band(5, None).trim(4, 4) is None           # nothing visible
    True
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """Key j visible from query i iff lo <= j - i <= hi (local coordinates); None = unbounded."""

    lo: int | None
    hi: int | None

    def shifted(self, rows: int, cols: int) -> Band:
        """The same mask seen from an origin moved by ``rows`` queries and ``cols`` keys."""
        d = cols - rows
        return Band(None if self.lo is None else self.lo - d, None if self.hi is None else self.hi - d)

    def visible(self, i: int, j: int) -> bool:
        return (self.lo is None or j - i >= self.lo) and (self.hi is None or j - i <= self.hi)

    def trim(self, sq: int, sk: int) -> Trimmed | None:
        """The smallest query-rows x key-columns box of an sq x sk block holding every visible pair, with the band
        re-expressed from the box's origin (None when the whole box is visible). None if nothing is visible.

        Every row and column of the box has at least one visible entry, so no kernel row is fully masked."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None and lo > hi:
            return None
        q0 = 0 if hi is None else max(0, -hi)
        q1 = sq if lo is None else min(sq, sk - lo)
        if q0 >= q1:
            return None
        k0 = 0 if lo is None else max(0, q0 + lo)
        k1 = sk if hi is None else min(sk, q1 + hi)
        if k0 >= k1:
            return None
        band = self.shifted(q0, k0)
        nq, nk = q1 - q0, k1 - k0
        new_lo = None if band.lo is None or band.lo <= -(nq - 1) else band.lo
        new_hi = None if band.hi is None or band.hi >= nk - 1 else band.hi
        tight = None if new_lo is None and new_hi is None else Band(new_lo, new_hi)
        return Trimmed(q0, q1, k0, k1, tight)

    def is_causal_square(self, sq: int, sk: int) -> bool:
        """Whether this band is the plain causal mask of a square block (what every kernel does natively)."""
        return sq == sk and self.lo is None and self.hi == 0

    def flash_window(self, sq: int, sk: int) -> tuple[int, int]:
        """flash-attn's (window_left, window_right) for this band: its masks align to the bottom-right corner.

        On a trimmed box both are >= 0 or -1 (the last row sees the last column's neighbourhood)."""
        d = sk - sq
        left = -1 if self.lo is None else d - self.lo
        right = -1 if self.hi is None else self.hi - d
        if (self.lo is not None and left < 0) or (self.hi is not None and right < 0):
            raise ValueError(
                f"band {self} on a {sq}x{sk} block is not expressible as a flash-attn window "
                f"(left {left}, right {right}); trim it first"
            )
        return left, right


@dataclass(frozen=True)
class Trimmed:
    """Rows [q_start, q_end) x keys [k_start, k_end) of a block, with ``band`` from that box's origin."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    band: Band | None


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding window over global token positions, flash-attn's convention.

    Query p sees keys p - left .. p + right; -1 = unbounded. ``SlidingWindow(-1, -1)`` is no window.
    """

    left: int = -1
    right: int = -1

    def __post_init__(self) -> None:
        for name, value in (("left", self.left), ("right", self.right)):
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"sliding_window {name} must be an integer >= 0, or -1 for unbounded; got {value!r}")

    @classmethod
    def of(cls, window, causal: bool, seq_len: int) -> SlidingWindow:
        """Normalise a user's (left, right) (or None) for a sequence of ``seq_len`` tokens: bounds that cut
        nothing become -1, and a causal mask caps right at 0 (right must then be 0 or -1)."""
        if window is None:
            window = (-1, -1)
        if isinstance(window, SlidingWindow):
            window = (window.left, window.right)
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(
                f"sliding_window must be a pair (left, right) of token counts, -1 = unbounded; got {window!r}"
            ) from None
        win = cls(left, right)
        if causal and win.right not in (-1, 0):
            raise ValueError(
                f"sliding_window {(left, right)} looks {right} tokens ahead, but causal=True lets a "
                f"query see no later key; use right 0 (or -1), or causal=False"
            )
        right = 0 if causal else win.right
        left = -1 if win.left >= seq_len - 1 else win.left
        right = -1 if right >= seq_len - 1 else right
        return cls(left, right)

    @property
    def unbounded(self) -> bool:
        return self.left == -1 and self.right == -1

    def band(self, causal: bool) -> Band | None:
        """The global band (offsets key - query) of this window combined with causality; None = all keys."""
        lo = None if self.left == -1 else -self.left
        hi = 0 if causal else (None if self.right == -1 else self.right)
        return None if lo is None and hi is None else Band(lo, hi)
