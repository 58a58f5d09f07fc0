"""Atomic file writes: nothing the user had is lost if a write fails half-way.

Every file qdq writes (ONNX models, checkpoints, reports, calibration caches) goes to a temporary file in
the destination folder, which is renamed over the destination only once it is complete.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "write_bytes_atomic", "write_text_atomic"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file next to ``path``; on a clean exit it replaces ``path``, else it is deleted.

    The file gets mode 0644 (``mkstemp``'s 0600 would make reports private); parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o644)
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike[str], payload: bytes) -> Path:
    """Write ``payload`` to ``path`` atomically; returns ``path``."""
    with atomic_open(path, "wb") as handle:
        handle.write(payload)
    return Path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``."""
    with atomic_open(path, "w") as handle:
        handle.write(text)
    return Path(path)
