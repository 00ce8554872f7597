#!/usr/bin/env python
"""Double-Ring inner ring size w on CPU ranks, forward and backward: see megatron_2d_dev.bench.inner_ring_sizes."""

from megatron_2d_dev.bench.inner_ring_sizes import main

if __name__ == "__main__":
    main()
