"""``report.md``: the report's blocks as Markdown (tables from :func:`qdq.markdown.markdown_table`)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from qdq.app.report.document import Block, BulletList, Heading, Paragraph, Table
from qdq.markdown import escape_markdown, markdown_table

__all__ = ["to_markdown"]


def to_markdown(title: str, blocks: Sequence[Block]) -> str:
    """The page: ``# title`` and each block, every text escaped so that names read as written."""
    lines = [f"# {escape_markdown(title)}", ""]
    for block in blocks:
        if isinstance(block, Heading):
            lines += [f"{'#' * block.level} {escape_markdown(block.text)}", ""]
        elif isinstance(block, Paragraph):
            lines += [escape_markdown(block.text), ""]
        elif isinstance(block, BulletList):
            lines += [f"- {escape_markdown(item)}" for item in block.items] + [""]
        elif isinstance(block, Table):
            lines += [markdown_table(block.headers, block.rows, escape_all=True), ""]
        else:
            lines += [f"![{escape_markdown(block.alt)}]({urllib.parse.quote(block.src)})", ""]
    return "\n".join(lines)
