"""The Double-Ring schedule as data: one description that the ring loop executes and the planner replays.

Notation: a context group of cp ranks cut into nw = cp / w inner rings of w ranks; a rank is (ring, slot), context
rank ring * w + slot. Round o = 0..nw-1, step t = 0..w-1: the rank holds the K/V block of context rank
source(o, t) = (ring - o, slot - t) (mod nw, mod w). Channels (one transfer of each in flight at a time, each on
its own process group): "inner_kv", "outer_kv" (K/V blocks), "inner_dkv", "outer_dkv", "final_dkv" (dK/dV
riders).

Forward, round o:  post outer_kv (the anchor, for the next round) | each step t: post inner_kv (the block, for
step t+1), compute, wait inner_kv | wait outer_kv.
Backward adds the riders; no transfer is awaited before one compute has run since it was posted, except the last:
  * the receive of the last hop is expected before anything else (a transport that can post it early lets the
    rider land whenever its sender is ready, whatever this rank is doing);
  * the own block's partial dK/dV (round 0, step 0) stays home: it is kept aside and added onto the rider of the
    last hop when that lands (no copy into an accumulator of its own);
  * every other round's rider starts empty at step 0 on the anchor block (round 0's at step 1), gathers each
    step's partial dK/dV and follows its block round the inner ring (post inner_dkv after each step but the last,
    wait for the neighbour's at the next step); it ends the round on the rank that computed the block's last step,
    (ring, slot) for the block of (ring - o, slot + 1);
  * that rank closes the round: it adds the rider carried over the outer ring for the same block from earlier
    rounds (posted a whole round ago by (ring - 1, slot), which ended round o - 1 on the same block) and posts
    the sum to (ring + 1, slot), which ends round o + 1 on that block (with w = 1, round 0 is the own block
    alone: no rider, nothing carried into round 1; and a round is one step, so from round 2 on the rank takes
    the carried rider before accumulating and adds the step's partials straight into it: no rider of its own);
  * after the last round the closed rider takes one hop, exposed (nothing is left to compute), to its block's
    owner (ring + 1, slot + 1), who adds it to the home accumulator: a direct send over the context group on a
    channel of its own ("final_dkv"), which crosses the outer links unless w = cp (:func:`final_hop_link`).
No rider ever travels back to where its round began. K/V moves cp - 1 times per rank, and so do the riders (as in
Transformer Engine's ring): (nw - 1) * (w - 1) + max(w - 2, 0) inner hops, nw - 1 - [w = 1] outer hops and the
last hop.

    >>> [e.kind.value for e in double_ring_events(cp=2, w=2, backward=False)]
    ['post_inner_kv', 'compute', 'wait_inner_kv', 'compute']
    >>> [e.kind.value for e in double_ring_events(cp=2, w=1, backward=True)]  # doctest: +NORMALIZE_WHITESPACE
    ['expect_final', 'post_outer_kv', 'compute', 'wait_outer_kv',
     'compute', 'start_rider', 'accumulate', 'post_final', 'wait_final', 'accumulate_home']
    >>> [e.source_offset for e in double_ring_events(cp=4, w=2, backward=False) if e.kind is EventKind.COMPUTE]
    [(0, 0), (0, 1), (1, 0), (1, 1)]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cache

from .choices import StrEnum


class Channel(StrEnum):
    """A transfer channel of the Double-Ring (one transfer of each in flight at a time, each on its own group)."""

    INNER_KV = "inner_kv"
    OUTER_KV = "outer_kv"
    INNER_DKV = "inner_dkv"
    OUTER_DKV = "outer_dkv"
    FINAL_DKV = "final_dkv"


CHANNELS = tuple(Channel)


class EventKind(enum.StrEnum):
    """One kind of action in the schedule. A member equals its value (a str), which names it in docs and logs."""

    EXPECT_FINAL = "expect_final"  # post the receive of the last hop's rider ahead (where the backend can)
    POST_OUTER_KV = "post_outer_kv"  # send the anchor block to the next inner ring, receive the previous one's
    WAIT_OUTER_KV = "wait_outer_kv"  # the next round's anchor has arrived
    POST_INNER_KV = "post_inner_kv"  # send the block round the inner ring, receive the next step's
    WAIT_INNER_KV = "wait_inner_kv"  # the next step's block has arrived
    COMPUTE = "compute"  # attention of this rank's queries on the block it holds
    ACCUMULATE_HOME = "accumulate_home"  # own block's partials + the last hop's rider: this rank's dK/dV
    START_RIDER = "start_rider"  # the step's partials start a new rider
    WAIT_RIDER = "wait_rider"  # the neighbour's rider for the held block has arrived
    ACCUMULATE = "accumulate"  # add the step's partials into the rider
    POST_RIDER = "post_rider"  # pass the rider on round the inner ring (with its block)
    WAIT_CARRIED = "wait_carried"  # the rider carried over the outer ring has arrived: add it
    TAKE_CARRIED = "take_carried"  # the carried rider has arrived: it becomes the rider (w = 1)
    POST_CARRIED = "post_carried"  # carry the closed rider over the outer ring to the next inner ring
    POST_FINAL = "post_final"  # the last hop: the closed rider to its block's owner
    WAIT_FINAL = "wait_final"  # the rider of this rank's own block has arrived

    @property
    def channel(self) -> Channel | None:
        """The channel it posts on, expects a receive on or waits for (None: local work)."""
        return CHANNEL_OF[self]

    @property
    def posts(self) -> bool:
        """Whether it posts a transfer (send and receive) on its channel."""
        return self in _POSTS

    @property
    def expects(self) -> bool:
        """Whether it only posts a receive ahead (the transfer is posted and awaited by other events)."""
        return self is EventKind.EXPECT_FINAL

    @property
    def waits(self) -> bool:
        """Whether it waits for its channel's transfer in flight."""
        return self.channel is not None and not self.posts and not self.expects


_K = EventKind
# event kind -> the channel it posts on, expects a receive on or waits for (None: local work)
CHANNEL_OF = {
    _K.POST_INNER_KV: Channel.INNER_KV,
    _K.WAIT_INNER_KV: Channel.INNER_KV,
    _K.POST_OUTER_KV: Channel.OUTER_KV,
    _K.WAIT_OUTER_KV: Channel.OUTER_KV,
    _K.WAIT_RIDER: Channel.INNER_DKV,
    _K.POST_RIDER: Channel.INNER_DKV,
    _K.WAIT_CARRIED: Channel.OUTER_DKV,
    _K.TAKE_CARRIED: Channel.OUTER_DKV,
    _K.POST_CARRIED: Channel.OUTER_DKV,
    _K.EXPECT_FINAL: Channel.FINAL_DKV,
    _K.POST_FINAL: Channel.FINAL_DKV,
    _K.WAIT_FINAL: Channel.FINAL_DKV,
    _K.COMPUTE: None,
    _K.ACCUMULATE_HOME: None,
    _K.START_RIDER: None,
    _K.ACCUMULATE: None,
}
_POSTS = frozenset({_K.POST_INNER_KV, _K.POST_OUTER_KV, _K.POST_RIDER, _K.POST_CARRIED, _K.POST_FINAL})


class Link(StrEnum):
    """Which links a hop crosses: an inner ring's (within a node, typically) or an outer ring's."""

    INNER = "inner"
    OUTER = "outer"


def final_hop_link(cp: int, w: int) -> Link:
    """The links the last hop, (ring, slot) -> (ring + 1, slot + 1), crosses: inner when there is one inner ring
    (it is the inner ring's next rank), else outer (it leaves its inner ring)."""
    return Link.INNER if w == cp else Link.OUTER


@dataclass(frozen=True)
class Event:
    """One action of a rank: its ``kind``; for a compute the (round, step) of its block."""

    kind: EventKind
    source_offset: tuple[int, int] | None = None

    @property
    def channel(self) -> Channel | None:
        return self.kind.channel


@cache
def double_ring_events(cp: int, w: int, backward: bool) -> tuple[Event, ...]:
    """Every action of one rank, in program order (the same on every rank)."""
    if cp < 1 or w < 1 or cp % w:
        raise ValueError(f"inner ring size {w} must divide the context size {cp}")
    nw = cp // w
    ev = [Event(_K.EXPECT_FINAL)] if backward and cp > 1 else []
    for o in range(nw):
        if o < nw - 1:
            ev.append(Event(_K.POST_OUTER_KV))
        for t in range(w):
            if t < w - 1:
                ev.append(Event(_K.POST_INNER_KV))
            ev.append(Event(_K.COMPUTE, (o, t)))
            if backward and (o, t) == (0, 0):
                if cp == 1:
                    ev.append(Event(_K.ACCUMULATE_HOME))  # the own block's dK/dV stays home (no last hop)
            elif backward:
                if w == 1 and o >= 2:  # a one-step round: the carried rider gathers it
                    ev.append(Event(_K.TAKE_CARRIED))
                else:
                    ev.append(Event(_K.START_RIDER if t == 0 or (o, t) == (0, 1) else _K.WAIT_RIDER))
                ev.append(Event(_K.ACCUMULATE))
                if t < w - 1:
                    ev.append(Event(_K.POST_RIDER))
            if t < w - 1:
                ev.append(Event(_K.WAIT_INNER_KV))
        if backward and (o > 0 or w > 1):  # close the round on the rank that computed its block's last step
            if w > 1 and o >= 1:  # (with w = 1 it was taken before the step)
                ev.append(Event(_K.WAIT_CARRIED))
            if o < nw - 1:
                ev.append(Event(_K.POST_CARRIED))
            else:
                ev.extend((Event(_K.POST_FINAL), Event(_K.WAIT_FINAL), Event(_K.ACCUMULATE_HOME)))
        if o < nw - 1:
            ev.append(Event(_K.WAIT_OUTER_KV))
    return tuple(ev)


def replay(events, compute_s: float, transfer_s, link_of, interference: float = 0.0) -> float:
    """Seconds one rank takes to run ``events``: compute takes ``compute_s``; a post starts when its link
    (``link_of[channel]``) is free and lasts ``transfer_s[channel]``; a wait blocks until that transfer is done.
    Every rank runs the same events at the same times, so one rank's replay is the whole group's (and an expected
    receive, posted early, costs nothing: its sender posts no earlier than this rank would). ``interference`` x:
    compute runs 1 + x times slower while any posted transfer is in flight (see :func:`slowed_finish`)."""
    now = 0.0
    link_free = {}
    done = {}
    busy = []
    for e in events:
        if e.kind is _K.COMPUTE:
            now = slowed_finish(now, compute_s, busy, interference)
        elif e.kind.expects:
            continue
        elif e.kind.posts:
            link = link_of[e.channel]
            start = max(now, link_free.get(link, 0.0))
            link_free[link] = done[e.channel] = start + transfer_s[e.channel]
            busy.append((start, done[e.channel]))
        elif e.kind.waits:
            now = max(now, done[e.channel])
    return now


def slowed_finish(start: float, work: float, busy, interference: float) -> float:
    """When ``work`` seconds of compute started at ``start`` finish, running at 1/(1 + interference) of full speed
    while any of the ``busy`` (start, end) transfer intervals is in progress and at full speed otherwise."""
    if interference == 0.0 or work <= 0.0:
        return start + work
    spans = []
    for s, e in sorted((max(s, start), e) for s, e in busy if e > start):
        if spans and s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    t, left = start, work
    for s, e in spans:
        if s > t:  # a stretch with nothing in flight first
            if left <= s - t:
                return t + left
            left -= s - t
            t = s
        slow = (e - t) / (1.0 + interference)  # work that fits in this busy stretch
        if left <= slow:
            return t + left * (1.0 + interference)
        left -= slow
        t = e
    return t + left
