"""How a benchmark prints its results for docs/benchmarks.md: a markdown table."""
from __future__ import annotations

from collections.abc import Iterable


def print_table(headers: list[str], rows: Iterable[Iterable[object]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + " --- |" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
