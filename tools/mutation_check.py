#!/usr/bin/env python
"""Mutation check: apply one-line mutations to a scratch copy of the repository, one at a time, and report which
ones the tests catch.

    python tools/mutation_check.py                          # every mutation in tools/mutations.toml
    python tools/mutation_check.py --only merge-logaddexp   # some of them (ids, repeatable)
    python tools/mutation_check.py --module merge.py        # those whose file path contains this text
    python tools/mutation_check.py --threshold 95 --json results/mutations.json
    make mutation                                           # the whole list, threshold 95 (not part of CI)

The list (TOML, ``[[mutation]]`` tables) gives for each mutation:
    id           unique name
    file         path relative to the repository root
    original     a snippet that must occur EXACTLY ONCE in the file (checked for every mutation before anything
                 runs: a snippet that moved or was edited fails loudly, it is never silently skipped)
    replacement  what the snippet becomes
    tests        pytest arguments that should catch it, one list item per argument
                 (e.g. ["tests/test_plan.py", "-k", "traffic or memory"])
    note         why the mutation is wrong (and what should catch it)
    equivalent   optional, true for a mutation known to change nothing observable (reported, not counted)

Each mutation: copy the pristine file back, write the mutated one, run ``python -m pytest -x -q <tests>`` in the
scratch copy with PYTHONPATH pointing at it, under a timeout. Caught = the tests fail (or time out); survived =
they pass. Before the mutations the union of all named tests runs once unmutated (``--no-baseline`` skips it):
a baseline failure stops the run, since every mutation would then look caught. Exit status: 0 when the caught
share of non-equivalent mutations is at least ``--threshold`` percent, 1 below it, 2 on a broken list/baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LIST = REPO / "tools" / "mutations.toml"


class MutationListError(RuntimeError):
    """The mutation list is malformed or no longer matches the source."""


@dataclass
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    note: str = ""
    equivalent: bool = False


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # caught | survived | timeout | equivalent
    seconds: float
    detail: str = ""
    command: str = ""

    @property
    def caught(self) -> bool:
        return self.status in ("caught", "timeout")


def load_mutations(path: Path) -> list[Mutation]:
    data = tomllib.loads(path.read_text())
    raw = data.get("mutation", [])
    if not raw:
        raise MutationListError(f"{path}: no [[mutation]] tables")
    out, seen = [], set()
    for i, entry in enumerate(raw):
        missing = [k for k in ("id", "file", "original", "replacement", "tests") if k not in entry]
        if missing:
            raise MutationListError(f"{path}: mutation #{i} ({entry.get('id', '?')}) lacks {missing}")
        unknown = set(entry) - {"id", "file", "original", "replacement", "tests", "note", "equivalent"}
        if unknown:
            raise MutationListError(f"{path}: mutation {entry['id']} has unknown keys {sorted(unknown)}")
        if entry["id"] in seen:
            raise MutationListError(f"{path}: duplicate mutation id {entry['id']!r}")
        if entry["original"] == entry["replacement"]:
            raise MutationListError(f"{path}: mutation {entry['id']} replaces its snippet by itself")
        tests = entry["tests"]
        if isinstance(tests, str) or not tests:
            raise MutationListError(f"{path}: mutation {entry['id']}: tests must be a non-empty list of strings")
        seen.add(entry["id"])
        out.append(Mutation(**entry))
    return out


def check_snippets(mutations: Sequence[Mutation], root: Path) -> None:
    """Every original snippet must occur exactly once in its file; raise listing every one that does not."""
    problems = []
    for m in mutations:
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: file {m.file} does not exist")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            problems.append(f"{m.id}: snippet occurs {n} times in {m.file} (must be exactly once): {m.original!r}")
    if problems:
        raise MutationListError("the mutation list no longer matches the source:\n  " + "\n  ".join(problems))


def make_scratch(root: Path) -> Path:
    """A copy of the repository's tracked and untracked-but-not-ignored files, in a new temporary directory."""
    scratch = Path(tempfile.mkdtemp(prefix="m2d_mutation_"))
    listed = (
        subprocess.run(
            ["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"], check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = root / rel
        if src.is_file():
            dst = scratch / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return scratch


def pytest_command(python: str, tests: Sequence[str]) -> list[str]:
    """pytest's argv: each ``tests`` item is one argument (a "-k" expression stays one item)."""
    return [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]


def run_tests(scratch: Path, python: str, tests: Sequence[str], timeout: float):
    paths = [str(scratch), str(scratch / "dev"), os.environ.get("PYTHONPATH", "")]  # megatron_2d, megatron_2d_dev
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1")
    # the scratch copy has no ../shared beside it: point the pretrain tests at the checkout's Megatron-LM scripts
    env.setdefault("MEGATRON_LM_DIR", str(REPO.parent / "shared" / "megatron-lm" / "core_v0.19.0"))
    cmd = pytest_command(python, tests)
    start = time.monotonic()
    # a new session, so that a timeout kills pytest AND the ranks it forked (they would otherwise wait for gloo)
    proc = subprocess.Popen(
        cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, time.monotonic() - start, (output or "")[-2000:]
    return proc.returncode, time.monotonic() - start, (output or "")[-4000:]


def summary_line(output: str) -> str:
    lines = [l for l in output.strip().splitlines() if l.strip()]
    failed = [l for l in lines if l.startswith(("FAILED", "ERROR"))]
    return (failed[0] if failed else (lines[-1] if lines else ""))[:160]


def run_mutation(m: Mutation, scratch: Path, python: str, timeout: float) -> Outcome:
    target = scratch / m.file
    pristine = target.read_text()
    cmd = shlex.join(pytest_command("python", m.tests))
    if m.equivalent:
        return Outcome(m, "equivalent", 0.0, "marked equivalent (not run)", cmd)
    if pristine.count(m.original) != 1:
        raise MutationListError(f"{m.id}: snippet not found exactly once in the scratch copy of {m.file}")
    target.write_text(pristine.replace(m.original, m.replacement))
    try:
        rc, seconds, output = run_tests(scratch, python, m.tests, timeout)
    finally:
        target.write_text(pristine)
    if rc is None:
        return Outcome(m, "timeout", seconds, f"timed out after {timeout:.0f}s", cmd)
    if rc == 0:
        return Outcome(m, "survived", seconds, summary_line(output), cmd)
    if rc in (4, 5):  # usage error / no tests collected: the list is wrong, not the code
        raise MutationListError(f"{m.id}: pytest could not run {m.tests} (exit {rc}):\n{output}")
    return Outcome(m, "caught", seconds, summary_line(output), cmd)


def print_table(outcomes: Sequence[Outcome], pct: float, threshold: float) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        for o in outcomes:
            print(f"{o.status:10s} {o.mutation.id:34s} {o.mutation.file:42s} {o.seconds:6.1f}s  {o.detail}")
        print(f"caught {pct:.1f}% of non-equivalent mutations (threshold {threshold:g}%)")
        return
    table = Table(title="Mutation check", show_lines=False)
    for col in ("id", "file", "result", "s", "detail"):
        table.add_column(col, overflow="fold")
    style = {"caught": "green", "timeout": "green", "survived": "bold red", "equivalent": "yellow"}
    for o in outcomes:
        table.add_row(o.mutation.id, o.mutation.file, f"[{style[o.status]}]{o.status}[/]", f"{o.seconds:.1f}", o.detail)
    console = Console(width=max(160, shutil.get_terminal_size().columns))
    console.print(table)
    console.print(f"caught {pct:.1f}% of non-equivalent mutations (threshold {threshold:g}%)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", type=Path, default=DEFAULT_LIST, help="the mutation list (TOML)")
    p.add_argument("--only", action="append", default=[], help="run only these mutation ids (repeatable)")
    p.add_argument("--module", action="append", default=[], help="run only mutations whose file contains this")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation's test run")
    p.add_argument("--threshold", type=float, default=95.0, help="minimum caught percent for exit status 0")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    p.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    p.add_argument("--check-only", action="store_true", help="only check that every snippet matches the source")
    p.add_argument("--json", type=Path, help="also write the outcomes as JSON here")
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    args = p.parse_args(argv)

    try:
        mutations = load_mutations(args.list)
        check_snippets(mutations, REPO)
    except MutationListError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.only:
        unknown = set(args.only) - {m.id for m in mutations}
        if unknown:
            print(f"error: unknown mutation ids {sorted(unknown)}", file=sys.stderr)
            return 2
        mutations = [m for m in mutations if m.id in args.only]
    if args.module:
        mutations = [m for m in mutations if any(s in m.file for s in args.module)]
    if args.check_only:
        print(f"{len(mutations)} mutations; every snippet occurs exactly once")
        return 0
    if not mutations:
        print("error: no mutation selected", file=sys.stderr)
        return 2

    scratch = make_scratch(REPO)
    print(f"scratch copy: {scratch}", flush=True)
    try:
        if not args.no_baseline:
            selections = list(dict.fromkeys(tuple(m.tests) for m in mutations if not m.equivalent))
            for tests in selections:
                rc, seconds, output = run_tests(scratch, args.python, tests, args.timeout * 2)
                if rc != 0:
                    print(
                        f"error: the unmutated tests {list(tests)} fail (exit {rc}) in {seconds:.0f}s; every "
                        f"mutation would look caught. Fix them first:\n{output}",
                        file=sys.stderr,
                    )
                    return 2
            print(f"baseline: {len(selections)} test selections pass unmutated", flush=True)
        outcomes = []
        for i, m in enumerate(mutations, 1):
            o = run_mutation(m, scratch, args.python, args.timeout)
            outcomes.append(o)
            print(f"[{i}/{len(mutations)}] {m.id}: {o.status} ({o.seconds:.1f}s)", flush=True)
    except MutationListError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept scratch copy: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    counted = [o for o in outcomes if o.status != "equivalent"]
    pct = 100.0 * sum(o.caught for o in counted) / len(counted) if counted else 100.0
    print_table(outcomes, pct, args.threshold)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                [
                    {
                        "id": o.mutation.id,
                        "file": o.mutation.file,
                        "status": o.status,
                        "seconds": round(o.seconds, 1),
                        "detail": o.detail,
                        "command": o.command,
                    }
                    for o in outcomes
                ],
                indent=1,
            )
        )
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(outcomes, pct))
    return 0 if pct >= args.threshold else 1


def markdown_table(outcomes: Sequence[Outcome], pct: float) -> str:
    rows = ["| id | file | result | s | tests |", "|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(
            f"| {o.mutation.id} | {o.mutation.file} | {o.status} | {o.seconds:.0f} | `{shlex.join(o.mutation.tests)}` |"
        )
    counted = [o for o in outcomes if o.status != "equivalent"]
    rows.append("")
    rows.append(f"caught {sum(o.caught for o in counted)} of {len(counted)} non-equivalent mutations ({pct:.1f}%)")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
