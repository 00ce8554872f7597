"""What a test session leaves behind: temporary files and folders, processes, network namespaces (test support).

:func:`start_session` (tests/conftest.py, at session start) makes everything the session creates attributable to it,
so that the check at its end counts only that, never what other work on the machine (a benchmark's own emulated
cluster, its temporary folders) makes meanwhile:

* temporary files: the session's own temporary folder becomes the temporary root (``TMPDIR`` and
  ``tempfile.tempdir``) of the test process, its forked ranks and every subprocess (``mktemp`` in the tools honours
  it); pytest's ``tmp_path`` folders stay where pytest keeps them (``PYTEST_DEBUG_TEMPROOT``, its own retention);
* processes: the test process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a descendant whose parent
  exits stays in its process tree instead of moving to init;
* network namespaces: every emulated cluster built in the session records its owner in the session's ledger
  (:data:`megatron_2d_dev.netns.LEDGER_ENV`).

:func:`finish_session` (at session end) lists what is left of each (empty: nothing), then removes it: the temporary
folder, the live descendants, the ledger's namespaces. Nothing outside the session's folder, process tree and ledger
is looked at or touched.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import netns

PR_SET_CHILD_SUBREAPER = 36
LEDGER_NAME = ".netns-ledger"
PYTHON_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Python's own helper processes (started on demand, they exit with the interpreter): not leftovers."""


@dataclass
class Session:
    """What :func:`start_session` changed: the session's temporary folder and the settings it replaced."""

    temp_dir: Path
    saved_env: dict[str, str | None]
    saved_tempdir: str | None
    running: frozenset[tuple[int, float]] = frozenset()
    """The descendants (pid, start time) already running at the start: not the session's."""

    @property
    def ledger(self) -> Path:
        return self.temp_dir / LEDGER_NAME


def start_session() -> Session:
    """Make what this process and its descendants create from now on attributable to this session (see the module
    docstring)."""
    root = tempfile.gettempdir()
    temp_dir = Path(tempfile.mkdtemp(prefix=f"m2d_session_{os.getpid()}_", dir=root))
    names = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT", netns.LEDGER_ENV)
    running = frozenset(_descendants())
    session = Session(temp_dir, {name: os.environ.get(name) for name in names}, tempfile.tempdir, running)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)  # pytest's tmp_path folders: where they were
    os.environ["TMPDIR"] = str(temp_dir)
    os.environ[netns.LEDGER_ENV] = str(session.ledger)
    tempfile.tempdir = str(temp_dir)
    _become_subreaper()
    return session


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans move to init and are not seen
        pass


def finish_session(session: Session) -> list[str]:
    """What the session left behind, one line per kind (empty: nothing); it is removed after being listed. The
    previous temporary root and environment are restored."""
    problems = []
    processes = left_processes(session)
    if processes:
        problems.append(f"{len(processes)} processes still running: " + "; ".join(processes.values()))
        _kill(processes)
    _reap_orphans()
    namespaces = left_namespaces(session)
    if namespaces:
        problems.append(f"{len(namespaces)} network namespaces: {', '.join(namespaces)}")
        for owner in {netns.parse_name(name)[0] for name in namespaces}:
            netns.delete_owned(owner)
    files = sorted(p.name for p in session.temp_dir.iterdir() if p.name != LEDGER_NAME)
    if files:
        problems.append(f"{len(files)} temporary files or folders (in {session.temp_dir}): {', '.join(files)}")
    shutil.rmtree(session.temp_dir, ignore_errors=True)
    for name, value in session.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = session.saved_tempdir
    return problems


def _descendants() -> dict[tuple[int, float], object]:
    """This process's live descendants, zombies aside: {(pid, start time): psutil.Process}."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found[(child.pid, child.create_time())] = child
        except psutil.NoSuchProcess:
            continue
    return found


def left_processes(session: Session) -> dict[int, str]:
    """The session's live descendants (those running at its start and Python's own helpers aside): {pid: what it
    runs}."""
    import psutil

    left = {}
    for key, child in _descendants().items():
        if key in session.running:
            continue
        try:
            command = " ".join(child.cmdline())[:200]
        except psutil.NoSuchProcess:
            continue
        if not any(helper in command for helper in PYTHON_HELPERS):
            left[child.pid] = f"pid {child.pid}: {command}"
    return left


def _kill(processes: dict[int, str]) -> None:
    import psutil

    for pid in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    psutil.wait_procs([p for p in map(_process, processes) if p is not None], timeout=5)


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _reap_orphans() -> None:
    """Reap the exited descendants that became this subreaper's children (their parents exited first)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def left_namespaces(session: Session) -> list[str]:
    """The network namespaces still up whose owner the session's ledger recorded (no other namespace)."""
    try:
        recorded = set(session.ledger.read_text().split())
    except FileNotFoundError:
        return []
    return [name for name in netns.own_namespaces() if netns.parse_name(name)[0].tag in recorded]
