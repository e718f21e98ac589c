"""Tables, built in this one place (results pages, the advisor and the fleet report, `usecases compare`, the GPU
report, docs/cli.md) by tabulate: Markdown in GitHub's pipe format, or plain text in aligned columns."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from tabulate import tabulate


def render_table(rows, headers: Sequence[str] | None = None, markdown: bool = True, number_format: str = "g",
                 align: Sequence[str] | None = None) -> str:
    """`rows` (a DataFrame, or a list of rows under `headers`) as a Markdown table, else plain text; `align` gives
    each column's "left", "right" or "center" (default: columns of numbers right, the others left)."""
    if headers is None:
        headers, rows = list(rows.columns), list(rows.itertuples(index=False))
    rows = [list(row) for row in rows]
    if align is None:
        align = ["right" if rows and all(isinstance(row[column], numbers.Number) and not isinstance(row[column], bool)
                                         for row in rows) else "left" for column in range(len(headers))]
    cells = [[_cell(value, number_format) for value in row] for row in rows]
    return tabulate(cells, headers=[_cell(header, number_format) for header in headers],
                    tablefmt="github" if markdown else "plain", disable_numparse=True, colalign=tuple(align))


def _cell(value, number_format: str) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        return format(float(value), number_format)
    return str(value).replace("|", "\\|").replace("\n", " ")
