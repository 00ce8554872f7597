#!/usr/bin/env python
"""Dynamic (hybrid) CP under 2D against static CP on CPU ranks, one training step: see megatron_2d_dev.bench.dynamic."""

from megatron_2d_dev.bench.dynamic import main

if __name__ == "__main__":
    main()
