#!/usr/bin/env python
"""Sliding windows under 2D on CPU ranks: see dev/megatron_2d_dev/bench/sliding_window.py."""

from megatron_2d_dev.bench.sliding_window import main

if __name__ == "__main__":
    main()
