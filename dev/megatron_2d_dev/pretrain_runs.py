"""Run a Megatron-LM entry script's ``pretrain()`` on forked CPU ranks and read what Megatron logged.

    logs = run_pretrain(4, script, ["--context-parallel-size", "4", ...])    # one log text per rank
    lm_losses(logs[-1])  ->  {1: 4.881578, 2: 4.818399, ...}                 # Megatron logs on the last rank
    grad_norms(logs[-1]) ->  {1: 1.5309872627258301, ...}                    # full precision, checked against
                                                                             # Megatron's own 3-decimal line
    assert_same_training(trained(logs[-1]), trained(reference_logs[-1]), rtol=1e-5)   # both, every iteration

Ranks are forked from the calling process (see :func:`megatron_2d.testing.distributed.run_on_ranks`): the parent
imports torch, megatron.training and the script's dependencies once, each rank then only trains. The CPU mappings
of :mod:`.pretrain_cpu` are installed in the ranks only; the calling process is left as it was. Each rank writes
its stdout and stderr to its own file (it exits after the run), so the log is exactly what Megatron printed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import queue
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_2d.testing.distributed import run_on_ranks

from .pretrain_cpu import install_pretrain_cpu_shims, refuse_with_cuda, run_script

DEFAULT_TIMEOUT_S = 150.0

ITERATION_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")
ITERATION_GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.Ee+-]+) \|")
FULL_GRAD_NORM = re.compile(r"^\[pretrain_runs\] iteration (\d+) grad norm (\S+)$", re.MULTILINE)
"""The line each rank prints (:func:`_print_full_grad_norms`) with the grad norm Megatron logs to 3 decimals."""


@dataclass
class RankOutcome:
    """How one rank's run ended: exit status as ``python script`` would report it, the error, and its log."""

    exit_status: int
    error: str | None
    log: str


def lm_losses(log: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from Megatron's training log lines (``... iteration 3/ 4 | ... | lm loss: X |``)."""
    return {int(it): float(loss) for it, loss in ITERATION_LOSS.findall(log)}


def grad_norms(log: str) -> dict[int, float]:
    """``{iteration: grad norm}`` of the iterations Megatron logged, at full precision: the norm its optimizer step
    returned, as ``training_log`` received it (printed by the rank, :func:`_print_full_grad_norms`), each checked
    against the value of Megatron's own log line (``... | grad norm: 1.531 |``, 3 decimals), so that both read the
    same quantity. ValueError when a logged iteration has no full-precision line or the two disagree."""
    full = {int(it): norm for it, norm in FULL_GRAD_NORM.findall(log)}
    logged = {int(it): float(norm) for it, norm in ITERATION_GRAD_NORM.findall(log)}
    missing = sorted(set(logged) - {it for it, norm in full.items() if norm != "None"})
    if missing:
        raise ValueError(f"iterations {missing} logged a grad norm but printed none at full precision")
    found = {it: float(full[it]) for it in sorted(logged)}
    differing = {it: (found[it], logged[it]) for it in found if abs(found[it] - logged[it]) > 5.01e-4}
    if differing:
        raise ValueError(f"full-precision grad norms differ from Megatron's logged ones: {differing}")
    return found


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


@dataclass(frozen=True)
class Trained:
    """What one run logged per iteration: Megatron's ``lm loss`` and the optimizer's grad norm."""

    losses: dict[int, float]
    grad_norms: dict[int, float]

    def per_iteration(self) -> Trained:
        """With each iteration's own loss (:func:`per_iteration_losses`; grad norms are logged per iteration)."""
        return Trained(per_iteration_losses(self.losses), self.grad_norms)


def trained(log: str) -> Trained:
    """The lm loss and grad norm of every iteration ``log`` (the last rank's, where Megatron logs) shows."""
    return Trained(lm_losses(log), grad_norms(log))


def assert_same_training(
    got: Trained, expected: Trained, rtol: float, iterations=None, grad_norm_rtol: float | None = None
) -> None:
    """AssertionError unless ``got`` logged the loss and the grad norm of ``expected`` within ``rtol`` (the grad
    norm within ``grad_norm_rtol`` when given) at each of ``iterations`` (default: every iteration ``expected``
    logged), naming every value that differs."""
    iterations = sorted(expected.losses) if iterations is None else list(iterations)
    norm_rtol = rtol if grad_norm_rtol is None else grad_norm_rtol
    wrong = []
    for name, a, e, tol in (
        ("lm loss", got.losses, expected.losses, rtol),
        ("grad norm", got.grad_norms, expected.grad_norms, norm_rtol),
    ):
        missing = [it for it in iterations if it not in a or it not in e]
        if missing:
            wrong.append(f"{name}: iterations {missing} not logged ({sorted(a)} vs {sorted(e)})")
            continue
        wrong += [
            f"iteration {it} {name}: {a[it]!r} vs {e[it]!r} (relative {abs(a[it] - e[it]) / abs(e[it]):.1e})"
            for it in iterations
            if abs(a[it] - e[it]) > tol * abs(e[it])
        ]
    if wrong:
        raise AssertionError(f"not the same training within {rtol:g} (grad norm {norm_rtol:g}):\n" + "\n".join(wrong))


def write_document_dataset(
    prefix: os.PathLike, lengths: Sequence[int], vocab: int, seed: int = 0, append_eod: bool = False
) -> str:
    """A Megatron indexed dataset (``prefix``.bin / .idx, what ``--data-path prefix`` reads) of one document per
    length, random token ids below ``vocab - 1``; returns the prefix. For runs whose samples must cut through
    many documents (Megatron's mock data has documents of up to 4096 tokens). ``append_eod``: each document ends
    with NullTokenizer's end-of-document id, ``vocab - 1`` (as Megatron's preprocess_data.py --append-eod writes
    them; --eod-mask-loss masks those tokens)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(prefix)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    for length in lengths:
        tokens = rng.integers(0, vocab - 1, size=int(length), dtype=np.int64)
        builder.add_item(torch.from_numpy(np.append(tokens, vocab - 1) if append_eod else tokens))
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


def _print_full_grad_norms() -> None:
    """Megatron logs the grad norm to 3 decimals (``f"{grad_norm:.3f}"``): too coarse to compare runs at fp32
    tolerance. ``train`` calls ``training_log`` by its module-level name every iteration with the norm its optimizer
    step returned; wrapped here (in the forked rank only), it prints that norm in full first."""
    from megatron.training import training

    original = training.training_log
    if getattr(original, "_m2d_full_grad_norm", False):
        return

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        bound = inspect.signature(original).bind(*args, **kwargs)
        iteration, norm = bound.arguments["iteration"], bound.arguments["grad_norm"]
        print(f"[pretrain_runs] iteration {iteration} grad norm {norm if norm is None else repr(float(norm))}")
        return original(*args, **kwargs)

    training_log._m2d_full_grad_norm = True  # type: ignore[attr-defined]
    training.training_log = training_log


def _run_rank(
    rank: int, world_size: int, script: str, argv: Sequence[str], log_dir: str, must_succeed: bool
) -> RankOutcome:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    install_pretrain_cpu_shims()
    _use_in_process_write_results()
    _print_full_grad_norms()
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


_FIELD_DOCSTRINGS: dict[type, dict[str, str]] = {}
"""megatron.training's argument docstrings per config dataclass, read once per process tree (see
:func:`argument_docstrings_read_once`)."""


@contextlib.contextmanager
def argument_docstrings_read_once() -> Iterator[None]:
    """While inside, ``ArgumentGroupFactory._get_field_docstrings`` answers from a per-class memo of its own results.

    megatron.training's argument parser reads each config dataclass's field docstrings from its source
    (``inspect.getsource`` and ``ast.parse``) every time it is built: 0.1 s of CPU per parse here, the bulk of a
    parse (a pretrain_gpt.py rank parses three times). They are help texts, read from the class's source only, so
    the memo returns what the function would; it is filled by building Megatron's parser once, here, and forked
    ranks inherit it. Megatron's function is restored on exit."""
    import argparse

    from megatron.training import argument_utils, arguments

    factory = argument_utils.ArgumentGroupFactory
    original = factory._get_field_docstrings

    def field_docstrings(self, src_cfg_class):
        if src_cfg_class not in _FIELD_DOCSTRINGS:
            _FIELD_DOCSTRINGS[src_cfg_class] = original(self, src_cfg_class)
        return dict(_FIELD_DOCSTRINGS[src_cfg_class])

    factory._get_field_docstrings = field_docstrings
    try:
        if not _FIELD_DOCSTRINGS:
            arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        yield
    finally:
        factory._get_field_docstrings = original


@contextlib.contextmanager
def _done_once_before_forking() -> Iterator[None]:
    """What every rank of every run would do the same way, done once in the calling process, whose state the forked
    ranks inherit (the entry script itself still runs whole in each rank): Megatron's text tokenizers imported
    (``build_tokenizer`` imports ``megatron.core.tokenizers.text``, which imports ``transformers``: about 1.1 s of
    CPU a rank, more than the rest of a launch the checks refuse), and the argument docstrings read
    (:func:`argument_docstrings_read_once`). The calling process is left as it was, the import aside."""
    import megatron.core.tokenizers.text  # noqa: F401

    with argument_docstrings_read_once():
        yield


def _run(
    world_size: int, script: os.PathLike, argv: Sequence[str], timeout_s: float, must_succeed: bool
) -> list[RankOutcome]:
    refuse_with_cuda()  # before forking; the shims themselves are installed in the ranks, not in the caller
    with tempfile.TemporaryDirectory(prefix="m2d_pretrain_") as log_dir, _done_once_before_forking():
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
