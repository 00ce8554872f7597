"""Link efficiency: the share of a link's nominal bandwidth a transfer gets, by link class and traffic kind, and
how much compute slows down while transfers run.

    effective GB/s = nominal GB/s (ClusterSpec.nvlink_gbps, or one flow's share of the node's NICs)
                     * factor(link class, kind)

Link classes: "nvlink" (inside a node) and "network" (between nodes). Kinds: "p2p" (ring sends: one send/recv
pair at a time) and "a2a" (collectives: the head all-to-all, and the all-gather / reduce-scatter of sharded model
states). ``interference`` x: a kernel takes (1 + x) times as long while a transfer of its rank is in flight (NCCL
kernels take SMs and HBM bandwidth from it); 0 (the default) models none.

Defaults, from published NCCL measurements (nominal figures are the line rates of hardware.py's presets):

    nvlink a2a 0.80   NCCL's effective NVLink rate for collectives: H100 370 of 450 GB/s line rate ("with the
                      protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can
                      observe as BusBw when running non-allreduce operations", NCCL maintainer, NVIDIA/nccl-tests
                      issue 212); A100 ~230 of 300 GB/s (12 NVLinks of 25 GB/s, ~20 GB/s effective each with a 128-B
                      payload, NVIDIA/nccl-tests issue 149): 0.82 and 0.77.
    nvlink p2p 0.70   one NCCL send/recv pair reaches less: ~72 of 100 GB/s between two A100s joined by 4 NVLinks
                      (NVIDIA/nccl-tests issue 331), and sendrecv_perf plateaus at 180 GB/s where nvbandwidth's copy
                      engines reach 260 GB/s on two NVLink-connected H100s (NVIDIA/nccl-tests issue 268): 0.72, 0.69.
    network p2p 0.94  a 400 Gb/s (NDR) ConnectX-7 NIC carries 46-48 GB/s of its 50 (NVIDIA/nccl-tests issues 290
                      and 267, NCCL maintainers).
    network a2a 0.80  an all-to-all's network part runs at one NIC's rate per GPU (NVIDIA/nccl-tests issues 130
                      and 267); the ~20% collective overhead seen on NVLink is ASSUMED here (no published figure
                      found for many-peer all-to-alls): calibrate it.

These are averages over other people's machines; ``megatron_2d.plan.calibrate`` fits the factors to measurements
of the machine at hand (tools/calibrate_planner.py on CPU ranks). ``IDEAL_LINKS`` is the model before link
efficiency existed: every flow at its nominal rate, no interference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..layout.ring_schedule import slowed_finish
from .errors import PlanError

LINK_CLASSES = ("nvlink", "network")
TRAFFIC_KINDS = ("p2p", "a2a")
FLAGS = {
    "nvlink_p2p": ("--nvlink-p2p-eff", "share of NVLink bandwidth a ring send gets (default 0.70)"),
    "nvlink_a2a": (
        "--nvlink-a2a-eff",
        "share of NVLink bandwidth collectives get: all-to-all, all-gather, reduce-scatter (default 0.80)",
    ),
    "network_p2p": ("--net-p2p-eff", "share of a NIC's bandwidth a ring send gets (default 0.94)"),
    "network_a2a": ("--net-a2a-eff", "share of a NIC's bandwidth collectives get (default 0.80, assumed)"),
    "interference": ("--interference", "compute runs 1 + X times slower while its rank's transfers run (default 0)"),
}
"""``python -m megatron_2d.plan`` flag and help of each :class:`LinkEfficiency` field."""


@dataclass(frozen=True)
class LinkEfficiency:
    """Bandwidth factors per (link class, kind) in (0, 1] and the compute slowdown ``interference`` >= 0 (see the
    module docstring for the defaults' sources)."""

    nvlink_p2p: float = 0.70
    nvlink_a2a: float = 0.80
    network_p2p: float = 0.94
    network_a2a: float = 0.80
    interference: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if f.name == "interference":
                if not ok or value < 0:
                    raise PlanError(
                        f"link interference ({FLAGS[f.name][0]}) must be a finite number >= 0 (the "
                        f"slowdown of compute while transfers run, e.g. 0.1), got {value!r}"
                    )
            elif not ok or not 0 < value <= 1:
                raise PlanError(f"link efficiency {f.name} ({FLAGS[f.name][0]}) must be in (0, 1], got {value!r}")

    def factor(self, link: str, kind: str) -> float:
        """The bandwidth factor of ``link`` ("nvlink" | "network") for ``kind`` ("p2p" | "a2a")."""
        if link not in LINK_CLASSES or kind not in TRAFFIC_KINDS:
            raise ValueError(f"link {link!r} / kind {kind!r}: valid links {LINK_CLASSES}, kinds {TRAFFIC_KINDS}")
        return getattr(self, f"{link}_{kind}")

    def describe(self) -> str:
        """'NVLink p2p 0.70 a2a 0.80, network p2p 0.94 a2a 0.80, interference 0'."""
        return (
            f"NVLink p2p {self.nvlink_p2p:.2f} a2a {self.nvlink_a2a:.2f}, network p2p {self.network_p2p:.2f} "
            f"a2a {self.network_a2a:.2f}, interference {self.interference:g}"
        )


IDEAL_LINKS = LinkEfficiency(1.0, 1.0, 1.0, 1.0, 0.0)
"""Every flow at its nominal rate and no interference (the planner's model before link efficiency)."""


def overlapped(compute_s: float, transfer_s: float, interference: float) -> float:
    """Seconds until both are done when ``compute_s`` of compute and a ``transfer_s`` transfer start together:
    max(transfer, compute slowed by the interference while the transfer runs)."""
    return max(transfer_s, slowed_finish(0.0, compute_s, ((0.0, transfer_s),), interference))
