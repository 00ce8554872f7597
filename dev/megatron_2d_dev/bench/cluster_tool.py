"""``tools/emulated_cluster.py``: bring an emulated cluster up or down, list what is up, measure one, or run the
end-to-end benchmark on one.

    python tools/emulated_cluster.py up --nodes 2 --ranks-per-node 4 --net-mbit 50 --nvl-mbit 450   # kept up
    python tools/emulated_cluster.py list
    python tools/emulated_cluster.py down                  # every kept cluster, and what killed runs left
    python tools/emulated_cluster.py sweep                 # only what killed runs left
    python tools/emulated_cluster.py measure --ranks 8 --nodes 2 --cluster dgx-h100 --gpu-seq 65536
    python tools/emulated_cluster.py pretrain --ranks 8 --nodes 2 --cluster dgx-h100    # bench/cluster_pretrain.py

``up`` prints each rank's namespace (enter one with ``ip netns exec NAME bash``); ``measure`` prints the scaling,
the links' measured figures and the planner's view of the cluster (megatron_2d_dev.bench.cluster), then tears it down.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .. import netns
from ..emulated_cluster import ClusterShape, EmulatedCluster
from .cluster import add_cluster_arguments, bench_cluster


def _up(argv) -> None:
    p = argparse.ArgumentParser(prog="emulated_cluster.py up")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--net-mbit", type=float, default=50.0)
    p.add_argument("--nvl-mbit", type=float, default=450.0)
    p.add_argument("--nics-per-node", type=int)
    p.add_argument("--burst-kib", type=int, default=16)
    a = p.parse_args(argv)
    shape = ClusterShape(a.nodes, a.ranks_per_node, a.net_mbit, a.nvl_mbit, a.nics_per_node, a.burst_kib)
    cluster = EmulatedCluster(shape, keep=True)
    cluster.build()
    print(shape.describe())
    for rank in range(shape.world):
        print(f"  rank {rank}: {cluster.rank_namespace(rank)}  {cluster.rank_address(rank)}")
    print(f"  switch: {cluster.switch}")
    print("enter one: ip netns exec NAME bash; remove: python tools/emulated_cluster.py down")


def _list(argv) -> None:
    for owner in netns.owners():
        names = [n for n in netns.own_namespaces() if netns.parse_name(n)[0] == owner]
        state = "kept" if owner.kept else ("running" if owner.alive() else "left by a killed run")
        print(f"{owner.tag}: {len(names)} namespaces, {state}")


def _down(argv) -> None:
    removed = netns.sweep_stale(include_kept=True)
    print(f"removed {len(removed)} namespaces" + (": " + " ".join(removed) if removed else ""))


def _sweep(argv) -> None:
    removed = netns.sweep_stale()
    print(f"removed {len(removed)} namespaces" + (": " + " ".join(removed) if removed else ""))


def _measure(argv) -> None:
    p = argparse.ArgumentParser(prog="emulated_cluster.py measure")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    add_cluster_arguments(p)
    a = p.parse_args(argv)
    if not (a.cluster or a.net_mbit):
        p.error("give --cluster PRESET or --net-mbit RATE")
    with bench_cluster(a, a.ranks, torch.bfloat16) as cluster:
        spec = cluster.spec
        print(
            f"planner's view: {spec.name}, {spec.gpus_per_node} ranks per node, NVLink {spec.nvlink_gbps * 1e3:.2f} "
            f"MB/s per rank, network {spec.net_gbps_per_node * 1e3:.2f} MB/s per node over {spec.nics_per_node} "
            f"NICs, attention {spec.peak_tflops * 1e3:.2f} GFLOP/s per rank, copy {spec.hbm_gbps:.2f} GB/s, "
            f"latency {spec.step_latency_us / 1e3:.2f} ms; {spec.links.describe()}"
        )


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"up": _up, "list": _list, "down": _down, "sweep": _sweep, "measure": _measure}
    if argv and argv[0] == "pretrain":
        from .cluster_pretrain import main as pretrain

        pretrain(argv[1:])
        return
    if not argv or argv[0] not in commands:
        raise SystemExit(f"usage: python tools/emulated_cluster.py {{{','.join([*commands, 'pretrain'])}}} ...")
    problem = netns.namespaces_problem()
    if problem and argv[0] != "list":
        raise SystemExit(f"the emulated cluster cannot be built here: {problem}")
    commands[argv[0]](argv[1:])
