#!/usr/bin/env python
"""Packed documents (THD) under 2D on CPU ranks: see megatron_2d/bench/packed.py."""

from megatron_2d.bench.packed import main

if __name__ == "__main__":
    main()
