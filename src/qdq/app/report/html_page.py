"""``report.html``: the report's blocks as a self-contained HTML5 page (inline CSS, every text escaped).

Plots are referenced by relative path, so the folder must be kept together.
"""

from __future__ import annotations

import html
import urllib.parse
from collections.abc import Sequence

from qdq.app.report.document import Block, BulletList, Heading, Paragraph, Table

__all__ = ["to_html"]

_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3}td{font-variant-numeric:tabular-nums}img{max-width:100%;height:auto}
figure{margin:1em 0}figcaption{color:#666;font-size:.9em}"""


def to_html(title: str, blocks: Sequence[Block]) -> str:
    """The page: ``<h1>title</h1>`` and each block, figures with their caption."""
    esc = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{esc(title)}</h1>"]  # fmt: skip
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{esc(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{esc(block.text)}</p>")
        elif isinstance(block, BulletList):
            parts.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            parts.append(_html_table(block))
        else:
            src = esc(urllib.parse.quote(block.src))
            parts.append(f'<figure><img src="{src}" alt="{esc(block.alt)}"><figcaption>{esc(block.alt)}'
                         "</figcaption></figure>")  # fmt: skip
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"
