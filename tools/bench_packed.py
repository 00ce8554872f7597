#!/usr/bin/env python
"""Packed documents (THD) under 2D on CPU ranks: see dev/megatron_2d_dev/bench/packed.py."""

from megatron_2d_dev.bench.packed import main

if __name__ == "__main__":
    main()
