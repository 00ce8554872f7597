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

        Raises ValueError where flash-attn's kernels would run another mask (:func:`flash_expressible`): a side
        < 0 (an untrimmed band), or a box taller than its window lets them keep (split it with
        :func:`flash_boxes`)."""
        d = sk - sq
        left = -1 if self.lo is None else d - self.lo
        right = -1 if self.hi is None else self.hi - d
        if (self.lo is not None and left < 0) or (self.hi is not None and right < 0):
            raise ValueError(
                f"band {self} on a {sq}x{sk} block is not expressible as a flash-attn window "
                f"(left {left}, right {right}); trim it first"
            )
        if not flash_expressible(self, sq, sk):
            raise ValueError(
                f"band {self} on a {sq}x{sk} block is not expressible as a flash-attn window "
                f"(left {left}, right {right}): flash-attn's kernels would run another mask on it; split it "
                f"with flash_boxes"
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


def flash_expressible(band: Band | None, sq: int, sk: int) -> bool:
    """Whether flash-attn's kernels (flash-attn 2.5 to 2.8 and PyTorch's copy of them, dense and varlen) run
    ``band`` on an sq x sk block as its (causal, window) says: no band, the causal square, or a window
    (:meth:`Band.flash_window`) that their C++ keeps.

    Their ``flash_api.cpp`` turns a window side >= seqlen_k (varlen: >= max_seqlen_k) into -1, and then
    (``set_params_fprop``) sets a -1 side to seqlen_k (varlen: max_seqlen_k) when the other side is bounded. A
    left side of seqlen_k or more hides no key of the block, so neither step changes it. A right side R hides
    keys only on a block of more than R + 1 queries; there, R >= seqlen_k shows the rows every later key (left
    side unbounded) or, R having become seqlen_k, fewer keys than R (left side bounded), and an unbounded right
    side next to a bounded left one becomes seqlen_k. So, with left = sk - sq - lo and right = hi - (sk - sq)
    (both >= 0 on a trimmed box):
        left bounded    left < sk
        right bounded   right < sk
        right -1        sq <= sk + 1 when the left side is bounded
    Each holds for a varlen group's max_seqlen_k if it holds for the call's own sk (max_seqlen_k >= sk)."""
    if band is None or band.is_causal_square(sq, sk):
        return True
    d = sk - sq
    if band.lo is not None and not 0 <= d - band.lo < sk:
        return False
    if band.hi is not None:
        return 0 <= band.hi - d < sk
    return band.lo is None or sq <= sk + 1


def flash_boxes(band: Band | None, sq: int, sk: int) -> list[Trimmed]:
    """The visible pairs of an sq x sk block under ``band``, as trimmed boxes (block coordinates) that flash-attn's
    kernels run as given (:func:`flash_expressible`): the block's own trimmed box when they can, else its rows
    split where a side of the band stops cutting. Every visible pair is in exactly one box, every row of the box
    in one piece (so pieces never need merging). Empty when nothing is visible.

    In a trimmed box of nq x nk with band (lo, hi), rows [0, a) with a = nk - 1 - hi are the ones the right side
    cuts, rows [b, nq) with b = 1 - lo the ones the left side cuts, and rows in between see every key. The top
    rows run with the band (their last row sees the box's last key: right 0), the middle rows as one full box,
    the bottom rows with the left side alone (no more rows than keys); neighbouring pieces are joined where the
    join still runs as given.

        >>> flash_boxes(Band(None, 0), 4, 2)      # the first row must not see key 1
        [Trimmed(q_start=0, q_end=1, k_start=0, k_end=1, band=None), \
Trimmed(q_start=1, q_end=4, k_start=0, k_end=2, band=None)]
        >>> flash_boxes(Band(-4, 4), 8, 8)        # square: one box
        [Trimmed(q_start=0, q_end=8, k_start=0, k_end=8, band=Band(lo=-4, hi=4))]
    """
    box = Trimmed(0, sq, 0, sk, None) if band is None else band.trim(sq, sk)
    if box is None:
        return []
    nq, nk = box.q_end - box.q_start, box.k_end - box.k_start
    if flash_expressible(box.band, nq, nk):
        return [box]
    lo, hi = box.band.lo, box.band.hi
    a = 0 if hi is None else nk - 1 - hi
    b = nq if lo is None else max(a, 1 - lo)
    for cuts in ((0, a, nq), (0, b, nq), (0, a, b, nq)):
        pieces = [_rows_of(box, r0, r1) for r0, r1 in zip(cuts, cuts[1:]) if r0 < r1]
        if all(flash_expressible(p.band, p.q_end - p.q_start, p.k_end - p.k_start) for p in pieces):
            return pieces
    raise AssertionError(f"flash_boxes: no split of {box} runs as given")  # unreachable: the three pieces do


def _rows_of(box: Trimmed, r0: int, r1: int) -> Trimmed:
    """Rows [r0, r1) of a trimmed box (box coordinates) as their own trimmed box, in the block's coordinates."""
    nk = box.k_end - box.k_start
    part = box.band.shifted(r0, 0).trim(r1 - r0, nk) if box.band is not None else Trimmed(0, r1 - r0, 0, nk, None)
    return Trimmed(
        box.q_start + r0 + part.q_start,
        box.q_start + r0 + part.q_end,
        box.k_start + part.k_start,
        box.k_start + part.k_end,
        part.band,
    )
