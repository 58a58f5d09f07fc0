"""Text helpers shared by the runtime reports and the ``qdq bench`` command."""

from __future__ import annotations

from qdq.markdown import markdown_table

__all__ = ["first_line", "markdown_table"]


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (backend errors are often many lines long)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
