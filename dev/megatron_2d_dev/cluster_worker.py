"""What runs inside an emulated cluster's nodes when one torchrun per node launches (test support): the CPU
workers' start, and stand-ins for the two Slurm commands slurm_gpt.sbatch calls (:mod:`.cluster_launch`).

Standard library only at import: a worker joins its network namespace before torch (and its threads) load, and the
Slurm stand-ins start quickly.

    start_worker()                                        # from the workers' sitecustomize (cluster_launch)
    python -m megatron_2d_dev.cluster_worker srun --export=ALL,MASTER_ADDR=... bash -c '...'
    python -m megatron_2d_dev.cluster_worker scontrol show hostnames LIST
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from . import netns

CLUSTER_ENV = "M2D_CLUSTER"
"""The environment variable naming the cluster (its namespaces' stem) to the launched processes."""
NODES_ENV = "M2D_CLUSTER_NODES"
RANK_FLAGS_ENV = "M2D_RANK_FLAGS"
"""Flags each CPU worker appends to its script's command line (shlex-quoted)."""
TE_RELEASE_ENV = "M2D_TE_RELEASE"
"""When set, the Transformer Engine release whose CPU context each CPU worker runs in (stock Megatron CP:
megatron_2d_dev.te_context_parallel, with megatron-core's TE extension; the claim only around TE's attention,
megatron_2d_dev.stock_cp_spec)."""
_HELD = contextlib.ExitStack()
"""The contexts a worker holds for its whole process (it only runs the script), closed at exit (atexit, before the
interpreter tears modules down) in reverse order."""


def node_address(node: int) -> str:
    """Node ``node``'s address (its local rank 0's; :meth:`.emulated_cluster.EmulatedCluster.address`)."""
    return f"169.254.{10 + node}.10"


def start_worker() -> None:
    """In a torchrun worker of an emulated node: join the rank's namespace, make gloo use its NIC, install the
    CPU shims of megatron.training (and, with ``M2D_TE_RELEASE``, enter that Transformer Engine release's CPU
    context, as ``pretrain_cpu --te-release`` does) and append the CPU flags and ``M2D_RANK_FLAGS`` to the command
    line."""
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    netns.enter_namespace(f"{os.environ[CLUSTER_ENV]}-n{node}r{local}")
    os.environ["GLOO_SOCKET_IFNAME"] = "nic"
    import torch

    from .megatron_cpu import megatron_ddp_on_cpu
    from .pretrain_cpu import CPU_FLAGS, install_pretrain_cpu_shims

    torch.set_num_threads(1)
    install_pretrain_cpu_shims()
    if os.environ.get(TE_RELEASE_ENV):
        from .te_context_parallel import te_context_parallel_on_cpu

        _HELD.enter_context(te_context_parallel_on_cpu(os.environ[TE_RELEASE_ENV], megatron=True, claim_cuda=False))
    _HELD.enter_context(megatron_ddp_on_cpu())
    atexit.register(_HELD.close)
    sys.argv += shlex.split(os.environ.get(RANK_FLAGS_ENV, "")) + CPU_FLAGS


SRUN_VALUE_OPTIONS = ("--container-image", "--container-workdir", "--export", "--ntasks-per-node", "--nodes")


def srun_main(argv: Sequence[str]) -> int:
    """``srun [options] COMMAND...`` on every node of the cluster named by the environment, one task per node,
    each line of a task's output prefixed by its node."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith("-"):
        name, eq, value = rest.pop(0).partition("=")
        if name not in SRUN_VALUE_OPTIONS:
            print(f"srun (emulated cluster): option {name!r} is not emulated ({SRUN_VALUE_OPTIONS})", file=sys.stderr)
            return 2
        if not eq:
            if not rest:
                print(f"srun: option {name} needs a value", file=sys.stderr)
                return 2
            value = rest.pop(0)
        options[name] = value
    if not rest:
        print("srun: fatal: No command given to execute.", file=sys.stderr)
        return 1
    env = dict(os.environ)
    exports = options.get("--export", "ALL").split(",")
    if exports[0] != "ALL":
        print(f"srun (emulated cluster): only --export=ALL[,NAME=value...] is emulated, got {exports}", file=sys.stderr)
        return 2
    for item in exports[1:]:
        key, _, value = item.partition("=")
        env[key] = value
    tag, nodes = os.environ[CLUSTER_ENV], int(os.environ[NODES_ENV])
    cwd = options.get("--container-workdir", os.getcwd())
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", f"{tag}-n{node}r0", *rest],
            env=env | {"SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    codes = []
    for node, p in enumerate(procs):
        out, _ = p.communicate()
        for line in out.splitlines():
            print(f"{node}: {line}", flush=True)
        codes.append(p.returncode)
    return max(abs(c) for c in codes)


def scontrol_main(argv: Sequence[str]) -> int:
    """``scontrol show hostnames LIST``: the emulated nodes' addresses, node 0 first."""
    if list(argv[:2]) != ["show", "hostnames"]:
        print(f"scontrol (emulated cluster): only `show hostnames` is emulated, got {list(argv)}", file=sys.stderr)
        return 2
    text = "".join(f"{node_address(node)}\n" for node in range(int(os.environ[NODES_ENV])))
    try:  # one write, as scontrol's: a reader that takes the first line only (head -n 1) has it all
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"srun": srun_main, "scontrol": scontrol_main}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m megatron_2d_dev.cluster_worker {{{','.join(commands)}}} ARGS", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
