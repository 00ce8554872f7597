"""Ranks on an emulated cluster (:mod:`.emulated_cluster`), launched the two ways (test and benchmark support).

Forked ranks (tests, benchmarks): :func:`run_on_cluster` is :func:`.distributed.run_on_ranks` whose ranks first
enter their own network namespace; everything else (file store, group timeouts, hang watchdog, fail-fast) is the same.

    with EmulatedCluster(ClusterShape(2, 2, 50, 450)) as cluster:
        results = run_on_cluster(cluster, my_fn, arg)     # my_fn(rank, world_size, arg) in rank's namespace

One torchrun per node, as a real cluster runs the project's launch scripts, unchanged:

    runs = run_torchrun_gpt(cluster, {"MODE": "2d", "CP": "4", "HP": "2"}, rank_flags=TINY_MODEL)
    runs = run_slurm_gpt(cluster, {"MODE": "2d", ...}, rank_flags=TINY_MODEL)

``run_torchrun_gpt`` runs ``bash examples/launch/torchrun_gpt.sh`` in each node's namespace (that of its local
rank 0) with NNODES, NODE_RANK, MASTER_ADDR (node 0's address) and MASTER_PORT, as a user does on each node.
``run_slurm_gpt`` runs ``examples/launch/slurm_gpt.sbatch`` on node 0 as Slurm would, with stand-ins for the two
Slurm commands it calls on PATH: ``srun`` starts its command once per node in that node's namespace with
SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID set (``--ntasks-per-node=1``; ``--export`` honoured, the container
options accepted), and refuses a call without a command as srun does; ``scontrol show hostnames`` prints the
nodes' addresses (both in :mod:`.cluster_worker`). Either way torchrun starts G workers per node; each worker (a
Python process started with a ``sitecustomize`` that :func:`worker_site_dir` writes, active only where torchrun
set GROUP_RANK and LOCAL_RANK) joins its rank's namespace, installs the CPU shims of :mod:`.pretrain_cpu` and
appends their flags, and ``M2D_RANK_FLAGS`` (flags that shrink the model to CPU size: later flags win in
Megatron's parser), before the script runs. Each node's output goes to its own log; the Megatron logs of the
last rank are on the last node's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import megatron_2d_dev
from megatron_2d.testing.distributed import DEFAULT_TIMEOUT_S, run_on_ranks

from .cluster_worker import CLUSTER_ENV, NODES_ENV, RANK_FLAGS_ENV
from .emulated_cluster import EmulatedCluster

MASTER_PORT = "6000"
"""As slurm_gpt.sbatch sets it: each node's namespace has its own ports, so it is free in every cluster."""
REPO_ROOT = str(megatron_2d_dev.REPO_ROOT)
TORCHRUN_GPT = os.path.join(REPO_ROOT, "examples", "launch", "torchrun_gpt.sh")
SLURM_GPT = os.path.join(REPO_ROOT, "examples", "launch", "slurm_gpt.sbatch")


GPT_FLAGS = os.path.join(REPO_ROOT, "examples", "launch", "gpt_flags.sh")
TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --num-query-groups 2 "
    "--vocab-size 128 --make-vocab-size-divisible-by 64 --lr-warmup-iters 0 --distributed-timeout-minutes 10 "
    "--no-bias-swiglu-fusion"
).split()
"""Flags that shrink gpt_flags.sh's model to CPU size (later flags win): 2 layers, hidden 64, 8 query heads in 2
groups, vocabulary 128, no warm-up (a run of one iteration), ten-minute group timeouts (for a loaded machine), and no
swiglu fusion (on CPU its torch.compile takes ~20 s of the first iteration per rank)."""


def launch_flags(mode_env: Mapping[str, str], arrays: Sequence[str] = ("MODEL_FLAGS", "TRAIN_FLAGS")) -> list[str]:
    """The flags examples/launch/gpt_flags.sh builds for ``mode_env`` (MODE, CP, SEQ, ...), from its ``arrays``
    (MODEL_FLAGS, TRAIN_FLAGS, PARALLEL_FLAGS, CP_FLAGS), as torchrun_gpt.sh passes them."""
    shown = " ".join(f'"${{{name}[@]}}"' for name in arrays)
    out = subprocess.run(
        ["bash", "-c", f'source "{GPT_FLAGS}" && printf "%s\\n" {shown}'],
        env={"PATH": "/usr/bin:/bin", **mode_env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split("\n")[:-1]


def run_on_cluster(
    cluster: EmulatedCluster, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    """:func:`.distributed.run_on_ranks` with one rank per rank of ``cluster``, each in its own namespace."""
    return run_on_ranks(cluster.shape.world, fn, *args, timeout_s=timeout_s, rank_setup=cluster.enter_rank, **kwargs)


# -- one torchrun per node --------------------------------------------------------------------------------------


@dataclass
class NodeRun:
    """How one node's launch ended: its exit status (None: killed at the deadline) and its output."""

    node: int
    returncode: int | None
    log: str


class LaunchFailure(RuntimeError):
    """A node's launch failed or timed out; the message holds the tail of every node's log."""


def worker_site_dir(parent: str) -> str:
    """A folder holding the ``sitecustomize`` of the CPU workers (see the module docstring); put it first on the
    launched processes' PYTHONPATH."""
    folder = os.path.join(parent, "site")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(
            "# written by megatron_2d_dev.cluster_launch: CPU workers of an emulated cluster\n"
            "import os\n"
            "if os.environ.get('GROUP_RANK') and os.environ.get('LOCAL_RANK') "
            f"and os.environ.get({CLUSTER_ENV!r}):\n"
            "    from megatron_2d_dev.cluster_worker import start_worker\n"
            "    start_worker()\n"
        )
    return folder


def _launch_env(cluster: EmulatedCluster, workdir: str, rank_flags: Sequence[str], extra: Mapping[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "SLURM_"))}
    bin_dir = os.path.join(workdir, "bin")
    env.update(
        {
            "PATH": os.pathsep.join([bin_dir, os.path.dirname(sys.executable), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([worker_site_dir(workdir), REPO_ROOT, str(megatron_2d_dev.DEV_ROOT)]),
            CLUSTER_ENV: cluster.owner.tag,
            NODES_ENV: str(cluster.shape.nodes),
            RANK_FLAGS_ENV: shlex.join(rank_flags),
            "GPUS_PER_NODE": str(cluster.shape.ranks_per_node),
            "TORCHELASTIC_ERROR_FILE": os.path.join(workdir, "error.json"),
            # torchrun's log folder (torchelastic_*, which torch never removes) and the workers' temporary files:
            # inside the work folder, removed with it
            "TMPDIR": os.path.join(workdir, "tmp"),
        }
    )
    os.makedirs(env["TMPDIR"], exist_ok=True)
    env.update(extra)
    return env


def _write_slurm_stand_ins(workdir: str) -> None:
    bin_dir = os.path.join(workdir, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    for command in ("srun", "scontrol"):
        path = os.path.join(bin_dir, command)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" -m megatron_2d_dev.cluster_worker {command} "$@"\n')
        os.chmod(path, 0o755)


def _run_nodes(
    cluster: EmulatedCluster,
    nodes: Sequence[int],
    command: Sequence[str],
    env_of: Callable[[int], Mapping[str, str]],
    workdir: str,
    timeout_s: float,
) -> list[NodeRun]:
    """Run ``command`` once in each of ``nodes``' namespaces (local rank 0's), at once; wait for all, killing them
    all at the deadline or as soon as one fails."""
    procs, logs = {}, {}
    try:
        for node in nodes:
            logs[node] = open(os.path.join(workdir, f"node{node}.log"), "w+")
            procs[node] = subprocess.Popen(
                ["ip", "netns", "exec", cluster.namespace(node, 0), *command],
                env=dict(env_of(node)),
                cwd=REPO_ROOT,
                stdout=logs[node],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs.values()):
                time.sleep(2.0)  # let the others report the failure they see, then stop them
                break
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.wait()
    runs = []
    for node in nodes:
        logs[node].seek(0)
        text = logs[node].read()
        logs[node].close()
        code = procs[node].returncode
        runs.append(NodeRun(node, None if code == -9 else code, text))
    return runs


def check_runs(runs: Sequence[NodeRun], what: str, tail: int = 3000) -> None:
    """LaunchFailure naming each node that did not exit 0, with the tail of its log."""
    bad = [r for r in runs if r.returncode != 0]
    if bad:
        shown = "\n".join(
            f"--- node {r.node}: {'killed at the deadline' if r.returncode is None else f'exit {r.returncode}'}\n"
            f"{r.log[-tail:]}"
            for r in bad
        )
        raise LaunchFailure(f"{what} failed on nodes {[r.node for r in bad]}:\n{shown}")


def run_torchrun_gpt(
    cluster: EmulatedCluster,
    mode_env: Mapping[str, str],
    rank_flags: Sequence[str] = (),
    args: Sequence[str] = (),
    timeout_s: float = 300.0,
    megatron_lm_dir: str | None = None,
) -> list[NodeRun]:
    """``bash examples/launch/torchrun_gpt.sh ARGS`` on every node at once with NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT (and ``mode_env``: MODE, CP, HP, WINDOW, ...), workers on CPU ranks (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="m2d_cluster_launch_") as workdir:
        base = _launch_env(cluster, workdir, rank_flags, _megatron_env(mode_env, megatron_lm_dir))

        def env_of(node: int) -> dict:
            return base | {
                "NNODES": str(cluster.shape.nodes),
                "NODE_RANK": str(node),
                "MASTER_ADDR": cluster.address(0, 0),
                "MASTER_PORT": MASTER_PORT,
            }

        return _run_nodes(
            cluster, range(cluster.shape.nodes), ["bash", TORCHRUN_GPT, *args], env_of, workdir, timeout_s
        )


def run_slurm_gpt(
    cluster: EmulatedCluster,
    mode_env: Mapping[str, str],
    rank_flags: Sequence[str] = (),
    timeout_s: float = 300.0,
    megatron_lm_dir: str | None = None,
) -> list[NodeRun]:
    """``examples/launch/slurm_gpt.sbatch`` as Slurm runs it (the batch script on node 0, ``srun`` and
    ``scontrol`` stand-ins on PATH: module docstring). One NodeRun: the batch script's, whose log holds every
    node's output (srun forwards them, each line prefixed by its node)."""
    with tempfile.TemporaryDirectory(prefix="m2d_cluster_launch_") as workdir:
        _write_slurm_stand_ins(workdir)
        env = _launch_env(cluster, workdir, rank_flags, _megatron_env(mode_env, megatron_lm_dir))
        env |= {
            "SLURM_JOB_NODELIST": f"emulated[0-{cluster.shape.nodes - 1}]",
            "SLURM_NNODES": str(cluster.shape.nodes),
            "SLURM_JOB_NUM_NODES": str(cluster.shape.nodes),
            "WORKDIR": REPO_ROOT,
        }
        return _run_nodes(cluster, [0], ["bash", SLURM_GPT], lambda node: env, workdir, timeout_s)


def _megatron_env(mode_env: Mapping[str, str], megatron_lm_dir: str | None) -> dict:
    """``mode_env`` and MEGATRON_LM_DIR (examples/pretrain_gpt_2d.py imports Megatron-LM's pretrain_gpt.py)."""
    env = dict(mode_env)
    if megatron_lm_dir is not None:
        env["MEGATRON_LM_DIR"] = megatron_lm_dir
    return env
