#!/usr/bin/env python
"""An emulated multi-node cluster on this machine (network namespaces, shaped links): up, down, list, sweep,
measure, and the end-to-end pretrain_gpt.py benchmark on it: see dev/megatron_2d_dev/bench/cluster_tool.py."""

from megatron_2d_dev.bench.cluster_tool import main

if __name__ == "__main__":
    main()
