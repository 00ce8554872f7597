#!/usr/bin/env python
"""Side-by-side fwd+bwd attention benchmark, ours and the peers, with a correctness gate: see
dev/megatron_2d_dev/bench/compare.py (the rows and their byte counts: dev/megatron_2d_dev/bench/runners.py).

    python tools/bench_compare.py --ranks 4                  # CPU: N forked gloo ranks, bf16
    torchrun --nproc-per-node 8 tools/bench_compare.py --device cuda --seq 65536 --heads 32 --kv-heads 8 --dim 128
"""

from megatron_2d_dev.bench.compare import main

if __name__ == "__main__":
    main()
