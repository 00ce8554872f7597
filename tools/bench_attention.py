#!/usr/bin/env python
"""attention_2d fwd+bwd for every 2D layout of CP = N on forked CPU ranks: see dev/megatron_2d_dev/bench/attention.py.

python tools/bench_attention.py --ranks 4
"""

from megatron_2d_dev.bench.attention import main

if __name__ == "__main__":
    main()
