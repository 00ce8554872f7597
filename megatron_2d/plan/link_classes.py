"""Which links each communication of a 2D layout uses: NVLink inside a node, or the network between nodes.

Pure rank math on top of ``megatron_2d.layout.topology.Layout2D`` (its index_of / coords_of give a rank's CP index i
from its head rank hr and context rank cr, for either placement, and its send_peers the peers below):

    global rank      g = base + tp * i      (Megatron order tp-cp-ep-dp-pp: TP innermost, so CP ranks are TP apart;
                                             one CP group and its TP peers fill TP*CP consecutive ranks)
    node             n = g // gpus_per_node

    all-to-all peers   the other hp - 1 ranks of the head group: (hr', cr) for hr' != hr
    inner ring peer    (hr, ring*w + (slot+1) % w) with ring = cr // w, slot = cr % w     (when w > 1)
    outer ring peer    (hr, (cr + w) % cp)                                                   (when cp / w > 1)

The pattern repeats every lcm(gpus_per_node, TP*CP) global ranks, so one period describes the whole cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..layout.topology import PLACEMENTS, Layout2D


@dataclass(frozen=True)
class LinkClass:
    """How one rank's sends on one path split between the node and the network."""

    intra_peers: int
    """Peers on this rank's node (NVLink)."""
    inter_peers: int
    """Peers on other nodes (network)."""
    node_flows: int
    """Ranks of this node sending off-node on this path at the same time (they share the node's NICs)."""


@dataclass(frozen=True)
class LinkMap:
    """The distinct :class:`LinkClass` of every rank, for the all-to-all, the inner ring and the outer ring.

    The two rings run concurrently, so ``node_flows`` of ``inner`` and ``outer`` both count the off-node flows
    of both rings.
    """

    a2a: tuple[LinkClass, ...]
    inner: tuple[LinkClass, ...]
    outer: tuple[LinkClass, ...]

    @staticmethod
    def describe(classes: tuple[LinkClass, ...]) -> str:
        """'nvlink', 'network', 'mixed' (some peers each way) or '-' (no traffic on this path)."""
        intra = any(c.intra_peers for c in classes)
        inter = any(c.inter_peers for c in classes)
        if intra and inter:
            return "mixed"
        return "network" if inter else ("nvlink" if intra else "-")


def peers(i: int, hp: int, cp: int, w: int, placement: str) -> dict[str, list[int]]:
    """CP indices that CP index ``i`` sends to, per path: {'a2a': [...], 'inner': [...], 'outer': [...]}."""
    return Layout2D(hp * cp, hp, w, placement).send_peers(i)


def link_map(hp: int, cp: int, w: int, placement: str, tp: int, gpus_per_node: int, world: int) -> LinkMap:
    """Classify every rank's all-to-all and ring sends as intra- or inter-node, with per-node flow counts."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
    CP = hp * cp
    if cp % w or world % (tp * CP):
        raise ValueError(f"inconsistent layout: cp={cp}, w={w}, tp*CP={tp * CP}, world={world}")
    # only the first min(period, world) ranks are looked at: one cache entry serves every larger world
    return _link_map(hp, cp, w, placement, tp, gpus_per_node, min(math.lcm(gpus_per_node, tp * CP), world))


@lru_cache(maxsize=4096)
def _link_map(hp: int, cp: int, w: int, placement: str, tp: int, gpus_per_node: int, ranks: int) -> LinkMap:
    CP = hp * cp
    per_rank: dict[str, list[tuple[int, int]]] = {"a2a": [], "inner": [], "outer": []}
    node_flows: dict[str, dict[int, int]] = {"a2a": {}, "inner": {}, "outer": {}}
    for g in range(ranks):
        i = (g // tp) % CP
        base = g - tp * i  # global rank of CP index 0 in this rank's group (same TP rank)
        node = g // gpus_per_node
        for path, idx in peers(i, hp, cp, w, placement).items():
            off = sum((base + tp * j) // gpus_per_node != node for j in idx)
            per_rank[path].append((node, len(idx) - off, off))
            if off:
                node_flows[path][node] = node_flows[path].get(node, 0) + 1

    def classes(path: str, concurrent: tuple[str, ...]) -> tuple[LinkClass, ...]:
        out = set()
        for node, intra, inter in per_rank[path]:
            if intra or inter:
                flows = sum(node_flows[p].get(node, 0) for p in concurrent) if inter else 0
                out.add(LinkClass(intra, inter, flows))
        return tuple(sorted(out, key=lambda c: (c.inter_peers, c.node_flows, c.intra_peers)))

    rings = ("inner", "outer")
    return LinkMap(a2a=classes("a2a", ("a2a",)), inner=classes("inner", rings), outer=classes("outer", rings))
