"""Run a function on N ranks forked from the calling process, over gloo, failing fast and robust under load.

Forking (not spawning) reuses the parent's imported torch/megatron, so a multi-rank test starts in well
under a second on 2 cores. A rank that raises reports its traceback and exits at once; the parent then kills the
remaining ranks and raises with the root cause first (:class:`RankFailure`). Nothing here depends on how fast the
machine is: every process group waits :data:`GROUP_TIMEOUT` for a peer (a loaded machine runs a rank 50x slower than
a quiet one), and the parent calls a world hung when none of its ranks used any CPU for ``timeout_s`` (a deadlock
blocks every rank; a slow world still uses CPU).

    results = run_on_ranks(4, my_fn, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

DEFAULT_TIMEOUT_S = 60.0
"""How long a world may go without any of its ranks using CPU before it is called hung."""

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""Every process group's timeout in the ranks (the default group's, which new 2D groups inherit, and Megatron's,
:func:`megatron_2d_dev.tiny_gpt.init_parallel`): long enough for a peer on a loaded machine, not torch's 30 min.
A hang fails sooner, by the parent's watchdog."""

_STALL_CPU_SHARE = 0.005
"""A world that used less than this share of one core over ``timeout_s`` made no progress (idle gloo threads use
about 0.1% with one gloo device per rank, a world at a load of 100 on 2 cores gets ~8%)."""

_DESCENDANTS_EVERY = 10
"""The CPU meter looks for processes the ranks started every this many polls (5 s)."""

_LIVELOCK_FACTOR = 20
"""A world still running after this many times ``timeout_s`` is stopped even while it uses CPU (a livelock)."""

_STACKS_SIGNAL = signal.SIGUSR1
"""Asks a rank for its threads' Python stacks (faulthandler), for the report of a hung world."""

_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET", "EPIPE")
"""What a rank's error says when it only saw another rank go away: reported after the root cause."""


class RankFailure(RuntimeError):
    """A forked rank raised or died, or the world hung."""


class _OneGlooDevice(type):
    """Stands in for ``ProcessGroupGloo`` inside a forked rank: every group of the rank shares one gloo device.

    torch gives each gloo group its own device, whose event loop wakes every few milliseconds: a rank in a few hundred
    groups (Megatron's and the 2D groups of every layout a test builds) spent a tenth of a core on idle loops, and a
    hung world never looked idle. Groups stay separate gloo contexts; only the device (listening socket and loop) is
    shared. Instances are torch's own class, so torch's isinstance checks hold."""

    real = distributed_c10d.ProcessGroupGloo
    devices = None

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.real)

    def __getattr__(cls, name):
        return getattr(cls.real, name)

    def __call__(cls, store, rank, size, timeout=GROUP_TIMEOUT):
        if cls.devices is None:  # as torch picks them: GLOO_SOCKET_IFNAME's interfaces (an emulated node's) or default
            names = os.environ.get("GLOO_SOCKET_IFNAME", "")
            interfaces = names.split(",") if len(names) > 1 else []
            devices = [cls.real.create_device(interface=i) for i in interfaces]
            cls.devices = devices or [cls.real.create_default_device()]
        options = cls.real._Options()
        options._timeout = timeout
        options._devices = cls.devices
        options._threads = 2  # torch's default
        return cls.real(store, rank, size, options)


class _SharedDeviceGloo(metaclass=_OneGlooDevice):
    pass


def _rank_main(rank, world_size, store_dir, fn, args, kwargs, results, rank_setup=None):
    # What the rank inherited from the test process (a heap of ~1 GB once megatron is imported) is permanent here: the
    # rank's collections (automatic or gc.collect()) then scan only what the rank made, not the inherited heap, and
    # leave its pages shared (a full collection touched every object: 0.85 s per gc.collect() in a rank).
    gc.freeze()
    # A rank killed by a signal (an abort in gloo, a segfault) leaves its Python stack here for the parent's report.
    crash_log = open(os.path.join(store_dir, f"rank{rank}.crash"), "w")  # noqa: SIM115 (open until os._exit)
    faulthandler.enable(file=crash_log, all_threads=False)
    faulthandler.register(_STACKS_SIGNAL, file=crash_log, all_threads=True)  # a hung world's report asks for them
    try:
        if rank_setup is not None:
            rank_setup(rank)  # e.g. join the rank's network namespace, before any socket is opened
        torch.set_num_threads(1)
        _SharedDeviceGloo.devices = None  # made in this rank (after rank_setup), never inherited
        distributed_c10d.ProcessGroupGloo = _SharedDeviceGloo
        store = _world_store(rank, world_size, store_dir, across_namespaces=rank_setup is not None)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
        value = fn(rank, world_size, *args, **kwargs)
        dist.barrier()
        # Plain pickle: tensors would otherwise travel as shared-memory handles that die with the rank.
        results.put((rank, True, pickle.dumps(value), time.monotonic()))
        # No destroy_process_group(): the rank exits with its groups. Destroying a gloo group waits a tick of the
        # device's event loop (~10 ms) per connected peer; a rank of a Megatron test holds hundreds of groups.
    except BaseException:  # report everything, including assertion errors, then die at once
        results.put((rank, False, traceback.format_exc(), time.monotonic()))
        results.close()
        results.join_thread()
        os._exit(1)
    results.close()
    results.join_thread()
    os._exit(0)


@dataclass
class _Failure:
    rank: int
    report: str  # the rank's traceback, or how it died
    at: float  # time.monotonic() of the raise (a death: when the parent saw it)

    @property
    def peer_lost(self) -> bool:
        return any(sign in self.report for sign in _PEER_LOST)


class _CpuMeter:
    """CPU seconds used by the ranks and everything they started, summed as it grows (a process that exits keeps
    what it used). A rank's own times are read at every call; its descendants are looked for every
    :data:`_DESCENDANTS_EVERY` calls only, as finding them scans all of /proc (a second of the test process's CPU per
    forked world, read every 0.5 s)."""

    def __init__(self, procs):
        self.ranks: list[psutil.Process] = []
        for p in procs:
            try:
                self.ranks.append(psutil.Process(p.pid))
            except psutil.Error:  # already exited
                continue
        self.known: dict[int, psutil.Process] = {rank.pid: rank for rank in self.ranks}
        self.seen: dict[int, float] = {}
        self.total = 0.0
        self.reads = 0

    def read(self) -> float:
        if self.reads % _DESCENDANTS_EVERY == 0:
            for rank in self.ranks:
                try:
                    self.known.update((child.pid, child) for child in rank.children(recursive=True))
                except psutil.Error:  # exited meanwhile
                    continue
        self.reads += 1
        for pid, proc in list(self.known.items()):
            try:
                times = proc.cpu_times()
            except psutil.Error:  # exited meanwhile: what it used is counted
                del self.known[pid]
                continue
            used = times.user + times.system + times.children_user + times.children_system
            self.total += max(0.0, used - self.seen.get(pid, 0.0))
            self.seen[pid] = used
        return self.total


def _crash_log(store_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(store_dir, f"rank{rank}.crash")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _failure_message(world_size: int, failures: list[_Failure]) -> str:
    """The root cause first: a rank that raised or died on its own before those that only lost a peer, each group
    in the order things happened; every failing rank's report follows."""
    ordered = sorted(failures, key=lambda f: (f.peer_lost, f.at))
    first = ordered[0]
    lines = [f"rank {first.rank} of {world_size} failed:\n{first.report}"]
    for other in ordered[1:]:
        why = "then (it lost a peer)" if other.peer_lost else "then"
        lines.append(f"{why} rank {other.rank} of {world_size} failed:\n{other.report}")
    return "\n".join(lines)


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads_per_rank: int = 1,
    rank_setup: Callable[[int], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Fork ``world_size`` ranks running ``fn(rank, world_size, *args, **kwargs)``; return their results by rank.

    Results are pickled in the rank, so they may hold tensors. Raises RankFailure when a rank raises or dies (every
    failing rank's traceback, the root cause first: a rank that only saw a peer go away comes after it), or when the
    world is hung: no rank used CPU for ``timeout_s`` seconds (however slow the machine, a running world uses some).
    ``rank_setup(rank)`` runs first in each rank, before its process group exists (the emulated cluster's ranks enter
    their network namespaces there: :func:`megatron_2d_dev.cluster_launch.run_on_cluster`).
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="m2d_store_")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, store_dir, fn, args, kwargs, results, rank_setup),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        values: dict = {}
        failures: list[_Failure] = []
        meter = _CpuMeter(procs)
        start = progress_at = time.monotonic()
        progress_cpu = meter.read()
        while len(values) < world_size and not failures:
            try:
                report = results.get(timeout=0.5)
            except queue.Empty:
                report = None
            if report is None:
                now = time.monotonic()
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead:
                    failures += _collect_failures(procs, results, store_dir, values, set())
                    continue
                cpu = meter.read()
                if cpu - progress_cpu >= _STALL_CPU_SHARE * timeout_s:
                    progress_at, progress_cpu = now, cpu
                elif now - progress_at > timeout_s:
                    raise RankFailure(
                        f"hung: no rank of {world_size} used CPU for {timeout_s:.0f} s (ranks done: {sorted(values)})"
                        + _stacks(procs, store_dir, values)
                    )
                if now - start > _LIVELOCK_FACTOR * timeout_s:
                    raise RankFailure(
                        f"still running after {now - start:.0f} s (ranks done: {sorted(values)}): a livelock?"
                        + _stacks(procs, store_dir, values)
                    )
                continue
            rank, ok, value, at = report
            if not ok:
                failures.append(_Failure(rank, value, at))
                failures += _collect_failures(procs, results, store_dir, values, {rank})
                continue
            values[rank] = pickle.loads(value)
        if failures:
            raise RankFailure(_failure_message(world_size, failures))
        for p in procs:
            p.join(timeout=10.0)
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        torch.set_num_threads(saved_threads)
        shutil.rmtree(store_dir, ignore_errors=True)  # the store file and anything else the ranks left in it


def _world_store(rank: int, world_size: int, store_dir: str, across_namespaces: bool) -> dist.Store:
    """The world's store: a TCPStore served by rank 0, whose port the other ranks read from ``store_dir``.

    A TCPStore answers a wait when the key arrives, where a FileStore polls every 10 ms: creating a gloo group (a store
    round per rank) takes 2-4x less (900 groups per rank: 13.3 s -> 6.6 s under load). Rank 0 serves it, as torchrun's
    rendezvous does: served by the test process, one world in ~300 hung, a rank forked while the server's thread ran
    never finishing its client's handshake. Ranks that enter other network namespaces (``rank_setup``, the emulated
    cluster) share a FileStore instead: rank 0's loopback is not theirs."""
    if across_namespaces:
        return dist.FileStore(os.path.join(store_dir, "store"), world_size)
    port_file = os.path.join(store_dir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)  # whole or absent for a reader
        return store
    while not os.path.exists(port_file):  # rank 0 is starting its server: once per world, a few milliseconds
        time.sleep(0.005)
    with open(port_file) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=GROUP_TIMEOUT)


def _stacks(procs, store_dir: str, values: dict) -> str:
    """The Python stacks of the ranks still running (what each waits in), dumped by faulthandler on a signal."""
    running = [i for i, p in enumerate(procs) if i not in values and p.exitcode is None]
    for i in running:
        try:
            os.kill(procs[i].pid, _STACKS_SIGNAL)
        except ProcessLookupError:
            continue
    time.sleep(1.0)  # the dump is written by the rank's signal handler
    return "".join(f"\nrank {i}'s threads:\n{_crash_log(store_dir, i) or '(none written)'}" for i in running)


def _collect_failures(procs, results, store_dir: str, values: dict, reported: set[int]) -> list[_Failure]:
    """After a first failure: the other ranks' reports for a few seconds more (a rank whose peer died fails within
    milliseconds, often before the rank that caused it finished writing its traceback), and the ranks that died
    without one (killed by a signal: the Python stack faulthandler left, and the exit code)."""
    failures: list[_Failure] = []
    settle = time.monotonic() + 3.0
    while time.monotonic() < settle:
        pending = [i for i, p in enumerate(procs) if i not in values and i not in reported and p.exitcode is None]
        try:
            rank, ok, value, at = results.get(timeout=0.2)
        except queue.Empty:
            if not pending:  # every rank has exited and every report has arrived
                break
            continue
        if ok:
            values[rank] = pickle.loads(value)
        else:
            reported.add(rank)
            failures.append(_Failure(rank, value, at))
    now = time.monotonic()
    for i, p in enumerate(procs):
        if p.exitcode not in (None, 0) and i not in values and i not in reported:
            stack = _crash_log(store_dir, i) or "(no Python stack left)"
            failures.append(_Failure(i, f"died with exit code {p.exitcode} and no report:\n{stack}", now))
    return failures
