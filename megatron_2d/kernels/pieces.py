"""A band as pieces that kernels knowing only two masks run: no mask, and the causal square (pure Python).

cuDNN's fused attention, as PyTorch's ``aten::_cudnn_attention_forward`` and Transformer Engine's ``fused_attn_fwd``
expose it, takes no mask or a causal one. On a square box the causal mask is the same whichever corner it is
aligned to (cuDNN's is top-left, flash-attn's and TE's ``*_bottom_right`` bottom-right), so :func:`band_pieces`
cuts every band into

    full     rows x keys, every key visible
    causal   an n x n square, key j visible from query i iff j <= i
    anti     an n x n square, key j visible iff j >= i: the causal square with rows and keys reversed

that together hold each visible pair of the band exactly once. Pieces may share rows (their results merge by
log-sum-exp, their dQ add up) and keys (dK/dV add up). A one-sided band is at most three pieces; a two-sided band
of width W = hi - lo + 1 is cut into row tiles of W - 1 rows, each at most six pieces (two of them squares of
W - 1), so a window costs about 2 (s_q / (W - 1)) pieces and no piece computes a hidden pair outside its square.

    >>> band_pieces(Band(None, 0), 4, 4)
    [Piece(q_start=0, q_end=4, k_start=0, k_end=4, mask='causal')]
    >>> band_pieces(Band(None, 0), 4, 2)          # the rows below the square see both keys
    [Piece(q_start=0, q_end=2, k_start=0, k_end=2, mask='causal'), \
Piece(q_start=2, q_end=4, k_start=0, k_end=2, mask='full')]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.band import Band, Trimmed

MASKS = ("full", "causal", "anti")


@dataclass(frozen=True)
class Piece:
    """Rows [q_start, q_end) x keys [k_start, k_end) of a block, run with ``mask`` (one of :data:`MASKS`)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    mask: str

    @property
    def rows(self) -> int:
        return self.q_end - self.q_start

    @property
    def keys(self) -> int:
        return self.k_end - self.k_start


def band_pieces(band: Band | None, sq: int, sk: int) -> list[Piece]:
    """The visible pairs of an sq x sk block under ``band`` as pieces (block coordinates); empty when nothing is
    visible. A block that is one piece (no band, or the causal square) stays one."""
    box = Trimmed(0, sq, 0, sk, None) if band is None else band.trim(sq, sk)
    return [] if box is None else _pieces(box)


def whole_block_mask(pieces: list[Piece], sq: int, sk: int) -> str | None:
    """The mask of ``pieces`` when they are the whole block as one full or causal piece (one launch), else None."""
    if len(pieces) == 1 and (pieces[0].q_start, pieces[0].q_end, pieces[0].k_start, pieces[0].k_end) == (0, sq, 0, sk):
        return pieces[0].mask if pieces[0].mask != "anti" else None
    return None


def _size(box: Trimmed) -> tuple[int, int]:
    return box.q_end - box.q_start, box.k_end - box.k_start


def _part(box: Trimmed, r0: int, r1: int, c0: int, c1: int) -> Trimmed | None:
    """Rows [r0, r1) x keys [c0, c1) of ``box`` (box coordinates), trimmed, in the block's coordinates."""
    band = Band(None, None) if box.band is None else box.band
    part = band.shifted(r0, c0).trim(r1 - r0, c1 - c0)
    if part is None:
        return None
    qs, ks = box.q_start + r0, box.k_start + c0
    return Trimmed(qs + part.q_start, qs + part.q_end, ks + part.k_start, ks + part.k_end, part.band)


def _pieces(box: Trimmed) -> list[Piece]:
    nq, nk = _size(box)
    band = box.band
    if band is None:
        return [Piece(box.q_start, box.q_end, box.k_start, box.k_end, "full")]
    if band.lo is None:
        return _upper(box)
    if band.hi is None:
        return [_reflect(p, box) for p in _upper(_reflected(box))]
    tile = max(1, band.hi - band.lo)  # W - 1 rows: in a tile, no key is cut by both sides
    pieces = []
    for r0 in range(0, nq, tile):
        sub = _part(box, r0, min(nq, r0 + tile), 0, nk)
        if sub is None:
            continue
        if sub.band is None or sub.band.lo is None or sub.band.hi is None:
            pieces += _pieces(sub)
            continue
        sq_sub, sk_sub = _size(sub)
        split = min(
            sk_sub, max(0, sq_sub + sub.band.lo)
        )  # left of it no key is cut by the upper side, right of it none by the lower
        for c0, c1 in ((0, split), (split, sk_sub)):
            part = _part(sub, 0, sq_sub, c0, c1) if c0 < c1 else None
            if part is not None:
                assert part.band is None or part.band.lo is None or part.band.hi is None, (box, part)
                pieces += _pieces(part)
    return pieces


def _upper(box: Trimmed) -> list[Piece]:
    """A trimmed box whose band has only its upper side (j <= i + hi, hi >= 0): the keys left of hi (every row),
    the causal square from key hi, and the rows below the square (every key from hi)."""
    nq, nk = _size(box)
    hi = box.band.hi
    n = nk - hi  # <= nq in a trimmed box
    q0, k0 = box.q_start, box.k_start
    pieces = [Piece(q0, box.q_end, k0, k0 + hi, "full")] if hi > 0 else []
    pieces.append(Piece(q0, q0 + n, k0 + hi, box.k_end, "causal"))
    if n < nq:
        pieces.append(Piece(q0 + n, box.q_end, k0 + hi, box.k_end, "full"))
    return pieces


def _reflected(box: Trimmed) -> Trimmed:
    """``box`` with its rows and keys reversed, in its own coordinates: j - i >= lo becomes j' - i' <= nk - nq - lo."""
    nq, nk = _size(box)
    return Trimmed(0, nq, 0, nk, Band(None, nk - nq - box.band.lo))


def _reflect(piece: Piece, box: Trimmed) -> Piece:
    """A piece of :func:`_reflected` back in the block's coordinates (a causal square becomes an anti one)."""
    nq, nk = _size(box)
    mask = {"causal": "anti", "anti": "causal", "full": "full"}[piece.mask]
    return Piece(
        box.q_start + nq - piece.q_end,
        box.q_start + nq - piece.q_start,
        box.k_start + nk - piece.k_end,
        box.k_start + nk - piece.k_start,
        mask,
    )
