"""Nothing left behind: tools/pretrain_gpt_cpu.sh removes its copy of Megatron-LM's scripts however torchrun ends
(its exit status passed on, a signal passed to torchrun), and the session check of tests/conftest.py
(megatron_2d_dev.leftovers) finds what a session leaves (temporary files, processes, orphans included, network
namespaces of its own ledger), removes only that, and restores the session it ran in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_2d_dev import leftovers, netns

REPO = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python -m megatron_2d_dev.megatron_lm WORK ...: names a script in WORK (copies nothing)
echo copied > "$3/pretrain.py" && echo "$3/pretrain.py"
"""
FAKE_TORCHRUN = """#!/usr/bin/env bash
# stands in for torchrun: makes its log folder as torchrun does (tempfile.mkdtemp, never removed), then exits with 3,
# or runs until SIGTERM (then says so and exits 143)
mktemp -d -t torchelastic_XXXXXXXX > /dev/null
[ "$FAKE_MODE" = exit ] && echo $$ > "$FAKE_DIR/pid" && exit 3
sleep 60 & SLEEPER=$!
trap 'kill $SLEEPER; echo term > "$FAKE_DIR/term"; exit 143' TERM
echo $$ > "$FAKE_DIR/pid"
wait
"""


def _fake_tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("torchrun", FAKE_TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _launch(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    env = {
        **os.environ,
        "PY": str(_fake_tools(tmp_path) / "python"),
        "TMPDIR": str(temp_root),
        "FAKE_DIR": str(tmp_path),
        "FAKE_MODE": mode,
    }
    script = subprocess.Popen(["bash", str(REPO / "tools" / "pretrain_gpt_cpu.sh")], env=env)
    return script, temp_root


def test_pretrain_gpt_cpu_removes_its_work_folder_and_passes_the_exit_status_on(tmp_path):
    """torchrun's exit status is the script's, and the work folder (the copied scripts) is gone: before, the script
    exec'd torchrun, so its EXIT trap never ran and every run left a folder in the temporary directory."""
    script, temp_root = _launch(tmp_path, "exit")
    assert script.wait(timeout=60) == 3
    assert (tmp_path / "pid").exists() and list(temp_root.iterdir()) == []


def test_pretrain_gpt_cpu_passes_a_signal_to_torchrun_and_cleans_up(tmp_path):
    """SIGTERM to the script reaches torchrun (which stops its workers on it); the script waits for it, returns its
    status and removes the work folder; nothing it started still runs."""
    script, temp_root = _launch(tmp_path, "run")
    deadline = time.monotonic() + 30
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
        assert time.monotonic() < deadline and script.poll() is None, "the fake torchrun never started"
        time.sleep(0.05)
    torchrun = int((tmp_path / "pid").read_text())
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=60) == 143
    assert (tmp_path / "term").read_text().strip() == "term"
    assert list(temp_root.iterdir()) == []
    assert not _alive(torchrun)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_session_check_finds_and_removes_what_a_session_left(monkeypatch):
    """Inside a session (nested in this test's): a temporary file, a process, an orphan (its parent exited, so it is
    this subreaper's), and a namespace of the session's ledger are listed and removed; another owner's namespace
    is neither listed nor touched; the outer session's temporary root and ledger come back."""
    outer = (tempfile.gettempdir(), os.environ.get("TMPDIR"), os.environ.get(netns.LEDGER_ENV))
    session = leftovers.start_session()
    assert tempfile.gettempdir() == str(session.temp_dir) == os.environ["TMPDIR"]
    ours, theirs = netns.Owner(os.getpid(), 1, 7), netns.Owner(1, 1, 0)
    netns.record_owner(ours)
    monkeypatch.setattr(netns, "own_namespaces", lambda: [ours.name("sw"), theirs.name("sw"), ours.name("n0r0")])
    deleted = []
    monkeypatch.setattr(netns, "delete_owned", deleted.append)
    tempfile.mkstemp(prefix="left_")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    orphan_parent = subprocess.run(
        ["bash", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    orphan = int(orphan_parent.stdout)
    left = leftovers.left_processes(session)
    assert sleeper.pid in left and orphan in left, left

    problems = leftovers.finish_session(session)

    assert len(problems) == 3, problems
    assert "processes still running" in problems[0], problems
    assert f"pid {sleeper.pid}: " in problems[0] and f"pid {orphan}: sleep 60" in problems[0], problems
    assert problems[1] == f"2 network namespaces: {ours.name('sw')}, {ours.name('n0r0')}"
    assert problems[2].startswith("1 temporary files or folders") and "left_" in problems[2]
    assert deleted == [ours]
    sleeper.wait(timeout=10)  # killed and reaped by the check (its status is the check's)
    assert not _alive(sleeper.pid) and not _alive(orphan)
    assert not session.temp_dir.exists()
    assert (tempfile.gettempdir(), os.environ.get("TMPDIR"), os.environ.get(netns.LEDGER_ENV)) == outer


def test_a_clean_session_reports_nothing():
    session = leftovers.start_session()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "kept").write_text("removed with its folder")
    subprocess.run(["true"], check=True)
    assert leftovers.finish_session(session) == []
