"""The Double-Ring schedule as data: one description that the ring loop executes and the planner replays.

Notation: a context group of cp ranks cut into nw = cp / w windows of w ranks; a rank is (window, slot).
Round o = 0..nw-1, step t = 0..w-1: the rank holds the K/V block of context rank source(o, t) =
(window - o, slot - t) (mod nw, mod w). Channels (one transfer of each in flight at a time, each on its own
process group): "inner_kv", "outer_kv" (K/V blocks), "inner_dkv", "outer_dkv" (dK/dV riders).

Forward, round o:  post outer_kv (the anchor, for the next round) | each step t: post inner_kv (the block, for
step t+1), compute, wait inner_kv | wait outer_kv.
Backward adds the riders, without ever waiting on a transfer that had no compute to hide behind, except the last:
  * a round's rider starts empty at step 0 on the anchor block, gathers each step's partial dK/dV and follows its
    block round the inner ring (post inner_dkv after each step, wait for the neighbour's at the next step); one more
    "aligning" hop (posted after the last step) brings it back to the slot where the round began;
  * the round is closed one step later, after step 0 of the next round has computed: wait for the aligning hop,
    add the rider carried over the outer ring for the same block from earlier rounds (posted a whole round ago),
    and post the sum to the next window, which holds that block as its anchor one round later (with w = 1 there
    is no aligning hop to hide, so a round closes in its own step);
  * after the last round the rider is closed and takes one last outer hop to its block's owner (exposed: there
    is nothing left to compute).
K/V moves cp - 1 times per rank; riders move nw * w times on the inner ring (w > 1) and nw times on the outer.

    >>> [e.kind for e in double_ring_events(cp=2, w=2, backward=False)]
    ['post_inner_kv', 'compute', 'wait_inner_kv', 'compute']
    >>> [e.kind for e in double_ring_events(cp=2, w=1, backward=True)]  # doctest: +NORMALIZE_WHITESPACE
    ['post_outer_kv', 'compute', 'start_rider', 'accumulate', 'hold_rider', 'post_carried', 'wait_outer_kv',
     'compute', 'start_rider', 'accumulate', 'hold_rider', 'wait_carried', 'post_carried', 'wait_final']
    >>> [e.source_offset for e in double_ring_events(cp=4, w=2, backward=False) if e.kind == "compute"]
    [(0, 0), (0, 1), (1, 0), (1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

# event kind -> the channel it posts on or waits for (None: local work)
CHANNEL_OF = {
    "post_inner_kv": "inner_kv", "wait_inner_kv": "inner_kv", "post_outer_kv": "outer_kv", "wait_outer_kv": "outer_kv",
    "wait_rider": "inner_dkv", "post_rider": "inner_dkv", "wait_aligning": "inner_dkv",
    "wait_carried": "outer_dkv", "post_carried": "outer_dkv", "wait_final": "outer_dkv",
    "compute": None, "start_rider": None, "accumulate": None, "hold_rider": None,
}


@dataclass(frozen=True)
class Event:
    """One action of a rank: ``kind`` (see CHANNEL_OF); for ``compute`` the (round, step) of its block."""

    kind: str
    source_offset: Optional[Tuple[int, int]] = None

    @property
    def channel(self) -> Optional[str]:
        return CHANNEL_OF[self.kind]


def _close(nw: int, w: int, closed_round: int, last: bool):
    """Close round ``closed_round``: collect its rider, add what earlier rounds carried, pass it on."""
    if w > 1:
        yield Event("wait_aligning")
    if nw > 1:
        if closed_round >= 1:
            yield Event("wait_carried")
        yield Event("post_carried")
        if last:
            yield Event("wait_final")


@lru_cache(maxsize=None)
def double_ring_events(cp: int, w: int, backward: bool) -> Tuple[Event, ...]:
    """Every action of one rank, in program order (the same on every rank)."""
    if cp < 1 or w < 1 or cp % w:
        raise ValueError(f"window {w} must divide the context size {cp}")
    nw = cp // w
    ev = []
    for o in range(nw):
        if o < nw - 1:
            ev.append(Event("post_outer_kv"))
        for t in range(w):
            if t < w - 1:
                ev.append(Event("post_inner_kv"))
            ev.append(Event("compute", (o, t)))
            if backward:
                if t == 0 and o > 0 and w > 1:
                    ev.extend(_close(nw, w, o - 1, last=False))
                ev.append(Event("start_rider" if t == 0 else "wait_rider"))
                ev.append(Event("accumulate"))
                ev.append(Event("post_rider" if w > 1 else "hold_rider"))
                if w == 1:          # no inner ring, no aligning hop to hide: close the round at once
                    ev.extend(_close(nw, w, o, last=o == nw - 1))
            if t < w - 1:
                ev.append(Event("wait_inner_kv"))
        if o < nw - 1:
            ev.append(Event("wait_outer_kv"))
    if backward and w > 1:
        ev.extend(_close(nw, w, nw - 1, last=True))
    return tuple(ev)


def replay(events, compute_s: float, transfer_s, link_of) -> float:
    """Seconds one rank takes to run ``events``: compute takes ``compute_s``; a post starts when its link
    (``link_of[channel]``) is free and lasts ``transfer_s[channel]``; a wait blocks until that transfer is done.
    Every rank runs the same events at the same times, so one rank's replay is the whole group's."""
    now = 0.0
    link_free = {}
    done = {}
    for e in events:
        if e.kind == "compute":
            now += compute_s
        elif e.kind.startswith("post_"):
            link = link_of[e.channel]
            start = max(now, link_free.get(link, 0.0))
            link_free[link] = done[e.channel] = start + transfer_s[e.channel]
        elif e.channel is not None:
            now = max(now, done[e.channel])
    return now
