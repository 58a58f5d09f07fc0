"""Markdown text: the one table writer of qdq, and escaping.

Every Markdown table qdq prints or writes (``qdq bench``, the fusion and precision reports, PTQ and
sensitivity tables, ``report.md``, the demo table, the benchmarks) comes from :func:`markdown_table`,
so they all share one look: GitHub-flavoured, columns padded to equal width (readable as plain text in
a terminal), ``None`` shown as an em dash.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from qdq.errors import QdqConfigError

__all__ = ["escape_markdown", "markdown_table"]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|#])")


def escape_markdown(text: str) -> str:
    """``text`` with every Markdown special character backslash-escaped and line breaks as spaces.

    For names shown by a Markdown viewer (layer names such as ``blocks.0._input_quantizer`` or
    ``conv<1>``), so that they are displayed as written.
    """
    return _MD_SPECIAL.sub(r"\\\1", text).replace("\r", " ").replace("\n", " ")


def _escape_cell(text: str) -> str:
    """Only what would break the table: ``|`` (a column separator) and line breaks."""
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], *, escape_all: bool = False) -> str:
    """A GitHub-flavoured Markdown table with padded columns, as one string without a final newline.

    Args:
        headers: the column titles.
        rows: the cells of each row, as many as ``headers``; converted with ``str``, ``None`` becomes ``—``.
        escape_all: escape every Markdown special character (:func:`escape_markdown`), for text that
            a Markdown viewer renders (``report.md``). By default only ``|`` and line breaks are
            escaped, so names read as written in a terminal.

    Raises:
        QdqConfigError: a row does not have one cell per header.
    """
    escape = escape_markdown if escape_all else _escape_cell
    head = [escape(_text(h)) for h in headers]
    body = [[escape(_text(cell)) for cell in row] for row in rows]
    for row in body:
        if len(row) != len(head):
            raise QdqConfigError(f"a table row has {len(row)} cells but the header has {len(head)}: {row}")
    widths = [max([len(h), 3, *(len(row[i]) for row in body)]) for i, h in enumerate(head)]
    lines = [_line(head, widths), _line(["-" * w for w in widths], widths), *(_line(row, widths) for row in body)]
    return "\n".join(lines)


def _text(value: object) -> str:
    return "—" if value is None else str(value)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"
