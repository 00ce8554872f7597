"""What the planner's commands (``python -m megatron_2d.plan``, ``... grid``, ``... paper``) share on the terminal:
the sequence-length arguments and the rich console. Pure Python (rich is optional)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


def parse_seq(text: str) -> int:
    """'131072', '128K' or '1M' (K = 1024) -> int."""
    t = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"sequence length {text!r} is not a positive integer like 131072, 128K or 1M")
    return int(digits) * mult


def parse_window(text: str):
    """'4K' -> 4096 (every layer); '4K,full' -> (4096, None): a per-layer pattern repeated over the layers."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) == 1:
        return parse_seq(parts[0])
    return tuple(None if p.lower() in ("full", "none", "-") else parse_seq(p) for p in parts)


def terminal_console(stream: TextIO | None = None, min_width: int = 120):
    """A rich Console on ``stream`` when it is a terminal and rich is installed, else None (print plain text)."""
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    import shutil

    return Console(
        file=stream, highlight=False, soft_wrap=True, width=max(shutil.get_terminal_size((160, 24)).columns, min_width)
    )
