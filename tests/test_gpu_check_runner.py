"""gpu-check survives a hang (megatron_2d_dev.gpu_check_runner): a case that hangs is a FAIL row "timed out after
N s", its worker's whole process tree is ended (torchrun's ranks, which run in sessions of their own, included), the
cases after it still run in a fresh worker, and the table is printed with a nonzero exit status.

Processes are found independently of the runner: every process started under a test carries a marker in its
environment, and /proc is scanned for it while the run goes on (so the scan is seen to find the workers) and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import threading
import time
import uuid

import pytest

from megatron_2d_dev import gpu_check
from megatron_2d_dev.gpu_check_runner import FAIL, NOT_RUN, OK, Row, alive, run_streamed, summary

MARKER = "MEGATRON_2D_GPU_CHECK_TEST"


def marked_processes(marker: str) -> dict[int, str]:
    """{pid: command line} of the running processes (zombies excluded) whose environment holds ``MARKER=marker``."""
    found = {}
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    marked = needle in f.read().split(b"\0")
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marked and alive(int(entry)):
                found[int(entry)] = command
    return found


class Watch:
    """Polls /proc for the marked processes while a run goes on: {pid: command line} of every one seen."""

    def __init__(self, marker: str):
        self.marker, self.seen, self._stop = marker, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            self.seen.update(marked_processes(self.marker))
            time.sleep(0.1)

    def count(self, text: str, unless: str = "\0") -> int:
        """How many of the processes seen had ``text`` in their command line (and not ``unless``)."""
        return sum(text in command and unless not in command for command in self.seen.values())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


FAKE_WORKER = textwrap.dedent(
    """
    import json, subprocess, sys, time
    start = int(sys.argv[1])
    def emit(kind, value):
        print("GPU-CHECK", kind, json.dumps(value), flush=True)
    emit("PLAN", [["fake", f"case {i}"] for i in range(5)])
    for i in range(start, 5):
        emit("START", i)
        if i in (1, 3):  # a child in a session of its own (as torchrun starts its ranks), holding the pipe
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            time.sleep(600 if i == 1 else 1)  # 1 hangs; 3 dies and leaves its child behind
            sys.exit(4)
        if i == 2:
            print("the worker crashed", file=sys.stderr)
            sys.exit(3)
        emit("ROW", {"index": i, "result": "ok", "detail": "fine"})
    """
)


@pytest.mark.slow
def test_a_hung_case_is_a_failed_row_and_the_rest_still_run(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{MARKER: marker})
    with Watch(marker) as watch:
        rows = run_streamed("fake worker", lambda start: [sys.executable, str(script), str(start)], 5.0, env)
    assert rows == [
        Row("fake", "case 0", OK, "fine"),
        Row("fake", "case 1", FAIL, "timed out after 5 s"),
        Row("fake", "case 2", FAIL, "worker exited with code 3: the worker crashed"),
        Row("fake", "case 3", FAIL, "worker exited with code 4"),
        Row("fake", "case 4", OK, "fine"),
    ]
    assert watch.count("sleep(600)") == 2 and watch.count(str(script)) >= 2  # the children and workers were seen
    assert not marked_processes(marker)  # and none survives, the orphan of case 3 included
    assert summary(rows) == "2 passed, 3 failed"


def test_summary_never_counts_a_row_that_did_not_run_as_passed():
    ok, failed, skipped = Row("a", "x", OK, ""), Row("b", "y", FAIL, ""), Row("c", "z", NOT_RUN, "no TE")
    assert summary([ok, ok]) == "all 2 passed"
    assert summary([ok, skipped]) == "1 passed, 0 failed, 1 not run (not passes)"
    assert summary([ok, failed, skipped]) == "1 passed, 1 failed, 1 not run (not passes)"


@pytest.mark.slow
def test_a_worker_that_never_lists_its_cases_is_one_failed_row(tmp_path):
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{MARKER: marker})
    rows = run_streamed("stuck worker", lambda start: [sys.executable, "-c", "import time; time.sleep(600)"], 1.0, env)
    assert rows == [Row("stuck worker", "worker", FAIL, "timed out after 1 s before listing its cases")]
    assert not marked_processes(marker)


@pytest.mark.distributed
def test_gpu_check_survives_a_distributed_case_that_hangs_in_a_collective(capsys):
    """The real distributed part of the dry run (torchrun, 2 gloo ranks) with the Double-Ring case made to hang:
    rank 1 sleeps (the --hang test hook), so rank 0 waits in that case's first collective. The row times out,
    torchrun and both ranks are ended, a new torchrun runs every case after it, and the table is printed."""
    marker = uuid.uuid4().hex
    args = argparse.Namespace(device="cpu", hang=["Double-Ring"], timeout=20.0, startup_timeout=300.0)
    env = dict(gpu_check.worker_env(), **{MARKER: marker})
    with Watch(marker) as watch:
        rows = gpu_check.distributed_rows(args, 2, env)
    status = gpu_check.report("hang test", rows)
    out = capsys.readouterr().out
    cases = [r.case for r in rows]
    hung = cases.index("Double-Ring cp2 w2")
    assert rows[hung].result == FAIL and rows[hung].detail == "timed out after 20 s", rows[hung]
    assert hung < len(rows) - 1 and all(r.result == OK for i, r in enumerate(rows) if i != hung), rows
    assert status == 1 and "Double-Ring cp2 w2" in out and out.rstrip().endswith(summary(rows))
    assert watch.count("torch.distributed.run") == 2  # two torchruns were seen (the first one ended at the hang)
    assert watch.count("gpu_check_distributed", unless="torch.distributed.run") == 4  # and their two ranks each
    assert not marked_processes(marker)  # and none survives
