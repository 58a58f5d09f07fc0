"""Text helpers shared by the runtime reports and the ``qdq bench`` command."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["first_line", "markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Return a GitHub-flavoured Markdown table with padded columns.

    Cells are converted with ``str``; ``None`` becomes an em dash. Pipes inside cells are escaped.
    """
    body = [[_cell(value) for value in row] for row in rows]
    head = [_cell(h) for h in headers]
    widths = [len(h) for h in head]
    for row in body:
        if len(row) != len(head):
            raise ValueError(f"row has {len(row)} cells, the header has {len(head)}: {row}")
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = [_line(head, widths), _line(["-" * w for w in widths], widths)]
    lines += [_line(row, widths) for row in body]
    return "\n".join(lines)


def _cell(value: object) -> str:
    text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (backend errors are often many lines long)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
