#!/usr/bin/env python
"""Calibrate the planner on this CPU from measured times of our 2D layouts, then check it: see
dev/megatron_2d_dev/bench/calibration.py.

    python tools/calibrate_planner.py                              # runs bench_compare --no-peers at N=4 and N=8
    python tools/calibrate_planner.py --from-json c4.json c8.json  # or reuse bench_compare.py --json outputs
"""

from megatron_2d_dev.bench.calibration import main

if __name__ == "__main__":
    main()
