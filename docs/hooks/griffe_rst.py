"""Griffe extension: qdq's docstrings use Sphinx roles (``:func:`qdq.calibrate```); show them as code.

mkdocstrings reads docstrings as Markdown, where a role would print as ``:func:`` followed by the code. A role
becomes its target as inline code (``~a.b.c`` shows ``c``, as in Sphinx), and a paragraph ending in ``::`` (an
RST literal block follows) ends in ``:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown(text: str) -> str:
    text = _ROLE.sub(_role, text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
