#!/usr/bin/env python
"""QK-clip's max attention logit: its cost per kernel on forked CPU ranks; see dev/megatron_2d_dev/bench/max_logit.py.

python tools/bench_max_logit.py --ranks 4
"""

from megatron_2d_dev.bench.max_logit import main

if __name__ == "__main__":
    main()
