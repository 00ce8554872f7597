#!/usr/bin/env python
"""`make gpu-check`: every GPU path of attention_2d on this machine, one table, pass/fail per item.

    python tools/gpu_smoke.py --device cuda     # on a GPU machine (under 5 minutes on one H100)
    python tools/gpu_smoke.py --dry-run         # the same items on CPU at small sizes (CI runs it)

The code is megatron_2d_dev.gpu_check (its docstring lists the items).
"""

import sys

from megatron_2d_dev.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
