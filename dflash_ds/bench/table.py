"""The one text-table printer of the benches and `plan`."""

from __future__ import annotations

import sys


def print_table(title: str, header: list[str], rows: list[list[str]], caption: str = "") -> None:
    """A plain aligned text table (first column left, others right)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(title)
    for line in [header, *rows]:
        cells = [str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths))]
        print("  ".join(cells))
    if caption:
        print(caption)
    sys.stdout.flush()
