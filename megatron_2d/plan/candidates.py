"""The layouts a planner compares: every 2D (hp, cp, w, placement) for a CP size and the stock baselines.

Kinds
    2d          this project: hp x cp, window w, head_first | context_first, K/V replicated when hp > Hkv
    p2p         Megatron/TE ring (zigzag), hp = 1, no window                       --cp-comm-type p2p
    a2a         Megatron/TE Ulysses, hp = CP; heads and KV heads divisible by CP  --cp-comm-type a2a
    a2a+p2p     Megatron/TE hierarchical: an a2a level of A adjacent ranks, a ring of CP/A; A divides heads
                and KV heads (no replication), no window
    ds-ulysses  DeepSpeed-Ulysses: all-to-all only, degree CP divides heads (and KV heads with GQA); no Megatron flag
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .hardware import ModelSpec, ParallelSpec
from .placement import PLACEMENTS

KINDS = ("2d", "p2p", "a2a", "a2a+p2p", "ds-ulysses")
STOCK_KINDS = KINDS[1:]


def divisors(n: int) -> List[int]:
    """Positive divisors of n, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class Layout:
    """One way to run attention over a CP group: ``kind`` with head-parallel size ``hp``, ring length ``cp``,
    window ``w`` (w == cp: one ring, no outer ring) and ``placement`` of the ranks."""

    kind: str
    hp: int
    cp: int
    w: int
    placement: str = "head_first"

    @property
    def cp_size(self) -> int:
        return self.hp * self.cp

    def label(self) -> str:
        if self.kind == "2d":
            return f"2d hp={self.hp} cp={self.cp} w={self.w} {self.placement}"
        if self.kind == "a2a+p2p":
            return f"a2a+p2p [{self.hp}, {self.cp}]"
        return f"{self.kind} (CP={self.cp_size})"


def check_layout(layout: Layout, model: ModelSpec, parallel: ParallelSpec, seq: int,
                 window: Optional[int] = None) -> Optional[str]:
    """None when ``layout`` can run, else the reason (naming the values and what would be valid).

    ``window``: a sliding window of that many tokens; Transformer Engine refuses it with p2p and a2a+p2p CP."""
    k, hp, cp, w = layout.kind, layout.hp, layout.cp, layout.w
    if window is not None and k in ("p2p", "a2a+p2p"):
        return f"Transformer Engine refuses sliding-window attention with {k} context parallelism (use a2a or 2d)"
    CP = parallel.cp_size
    if k not in KINDS:
        return f"unknown kind {k!r}; valid kinds: {', '.join(KINDS)}"
    for name, v in (("hp", hp), ("cp", cp), ("w", w)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{name} must be a positive integer, got {v!r}"
    if hp * cp != CP:
        return f"hp*cp = {hp}*{cp} = {hp * cp} != CP={CP}; valid hp: {divisors(CP)}"
    if layout.placement not in PLACEMENTS:
        return f"placement {layout.placement!r} is not one of {', '.join(PLACEMENTS)}"
    if cp % w:
        return f"window w={w} does not divide cp={cp}; valid w: {divisors(cp)}"
    Ht, Hkvt = model.heads // parallel.tp, model.kv_heads // parallel.tp
    chunks = CP if k == "ds-ulysses" else 2 * CP
    if seq % chunks:
        what = "CP" if k == "ds-ulysses" else "2*CP (zigzag: two chunks per rank)"
        return f"sequence length {seq} is not divisible by {what} = {chunks}; pad to {-(-seq // chunks) * chunks}"
    if Ht % hp:
        return (f"hp={hp} does not divide the {Ht} query heads per TP rank; valid hp: "
                f"{[h for h in divisors(CP) if Ht % h == 0]}")
    if k == "2d":
        return None
    if k == "p2p":
        return None if (hp, w) == (1, cp) else "p2p is hp=1 with a single ring (w=cp)"
    if k in ("a2a", "ds-ulysses"):
        if cp != 1:
            return f"{k} is all-to-all only: hp must be CP={CP}"
        if Hkvt % hp:
            who = "Megatron/TE" if k == "a2a" else "DeepSpeed-Ulysses"
            return (f"degree {hp} does not divide the {Hkvt} KV heads per TP rank ({who} does not replicate K/V; "
                    f"use 2d, which does)")
        return None
    # a2a+p2p
    if not 1 < hp < CP or w != cp or layout.placement != "head_first":
        return "a2a+p2p needs 1 < A < CP, a single ring (w = cp) and the a2a level on adjacent ranks"
    if Hkvt % hp:
        valid = [a for a in divisors(CP) if 1 < a < CP and Hkvt % a == 0 and Ht % a == 0]
        return (f"a2a size {hp} does not divide the {Hkvt} KV heads per TP rank (Megatron/TE do not replicate K/V); "
                f"valid a2a sizes: {valid or 'none (2d replicates K/V)'}")
    return None


def enumerate_layouts(model: ModelSpec, parallel: ParallelSpec) -> List[Layout]:
    """Every 2D layout for CP, then the baselines, including ones that ``check_layout`` will reject.

    For 2D, hp runs over the divisors of CP; an hp that does not divide the heads appears once (as an infeasible
    row). When hp == 1 or cp == 1 the two placements are the same layout, listed once as head_first.
    """
    CP = parallel.cp_size
    Ht = model.heads // parallel.tp
    out: List[Layout] = []
    for hp in divisors(CP):
        cp = CP // hp
        if Ht % hp:
            out.append(Layout("2d", hp, cp, cp))
            continue
        placements = PLACEMENTS if hp > 1 and cp > 1 else ("head_first",)
        for w in divisors(cp):
            out.extend(Layout("2d", hp, cp, w, p) for p in placements)
    out.append(Layout("p2p", 1, CP, CP))
    out.append(Layout("a2a", CP, 1, 1))
    out.extend(Layout("a2a+p2p", a, CP // a, CP // a) for a in divisors(CP) if 1 < a < CP)
    out.append(Layout("ds-ulysses", CP, 1, 1))
    return out


def megatron_flags(layout: Layout, parallel: ParallelSpec) -> str:
    """The pretrain_gpt.py arguments that select ``layout`` (TP/PP included when > 1)."""
    pre = ""
    if parallel.tp > 1:
        pre += f"--tensor-model-parallel-size {parallel.tp} "
    if parallel.pp > 1:
        pre += f"--pipeline-model-parallel-size {parallel.pp} "
    cp = f"{pre}--context-parallel-size {layout.cp_size}"
    if layout.kind == "2d":
        return (f"{cp} --cp-comm-type 2d --cp-2d-head-parallel-size {layout.hp} "
                f"--cp-2d-window-size {layout.w} --cp-2d-placement {layout.placement}")
    if layout.kind == "p2p":
        return f"{cp} --cp-comm-type p2p"
    if layout.kind == "a2a":
        return f"{cp} --cp-comm-type a2a"
    if layout.kind == "a2a+p2p":
        return f"{cp} --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes {layout.hp} {layout.cp}"
    return f"(no Megatron flag: DeepSpeed-Ulysses, sequence-parallel size {layout.cp_size} in DeepSpeed)"
