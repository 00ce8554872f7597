"""Run a function on N ranks forked from the calling process, over gloo, failing fast.

Forking (not spawning) reuses the parent's imported torch/megatron, so a multi-rank test starts in well
under a second on 2 cores. Every process group gets a short timeout; a rank that raises reports its
traceback and exits at once, and the parent kills the remaining ranks and raises.

    results = run_on_ranks(4, my_fn, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class RankFailure(RuntimeError):
    """A forked rank raised, timed out, or died."""


def _rank_main(rank, world_size, store_path, timeout_s, fn, args, kwargs, results, rank_setup=None):
    # What the rank inherited from the test process (a heap of ~1 GB once megatron is imported) is permanent here: the
    # rank's collections (automatic or gc.collect()) then scan only what the rank made, not the inherited heap, and
    # leave its pages shared (a full collection touched every object: 0.85 s per gc.collect() in a rank).
    gc.freeze()
    try:
        if rank_setup is not None:
            rank_setup(rank)  # e.g. join the rank's network namespace, before any socket is opened
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        dist.barrier()
        # Plain pickle: tensors would otherwise travel as shared-memory handles that die with the rank.
        results.put((rank, True, pickle.dumps(value)))
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, then die at once
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    results.close()
    results.join_thread()
    os._exit(0)


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

    Results are pickled in the rank, so they may hold tensors. Raises RankFailure with the first failing rank's
    traceback, or when ``timeout_s`` passes. ``rank_setup(rank)`` runs first in each rank, before its process group
    exists (the emulated cluster's ranks enter their network namespaces there:
    :func:`megatron_2d.testing.cluster_launch.run_on_cluster`).
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="m2d_store_")
    store_path = os.path.join(store_dir, "store")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, store_path, timeout_s, fn, args, kwargs, results, rank_setup),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        values: dict = {}
        deadline = time.monotonic() + timeout_s + 10.0
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"timed out after {timeout_s:.0f}s; ranks done: {sorted(values)}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead:
                    # Give the dead rank's report a moment to arrive through the queue.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise RankFailure(
                            f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]} and no report"
                        ) from None
                else:
                    continue
            if not ok:
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
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
