"""Network namespaces of the emulated cluster: names, commands, entering one, tearing them down (test support).

Every namespace this module makes is named ``m2dc-<owner>-<role>``: the prefix :data:`PREFIX`, then the owner (the
pid and start time of the process that built it, so a namespace whose owner is gone is recognised after the pid
was reused), then its role in the cluster (``sw`` for the switch, ``n0r1`` for node 0's rank 1). Nothing here
touches a namespace, link or process outside that prefix; a namespace is torn down by killing the processes inside
it (all of them started by the owner: forked ranks or torchrun) and ``ip netns del``, which removes every link and
qdisc it holds.

    problem = namespaces_problem()        # None, or why namespaces cannot be made here (not root, no `ip`...)
    owner = Owner.this_process()
    sweep_stale()                          # what killed runs left: namespaces of owners that are gone
    enter_namespace("m2dc-123x456-n0r1")   # this process (a forked rank, before any socket) joins it
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "m2dc"
"""The prefix of every namespace the emulated cluster makes (and the only ones it ever deletes)."""
NETNS_DIR = "/run/netns"
LEDGER_ENV = "M2D_NETNS_LEDGER"
"""Names a file to which every owner that builds namespaces appends its tag (:func:`record_owner`): a test session's
record of what it made (:mod:`megatron_2d_dev.leftovers` checks them gone at its end)."""
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}-(\d+)x(\d+)([ck])(\d+)-([a-z0-9]+)$")


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made by this process; the message says why."""


class NetnsError(RuntimeError):
    """An ``ip`` / ``tc`` command failed; the message names the command and its error output."""


def namespaces_problem() -> str | None:
    """None when this process can build the emulated cluster, else the reason (checked without side effects)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "?"
        return f"not root (uid {uid}): network namespaces, veth links and tc qdiscs need root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH (iproute2 builds the namespaces and shapes the links)"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    return None


def require_namespaces() -> None:
    """NamespacesUnavailable with the reason when :func:`namespaces_problem` finds one."""
    problem = namespaces_problem()
    if problem:
        raise NamespacesUnavailable(f"the emulated cluster cannot be built here: {problem}")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3


@dataclass(frozen=True)
class Owner:
    """The process that owns a set of namespaces, and which of its clusters (``serial``) they belong to."""

    pid: int
    started: int
    serial: int = 0
    kept: bool = False
    """Left up on purpose (``--keep``): sweeps of stale namespaces spare it."""

    @classmethod
    def this_process(cls, serial: int = 0, kept: bool = False) -> Owner:
        return cls(os.getpid(), _start_time(os.getpid()) or 0, serial, kept)

    @property
    def tag(self) -> str:
        """The name stem of this owner's namespaces: ``m2dc-<pid>x<start>c<serial>`` (``k``: kept)."""
        return f"{PREFIX}-{self.pid}x{self.started}{'k' if self.kept else 'c'}{self.serial}"

    def name(self, role: str) -> str:
        if not re.fullmatch(r"[a-z0-9]+", role):
            raise ValueError(f"namespace role {role!r}: lowercase letters and digits only")
        return f"{self.tag}-{role}"

    def alive(self) -> bool:
        """Whether the owning process still runs (same pid and start time)."""
        return _start_time(self.pid) == self.started


def parse_name(name: str) -> tuple[Owner, str] | None:
    """(owner, role) of one of this module's namespace names, None for any other name."""
    m = _NAME.match(name)
    if not m:
        return None
    return Owner(int(m.group(1)), int(m.group(2)), int(m.group(4)), m.group(3) == "k"), m.group(5)


def record_owner(owner: Owner) -> None:
    """Append ``owner``'s tag to the ledger :data:`LEDGER_ENV` names, if it names one."""
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a") as ledger:
            ledger.write(owner.tag + "\n")


def own_namespaces() -> list[str]:
    """Every namespace named with :data:`PREFIX` (whoever owns it)."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if parse_name(n) is not None)


# -- commands ---------------------------------------------------------------------------------------------------


def run(cmd: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    """Run one command (no shell); NetnsError naming it and its stderr when it fails and ``check``."""
    done = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True)
    if check and done.returncode:
        shown = " ".join(cmd) + (f" <<< {stdin.strip()[:400]!r}" if stdin else "")
        raise NetnsError(f"`{shown}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def batch(tool: str, namespace: str | None, lines: Iterable[str]) -> None:
    """Run ``lines`` as one ``ip -batch`` / ``tc -batch`` (in ``namespace`` when given): one process for many."""
    lines = [line for line in lines if line]
    if not lines:
        return
    cmd = [tool] + (["-n", namespace] if namespace else []) + ["-batch", "-"]
    run(cmd, stdin="\n".join(lines) + "\n")


def set_sysctls(namespace: str, values: dict[str, str]) -> None:
    """Write /proc/sys entries inside ``namespace`` (``net.ipv4.conf.all.rp_filter`` -> 0 ...)."""
    script = "; ".join(f"echo {v} > /proc/sys/{k.replace('.', '/')}" for k, v in values.items())
    run(["ip", "netns", "exec", namespace, "sh", "-c", script])


def pids_in(namespace: str) -> list[int]:
    """The processes whose network namespace is ``namespace``."""
    out = run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in out.split()]


def delete_namespace(namespace: str) -> None:
    """Kill the processes inside ``namespace`` (one of ours), then delete it with everything it holds."""
    if parse_name(namespace) is None:
        raise ValueError(f"refusing to delete {namespace!r}: not a {PREFIX}- namespace of the emulated cluster")
    for pid in pids_in(namespace):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run(["ip", "netns", "del", namespace], check=False)


def delete_owned(owner: Owner) -> list[str]:
    """Delete every namespace of ``owner`` (switch last, after the ranks whose links end there); their names."""
    mine = [n for n in own_namespaces() if parse_name(n)[0] == owner]
    mine.sort(key=lambda n: parse_name(n)[1] == "sw")
    for name in mine:
        delete_namespace(name)
    return mine


def owners() -> list[Owner]:
    """The owners of every namespace named with :data:`PREFIX`."""
    return sorted({parse_name(n)[0] for n in own_namespaces()}, key=lambda o: (o.pid, o.serial))


def sweep_stale(include_kept: bool = False) -> list[str]:
    """Delete the namespaces whose owner process is gone (a killed run's leftovers; kept clusters only with
    ``include_kept``); their names."""
    stale = {o for o in owners() if not o.alive() and (include_kept or not o.kept)}
    return [name for owner in sorted(stale, key=lambda o: (o.pid, o.serial)) for name in delete_owned(owner)]


# -- entering a namespace ---------------------------------------------------------------------------------------


def enter_namespace(namespace: str) -> None:
    """Move the calling thread (a freshly forked, single-threaded rank: the whole process) into ``namespace``.

    Sockets opened afterwards (gloo's, a TCP store's) live there; threads started afterwards inherit it."""
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12
            os.setns(fd, os.CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
