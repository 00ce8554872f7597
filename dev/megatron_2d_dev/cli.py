"""What every benchmark and report script shares on its surface: the common flags and the one table renderer.

p = argparse.ArgumentParser()
add_arguments(p, ranks=4, seq=4096, heads=8, dim=64, repeats=3)
render_table("title", ["layout", "time ms"], [["hp2 x cp2", "12"]])
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

HELP = {
    "ranks": "CPU ranks = CP size",
    "hp": "head-parallel size",
    "inner_ring_size": "Double-Ring inner ring size w",
    "seq": "global sequence length",
    "batch": "micro-batch size",
    "heads": "query heads",
    "kv_heads": "K/V heads",
    "dim": "head dimension",
    "layers": "decoder layers",
    "hidden": "hidden size",
    "repeats": "timed runs after one warm-up (median)",
    "steps": "training steps",
    "lr": "learning rate",
    "seq_per_rank": "tokens per rank",
    "timeout": "process-group timeout, seconds",
}


def add_arguments(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add ``--name`` for each keyword (underscores become dashes), typed and defaulted by its value."""
    for name, default in defaults.items():
        help_text = HELP.get(name, "")
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"{help_text} (default {default})".strip(),
        )
    return parser


def add_output_arguments(
    parser: argparse.ArgumentParser, json_help: str = "also write the rows to this JSON file"
) -> argparse.ArgumentParser:
    """``--json PATH`` and ``--quiet`` (no progress bar), as every benchmark takes them."""
    parser.add_argument("--json", help=json_help)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def add_malloc_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--system-malloc``: the ranks keep glibc's default instead of ``harness.retain_freed_memory``."""
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="keep glibc's default of returning freed memory (by default the ranks keep it, as a GPU caching "
        "allocator does, so fresh tensors cost no page faults)",
    )
    return parser


def render_table(
    title: str,
    header: Sequence[str],
    body: Sequence[Sequence[str]],
    width: int = 140,
    stream: TextIO | None = None,
    use_rich: bool | None = None,
) -> None:
    """Print a table: with ``rich`` when installed (and, if ``use_rich`` is None, always; pass False for plain
    text), else aligned plain text. The first column is left-aligned, the others right-aligned."""
    stream = sys.stdout if stream is None else stream
    if use_rich is not False:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            use_rich = False
    if use_rich is False:
        print(format_table(title, header, body), file=stream)
        return
    table = Table(title=title, header_style="bold")
    for j, name in enumerate(header):
        table.add_column(name, justify="left" if j == 0 else "right")
    for line in body:
        table.add_row(*line)
    Console(width=width, file=stream).print(table)


def format_table(title: str, header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """The plain-text table: the title, then aligned columns (first left, the others right)."""
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines: list[str] = [title] if title else []
    for line in [list(header)] + [list(b) for b in body]:
        lines.append("  ".join(x.rjust(n) if j else x.ljust(n) for j, (x, n) in enumerate(zip(line, widths))))
    return "\n".join(lines)
