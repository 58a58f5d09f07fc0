"""File names of the report's plots: ``[A-Za-z0-9._-]`` only, distinct even on case-insensitive disks."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

__all__ = ["plot_prefixes", "slug", "unique_slugs"]

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def slug(name: str, max_len: int = 80) -> str:
    """A file-name-safe version of ``name``: ``[A-Za-z0-9._-]``, no leading dot, at most ``max_len``."""
    text = _SAFE_CHARS.sub("_", name).strip("._-") or "x"
    if len(text) > max_len:
        text = f"{text[: max_len - 9]}-{_short_hash(name)}"
    return text


def _short_hash(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]


def unique_slugs(names: Iterable[str]) -> dict[str, str]:
    """Distinct slugs for distinct names (a clash gets the name's hash appended)."""
    slugs: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        text = slug(name)
        if text.lower() in taken:  # case-insensitive file systems
            text = f"{text}-{_short_hash(name)}"
        taken.add(text.lower())
        slugs[name] = text
    return slugs


def plot_prefixes(models: Sequence[str]) -> list[str]:
    """Plot-name prefixes: none for one model, ``<model>_`` for several (``<model>-<n>_`` on clashes)."""
    if len(models) == 1:
        return [""]
    slugs = [slug(m) for m in models]
    lowered = [s.lower() for s in slugs]
    return [f"{s}_" if lowered.count(s.lower()) == 1 else f"{s}-{i + 1}_" for i, s in enumerate(slugs)]
