"""``python -m megatron_2d.plan``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
