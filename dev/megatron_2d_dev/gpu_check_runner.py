"""gpu-check's rows and runner: every item in its own row, each run time-limited in a worker process.

    Row            one line of the table: item, case, result ("ok", "FAIL" or "not run") and detail
    NotRun         raised by an item that cannot run here (no CUDA, no Transformer Engine): a row that is not a pass
    Item           an item of a worker: its row's name, the function (returning its error measure) and the bound
    run_item       one item in this process, as a Row (an exception is a FAIL row; NotRun a "not run" row)
    run_worker     one worker's items, each announced and reported on stdout (the protocol below)
    run_streamed   the parent's side: start a worker (a command), read its reports, and end a worker that stays
                   silent for ``timeout`` seconds: its whole process tree (SIGTERM, then SIGKILL) and its current
                   case a FAIL row "timed out after N s"; a fresh worker then carries on with the next case
    summary        the last line: passes, failures and the items that did not run (never counted as passed)

Protocol (stdout lines; everything else a worker prints is ignored): ``GPU-CHECK PLAN [[item, case], ...]`` once
(the worker's cases, the same on every start), then per case ``GPU-CHECK START i`` and ``GPU-CHECK ROW {"index": i,
"result": ..., "detail": ...}``. A worker started with ``start`` runs cases ``start`` on. A worker under torchrun
reports from rank 0. torchrun starts its ranks in sessions of their own, so killing the worker's process group
would leave them running: every process seen under the worker while it runs (read from /proc, Linux) is
signalled too, also one whose parent has died meanwhile.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PREFIX = "GPU-CHECK "
OK, FAIL, NOT_RUN = "ok", "FAIL", "not run"


@dataclass
class Row:
    item: str
    case: str
    result: str  # OK, FAIL or NOT_RUN
    detail: str


class NotRun(Exception):  # noqa: N818  (a reason, not an error: the row says "not run")
    """An item that cannot run on this machine; its message says why (the row is not a pass)."""


@dataclass(frozen=True)
class Item:
    """One row's work: ``run()`` returns the row's measure (it passes below ``bound``), or (measure, a note for the
    row's detail), or raises."""

    item: str
    case: str
    run: Callable[[], float | tuple[float, str]]
    bound: float = 1.0
    label: str = "worst error / bound"

    @property
    def name(self) -> str:
        return f"{self.item}: {self.case}"


def run_item(item: Item) -> Row:
    """Run one item here and now (no time limit: :func:`run_streamed` keeps the time, from outside)."""
    start = time.perf_counter()
    try:
        value = item.run()
    except NotRun as why:
        return Row(item.item, item.case, NOT_RUN, str(why))
    except Exception as exc:  # noqa: BLE001  one broken item must not hide the others
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return Row(item.item, item.case, FAIL, f"{type(exc).__name__}: {first}")
    elapsed = time.perf_counter() - start
    value, note = value if isinstance(value, tuple) else (value, "")
    result = OK if value < item.bound else FAIL  # NaN fails
    return Row(item.item, item.case, result, f"{item.label} {value:.2f} ({note}{', ' if note else ''}{elapsed:.1f} s)")


def emit(kind: str, payload) -> None:
    print(f"{PREFIX}{kind} {json.dumps(payload)}", flush=True)


def run_worker(items: Sequence[Item], start: int = 0, report: bool = True, hang: Sequence[str] = ()) -> None:
    """Run ``items[start:]`` in order, announcing each and reporting its row (only where ``report``: rank 0 of a
    torchrun worker). ``hang``: a test hook, the items whose name ("item: case") contains one of these strings
    sleep instead of running."""
    if report:
        emit("PLAN", [[i.item, i.case] for i in items])
    for index in range(start, len(items)):
        if report:
            emit("START", index)
        if any(h in items[index].name for h in hang):
            time.sleep(3600)
        row = run_item(items[index])
        if report:
            emit("ROW", {"index": index, "result": row.result, "detail": row.detail})


# ---- the parent's side ----------------------------------------------------------------------------------------


class _Worker:
    """One started worker: its protocol messages as they come, with every process it has started tracked."""

    def __init__(self, command: list[str], env: dict[str, str] | None) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+", errors="replace")
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        self.tree: dict[int, int] = {}  # every process seen under it (pid: start time), kept if reparented
        self.other: deque[str] = deque(maxlen=5)  # its last lines outside the protocol
        self._lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def message(self, timeout: float):
        """The next (kind, value) of the protocol; None when the worker has ended (its output read to the end, or
        the worker gone while a process it left holds the pipe); raises TimeoutError when nothing came for
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.tree.update(process_tree(self.proc.pid))
            exited = self.proc.poll() is not None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if exited:  # gone a second ago, and nothing more came
                    return None
                continue
            if line is None:
                return None
            kind, _, payload = line[len(PREFIX) :].partition(" ") if line.startswith(PREFIX) else ("", "", "")
            try:
                return kind, json.loads(payload)
            except ValueError:
                self.other.append(line)

    def end(self, grace: float) -> str:
        """End the worker and everything it started; the tail of what it wrote (stderr, else other output)."""
        kill_tree(self.proc, grace, self.tree)
        self._reader.join(grace)  # the pipe ends once every process that held it is gone
        if not self._reader.is_alive():
            self.proc.stdout.close()
        self.stderr.seek(0)
        tail = " ".join((self.stderr.read().strip() or " ".join(self.other)).split())[-300:]
        self.stderr.close()
        return tail


def run_streamed(
    label: str,
    command: Callable[[int], list[str]],
    timeout: float,
    env: dict[str, str] | None = None,
    startup: float | None = None,
    grace: float = 5.0,
) -> list[Row]:
    """Every case of the worker ``command(start)`` (see the module docstring) as rows, each given ``timeout``
    seconds; each worker gets ``startup`` seconds (default ``timeout``) to list its cases. A case that overruns,
    or whose worker dies, is a FAIL row; the worker's process tree is ended and a new worker runs the cases after
    it. ``label`` names the worker in rows about the worker itself (one that dies or stalls before its list)."""
    startup = timeout if startup is None else startup
    plan: list[list[str]] | None = None
    rows: dict[int, Row] = {}
    start = 0
    while plan is None or start < len(plan):
        worker = _Worker(command(start), env)
        current, next_index = None, start
        listed = timed_out = False
        try:
            while True:
                try:
                    message = worker.message(timeout if listed else startup)
                except TimeoutError:
                    timed_out = True
                    break
                if message is None:
                    break
                kind, value = message
                if kind == "PLAN":
                    plan, listed = value, True
                elif kind == "START":
                    current = value
                elif kind == "ROW" and plan is not None:
                    item, case = plan[value["index"]]
                    rows[value["index"]] = Row(item, case, value["result"], value["detail"])
                    current, next_index = None, value["index"] + 1
        finally:
            tail = worker.end(grace)
        code = worker.proc.returncode
        if timed_out:
            before = " (before the case started)" if current is None and listed else ""
            why = f"timed out after {timeout if listed else startup:g} s{before}"
        else:
            why = f"worker exited with code {code}" + (f": {tail}" if tail else "")
        if plan is None:  # nothing to attribute it to but the worker
            return [Row(label, "worker", FAIL, f"{why} before listing its cases")]
        if next_index >= len(plan) and not timed_out and code == 0:
            break
        failed = current if current is not None else next_index
        if failed >= len(plan):  # every case reported, then the worker failed (e.g. at its shutdown)
            rows[len(plan)] = Row(label, "worker", FAIL, f"{why} after its last case")
            break
        item, case = plan[failed]
        rows[failed] = Row(item, case, FAIL, why)
        start = failed + 1
    return [rows[i] for i in sorted(rows)]


# ---- ending a process tree ------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, None if gone (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    state, ppid, started = fields[0], int(fields[1]), int(fields[19])
    return None if state in ("Z", "X") else (ppid, state, started)


def process_tree(pid: int) -> dict[int, int]:
    """{pid: start time} of ``pid`` and its live descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
                started[int(entry)] = stat[2]
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in started and p not in tree:
            tree[p] = started[p]
            todo.extend(children.get(p, ()))
    return tree


def alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` is running (not a zombie) and, when ``started`` is given, is still the same process."""
    stat = _stat(pid)
    return stat is not None and (started is None or stat[2] == started)


def _signal_all(group: int, tree: dict[int, int], sig: int) -> None:
    """``sig`` to the process group ``group`` (the worker's own session) and to every live process of ``tree``
    (torchrun's ranks run in sessions of their own)."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid, started in tree.items():
        if alive(pid, started):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def kill_tree(proc: subprocess.Popen, grace: float = 5.0, known: dict[int, int] | None = None) -> None:
    """End ``proc`` and every process under it (and those of ``known``, {pid: start time}, seen under it earlier
    and reparented since): SIGTERM, up to ``grace`` seconds, then SIGKILL for what is left; the tree is read again
    before each signal."""
    tree = {**(known or {}), **process_tree(proc.pid)}
    if proc.poll() is None or any(alive(p, s) for p, s in tree.items()):
        _signal_all(proc.pid, tree, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p, s) for p, s in tree.items()):
            proc.poll()  # reap the direct child as soon as it exits
            time.sleep(0.05)
        tree.update(process_tree(proc.pid))
        _signal_all(proc.pid, tree, signal.SIGKILL)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a wedged device): nothing more a signal can do
        pass


def summary(rows: Sequence[Row]) -> str:
    """The table's last line: "all N passed" only when every row ran and passed."""
    passed = sum(r.result == OK for r in rows)
    failed = sum(r.result == FAIL for r in rows)
    not_run = len(rows) - passed - failed
    if not failed and not not_run:
        return f"all {passed} passed"
    parts = [f"{passed} passed", f"{failed} failed"]
    if not_run:
        parts.append(f"{not_run} not run (not passes)")
    return ", ".join(parts)
