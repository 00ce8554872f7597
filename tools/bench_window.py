#!/usr/bin/env python
"""Sliding windows under 2D on CPU ranks: see megatron_2d/bench/sliding_window.py."""

from megatron_2d.bench.sliding_window import main

if __name__ == "__main__":
    main()
