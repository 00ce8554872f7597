#!/usr/bin/env python
"""bf16 dK/dV error by rider dtype: see dev/megatron_2d_dev/bench/dkv_dtype.py."""

from megatron_2d_dev.bench.dkv_dtype import main

if __name__ == "__main__":
    main()
