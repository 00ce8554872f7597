"""Run a Megatron-LM entry script's ``pretrain()`` on forked CPU ranks and read what Megatron logged.

    logs = run_pretrain(4, script, ["--context-parallel-size", "4", ...])    # one log text per rank
    lm_losses(logs[-1])  ->  {1: 4.881578, 2: 4.818399, ...}                 # Megatron logs on the last rank

Ranks are forked from the calling process (see :func:`megatron_2d.testing.distributed.run_on_ranks`): the parent
imports torch, megatron.training and the script's dependencies once, each rank then only trains. The CPU mappings
of :mod:`.pretrain_cpu` are installed in the ranks only; the calling process is left as it was. Each rank writes
its stdout and stderr to its own file (it exits after the run), so the log is exactly what Megatron printed.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from .distributed import run_on_ranks
from .pretrain_cpu import install_pretrain_cpu_shims, refuse_with_cuda, run_script

DEFAULT_TIMEOUT_S = 150.0

ITERATION_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")


@dataclass
class RankOutcome:
    """How one rank's run ended: exit status as ``python script`` would report it, the error, and its log."""

    exit_status: int
    error: str | None
    log: str


def lm_losses(log: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from Megatron's training log lines (``... iteration 3/ 4 | ... | lm loss: X |``)."""
    return {int(it): float(loss) for it, loss in ITERATION_LOSS.findall(log)}


def per_iteration_losses(logged: dict[int, float]) -> dict[int, float]:
    """Each iteration's own loss from a run's logged ``lm loss`` values at ``--log-interval 1``.

    megatron.training logs the first iteration of every run (fresh or resumed) without resetting its loss
    accumulators, so the second logged value is the mean of the run's first two iterations; later values are their
    iteration's own. Runs that start at different iterations (a resumed run against an uninterrupted one) compare
    only after undoing that: ``L[first + 1] = 2 * logged[first + 1] - logged[first]``.
    """
    iterations = sorted(logged)
    if iterations != list(range(iterations[0], iterations[0] + len(iterations))):
        raise ValueError(f"logged iterations {iterations} are not consecutive; run with --log-interval 1")
    losses = dict(logged)
    if len(iterations) > 1:
        first = iterations[0]
        losses[first + 1] = 2 * logged[first + 1] - logged[first]
    return losses


def write_document_dataset(prefix: os.PathLike, lengths: Sequence[int], vocab: int, seed: int = 0) -> str:
    """A Megatron indexed dataset (``prefix``.bin / .idx, what ``--data-path prefix`` reads) of one document per
    length, random token ids below ``vocab - 1``; returns the prefix. For runs whose samples must cut through
    many documents (Megatron's mock data has documents of up to 4096 tokens)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(prefix)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    for length in lengths:
        builder.add_item(torch.from_numpy(rng.integers(0, vocab - 1, size=int(length), dtype=np.int64)))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def _exit_status(error: BaseException) -> int:
    if isinstance(error, SystemExit):
        code = error.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def _use_in_process_write_results() -> None:
    """Forked ranks are daemonic processes, which may not start children. Megatron's default checkpoint format
    (torch_dist) collects the results of its writer threads in a queue that it creates through a spawned
    ``multiprocessing.Manager``, which only an ``--async-save`` writer process needs: synchronous saving writes and
    reads that queue in the same process. A forked rank gets a plain in-process queue instead."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def _run_rank(
    rank: int, world_size: int, script: str, argv: Sequence[str], log_dir: str, must_succeed: bool
) -> RankOutcome:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    install_pretrain_cpu_shims()
    _use_in_process_write_results()
    path = os.path.join(log_dir, f"rank{rank}.log")
    error: BaseException | None = None
    with open(path, "w") as log:
        # fds 1 and 2 for C-level output, sys.stdout/stderr for Python's (pytest replaces them with its own)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = open(log.fileno(), "w", buffering=1, closefd=False)
        for handler in logging.root.handlers:  # handlers made before the fork hold the caller's stream
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(sys.stderr)
        try:
            run_script(script, argv)
        except BaseException as err:  # noqa: BLE001 (SystemExit from argparse included)
            error = err
        finally:
            sys.stdout.flush()
    with open(path) as log:
        text = log.read()
    if error is None or _exit_status(error) == 0:  # Megatron leaves with sys.exit(0) at --exit-interval
        return RankOutcome(0, None, text)
    if must_succeed:  # fail the whole run now instead of leaving the other ranks in a collective
        raise RuntimeError(
            f"{type(error).__name__}: {error}\n--- end of this rank's log ---\n{text[-4000:]}"
        ) from error
    return RankOutcome(_exit_status(error), f"{type(error).__name__}: {error}", text)


def _run(
    world_size: int, script: os.PathLike, argv: Sequence[str], timeout_s: float, must_succeed: bool
) -> list[RankOutcome]:
    refuse_with_cuda()  # before forking; the shims themselves are installed in the ranks, not in the caller
    with tempfile.TemporaryDirectory(prefix="m2d_pretrain_") as log_dir:
        return run_on_ranks(world_size, _run_rank, str(script), list(argv), log_dir, must_succeed, timeout_s=timeout_s)


def run_pretrain(
    world_size: int, script: os.PathLike, argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[str]:
    """Run ``script`` (its ``__main__``) with ``argv`` on ``world_size`` forked ranks; the per-rank logs. The first
    rank that fails ends the run at once: RankFailure with its error and the tail of its log."""
    return [outcome.log for outcome in _run(world_size, script, argv, timeout_s, must_succeed=True)]


def run_pretrain_outcomes(
    world_size: int, script: os.PathLike, argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[RankOutcome]:
    """As :func:`run_pretrain` for runs expected to fail: every rank's outcome. Raises RankFailure only when a rank
    dies or the run outlives ``timeout_s`` (a rank left waiting for one that stopped)."""
    return _run(world_size, script, argv, timeout_s, must_succeed=False)
