#!/usr/bin/env python
"""Double-Ring window w on CPU ranks, forward and backward: see megatron_2d/bench/double_ring_windows.py."""

from megatron_2d.bench.double_ring_windows import main

if __name__ == "__main__":
    main()
