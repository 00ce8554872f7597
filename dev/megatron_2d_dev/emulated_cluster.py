"""A multi-node GPU cluster emulated on one machine with network namespaces: N nodes x G ranks (test support).

Each rank has its own network namespace with two links, each shaped by ``tc tbf`` at both ends:

    nic  the rank's network port (the inter-node tier): a veth to the fabric bridge, or to its NIC's bridge when
         ranks share a NIC (``nics_per_node`` < G; the NIC's uplink to the fabric is then shaped as well);
    nvl  the rank's NVLink (the intra-node tier): a veth to its node's bridge, with a /32 route to each same-node
         peer's address, so that peers on the node are reached over ``nvl`` and every other rank over ``nic``.

Bridges live in one "switch" namespace; nothing is created in the root namespace. Addresses are 169.254.<10 +
node>.<10 + local rank>/16 (link-local only), on ``nic``; gloo binds to it (``GLOO_SOCKET_IFNAME=nic``).

    with EmulatedCluster(ClusterShape(nodes=2, ranks_per_node=4, nic_mbit=50, nvl_mbit=450)) as cluster:
        cluster.enter_rank(5)            # in a forked rank, before init_process_group: node 1, local rank 1
        cluster.address(0, 0)            # '169.254.10.10', the master's address

Always torn down: on leaving the ``with`` (also after an exception or Ctrl-C), on SIGTERM / SIGHUP (turned into
SystemExit in the owning process, so the exit path runs), at interpreter exit, and by :func:`netns.sweep_stale` at
the next build for what a killed (SIGKILL) run left. ``keep=True`` leaves it up for debugging (its namespaces are
named as kept, so sweeps spare them; ``tools/emulated_cluster.py down`` removes them). Where namespaces cannot be
made (not root, no iproute2) building raises :class:`netns.NamespacesUnavailable` with the reason.

What it represents and what not: bandwidth per tier, a NIC per rank (or shared), concurrent flows on separate links;
not latency (netem is missing here), not NCCL (gloo over TCP), and every rank shares the machine's cores.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
from dataclasses import dataclass, field

from . import netns

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that, in the owning process, tear the cluster down before the process ends."""
QUEUE_BYTES = 16 << 20
"""What a shaper may hold before it drops: large, so that nothing is dropped. GPU fabrics are lossless (NVLink,
InfiniBand credits, RoCE with PFC) and a host's NIC queue pushes back instead of dropping; with a queue of
100 ms of rate, four ranks' flows converging on one port dropped packets, and each drop cost a TCP retransmission
timeout (>= 200 ms): an 8-rank all-to-all took 2-7x its time at the rate."""
MAX_NODE_MBIT = 2000.0
"""Above about 2 Gbit/s per node the links are bound by the CPU (the copies through veth and bridges), not by
the shaper: measured 10-18 Gbit/s unshaped and noisy on this machine kind (the shared notes)."""


class ClusterShapeError(ValueError):
    """An emulated cluster's shape that cannot be built; the message names the values and what would be valid."""


@dataclass(frozen=True)
class ClusterShape:
    """The emulated cluster: ``nodes`` x ``ranks_per_node`` ranks and the rate of each tier (Mbit/s)."""

    nodes: int
    ranks_per_node: int
    nic_mbit: float
    """Rate of one NIC, each direction."""
    nvl_mbit: float
    """Rate of one rank's node link ("NVLink"), each direction."""
    nics_per_node: int | None = None
    """NICs per node (None: one per rank, rail-optimised as on a DGX); ranks r*G/nics ... share NIC r."""
    burst_kib: int = 16
    """tbf's bucket: 16 KiB keeps a 256 KiB message after idle at the configured rate; 128 KiB let it cross 1.7x
    too fast (measured, the shared notes)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "burst_kib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterShapeError(f"{name} must be a positive integer, got {value!r}")
        if self.nodes > 200 or self.ranks_per_node > 200:
            raise ClusterShapeError(
                f"nodes={self.nodes}, ranks_per_node={self.ranks_per_node}: at most 200 each (addresses "
                "169.254.<10 + node>.<10 + rank>)"
            )
        for name in ("nic_mbit", "nvl_mbit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ClusterShapeError(f"{name} must be a positive rate in Mbit/s, got {value!r}")
        nics = self.nics
        if not isinstance(nics, int) or nics < 1 or self.ranks_per_node % nics:
            raise ClusterShapeError(
                f"nics_per_node={self.nics_per_node} must divide ranks_per_node={self.ranks_per_node} "
                f"(valid: {[d for d in range(1, self.ranks_per_node + 1) if self.ranks_per_node % d == 0]})"
            )

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def nics(self) -> int:
        """NICs per node, resolved."""
        return self.ranks_per_node if self.nics_per_node is None else self.nics_per_node

    @property
    def ranks_per_nic(self) -> int:
        return self.ranks_per_node // self.nics

    def node_mbit(self) -> float:
        """The most one node moves at once: its NICs and its ranks' node links together."""
        return self.nics * self.nic_mbit + self.ranks_per_node * self.nvl_mbit

    def warnings(self) -> list[str]:
        """What makes the emulation unfaithful (rates the CPU cannot carry), as lines to print."""
        if self.node_mbit() > MAX_NODE_MBIT:
            return [
                f"a node's links add up to {self.node_mbit():.0f} Mbit/s, above ~{MAX_NODE_MBIT:.0f}: the CPU, "
                "not the shaper, will set the rates (scale them down)"
            ]
        return []

    def describe(self) -> str:
        nic = "a NIC per rank" if self.ranks_per_nic == 1 else f"{self.nics} NICs per node"
        return (
            f"{self.nodes} nodes x {self.ranks_per_node} ranks, {nic} at {self.nic_mbit:g} Mbit/s, node links "
            f"{self.nvl_mbit:g} Mbit/s per rank ({self.nvl_mbit / self.nic_mbit:.1f}:1), tbf bucket "
            f"{self.burst_kib} KiB"
        )


def tbf(rate_mbit: float, burst_kib: int) -> str:
    """A tbf root qdisc's parameters at ``rate_mbit``."""
    return f"root tbf rate {int(rate_mbit * 1e6)}bit burst {burst_kib << 10} limit {QUEUE_BYTES}"


_SERIALS = iter(range(1 << 30))
_LIVE: list[EmulatedCluster] = []
_PREVIOUS_HANDLERS: dict[int, object] = {}


def _exit_on_signal(signum, frame) -> None:
    """In the owning process: SystemExit, so that ``with`` blocks and atexit tear the clusters down. In a forked
    child (which inherited the handler): what the signal would have done before the cluster was built."""
    if any(c.owner.pid == os.getpid() for c in _LIVE):
        raise SystemExit(128 + signum)
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for signum in HANDLED_SIGNALS:
        current = signal.getsignal(signum)
        if current is _exit_on_signal:
            continue
        _PREVIOUS_HANDLERS[signum] = current
        signal.signal(signum, _exit_on_signal)


def _restore_handlers() -> None:
    if _LIVE:
        return
    for signum, previous in list(_PREVIOUS_HANDLERS.items()):
        if signal.getsignal(signum) is _exit_on_signal and previous is not None:
            try:
                signal.signal(signum, previous)
            except ValueError:  # not the main thread
                return
        del _PREVIOUS_HANDLERS[signum]


@atexit.register
def _tear_down_at_exit() -> None:
    for cluster in list(_LIVE):
        if cluster.owner.pid == os.getpid() and not cluster.keep:
            cluster.tear_down()


@dataclass
class EmulatedCluster:
    """One emulated cluster of ``shape`` (see the module docstring); build it with ``with`` or :meth:`build`."""

    shape: ClusterShape
    keep: bool = False
    """Leave it up after the ``with`` (debugging); ``tools/emulated_cluster.py down`` removes it."""
    owner: netns.Owner = field(default=None)  # type: ignore[assignment]
    built: bool = False

    def __post_init__(self) -> None:
        if self.owner is None:
            self.owner = netns.Owner.this_process(next(_SERIALS), kept=self.keep)

    # -- names and addresses ------------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return self.owner.name("sw")

    def namespace(self, node: int, local: int) -> str:
        return self.owner.name(f"n{node}r{local}")

    def rank_namespace(self, rank: int) -> str:
        """The namespace of global rank ``rank`` (rank = node * ranks_per_node + local rank)."""
        return self.namespace(*divmod(rank, self.shape.ranks_per_node))

    def node_of(self, rank: int) -> int:
        return rank // self.shape.ranks_per_node

    @staticmethod
    def address(node: int, local: int) -> str:
        return f"169.254.{10 + node}.{10 + local}"

    def rank_address(self, rank: int) -> str:
        return self.address(*divmod(rank, self.shape.ranks_per_node))

    def namespaces(self) -> list[str]:
        ranks = [self.rank_namespace(r) for r in range(self.shape.world)]
        return ranks + [self.switch]

    # -- life cycle ---------------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.build()
        return self

    def __exit__(self, *exc) -> None:
        if not self.keep:
            self.tear_down()

    def build(self) -> None:
        """Make the namespaces, links, addresses, routes and shapers (torn down again if any step fails)."""
        netns.require_namespaces()
        netns.record_owner(self.owner)  # before the first namespace: a test session's ledger sees every one
        swept = netns.sweep_stale()
        if swept:
            print(f"emulated cluster: removed {len(swept)} namespaces a killed run left", file=sys.stderr)
        _LIVE.append(self)
        _install_handlers()
        try:
            self._build()
        except BaseException:
            self.tear_down()
            raise
        self.built = True

    def tear_down(self) -> None:
        """Kill what runs inside this cluster's namespaces and delete them (idempotent; only this owner's)."""
        if self in _LIVE:
            _LIVE.remove(self)
        netns.delete_owned(self.owner)
        self.built = False
        _restore_handlers()

    def sent_bytes(self, rank: int) -> dict[str, int]:
        """Bytes rank ``rank`` has sent so far on each of its links: {"nic": ..., "nvl": ...} (interface counters)."""
        import json

        links = json.loads(netns.run(["ip", "-n", self.rank_namespace(rank), "-s", "-j", "link", "show"]))
        return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in links if link["ifname"] in ("nic", "nvl")}

    def enter_rank(self, rank: int) -> None:
        """In a forked rank, before any socket: join rank ``rank``'s namespace and make gloo use its NIC."""
        netns.enter_namespace(self.rank_namespace(rank))
        os.environ["GLOO_SOCKET_IFNAME"] = "nic"

    def _build(self) -> None:
        s, sw = self.shape, self.switch
        for name in self.namespaces():
            netns.run(["ip", "netns", "add", name])
        shared = s.ranks_per_nic > 1
        lines = ["link add fab type bridge", "link set fab up"]
        for k in range(s.nodes):
            lines += [f"link add node{k} type bridge", f"link set node{k} up"]
            for i in range(s.nics if shared else 0):
                lines += [
                    f"link add x{k}i{i} type bridge",
                    f"link add u{k}i{i} type veth peer name f{k}i{i}",
                    f"link set u{k}i{i} master x{k}i{i}",
                    f"link set f{k}i{i} master fab",
                    f"link set x{k}i{i} up",
                    f"link set u{k}i{i} up",
                    f"link set f{k}i{i} up",
                ]
        netns.batch("ip", sw, lines)
        links = []
        for rank in range(s.world):
            k, r = divmod(rank, s.ranks_per_node)
            ns = self.rank_namespace(rank)
            links += [
                f"link add nic netns {ns} type veth peer name n{k}r{r} netns {sw}",
                f"link add nvl netns {ns} type veth peer name v{k}r{r} netns {sw}",
            ]
        netns.batch("ip", None, links)
        ports, shaping = [], []
        nic_tbf, nvl_tbf = tbf(s.nic_mbit, s.burst_kib), tbf(s.nvl_mbit, s.burst_kib)
        for rank in range(s.world):
            k, r = divmod(rank, s.ranks_per_node)
            bridge = f"x{k}i{r // s.ranks_per_nic}" if shared else "fab"
            ports += [
                f"link set n{k}r{r} master {bridge}",
                f"link set v{k}r{r} master node{k}",
                f"link set n{k}r{r} up",
                f"link set v{k}r{r} up",
            ]
            shaping += [f"qdisc add dev n{k}r{r} {nic_tbf}", f"qdisc add dev v{k}r{r} {nvl_tbf}"]
        for k in range(s.nodes):
            for i in range(s.nics if shared else 0):
                shaping += [f"qdisc add dev u{k}i{i} {nic_tbf}", f"qdisc add dev f{k}i{i} {nic_tbf}"]
        netns.batch("ip", sw, ports)
        netns.batch("tc", sw, shaping)
        for rank in range(s.world):
            k, r = divmod(rank, s.ranks_per_node)
            ns, own = self.rank_namespace(rank), self.address(k, r)
            netns.set_sysctls(
                ns,
                {
                    "net.ipv4.conf.all.rp_filter": "0",
                    "net.ipv4.conf.default.rp_filter": "0",
                    "net.ipv4.conf.nic.rp_filter": "0",
                    "net.ipv4.conf.nvl.rp_filter": "0",
                    "net.ipv4.conf.all.arp_ignore": "0",  # answer ARP on nvl for the address on nic
                    "net.ipv6.conf.all.disable_ipv6": "1",
                    "net.ipv6.conf.default.disable_ipv6": "1",
                },
            )
            peers = [f"route add {self.address(k, p)}/32 dev nvl src {own}" for p in range(s.ranks_per_node) if p != r]
            netns.batch(
                "ip",
                ns,
                [
                    "link set lo up",
                    f"addr add {own}/16 dev nic",
                    "link set nic up",
                    "link set nvl up",
                    *peers,
                ],
            )
            netns.batch("tc", ns, [f"qdisc add dev nic {nic_tbf}", f"qdisc add dev nvl {nvl_tbf}"])
