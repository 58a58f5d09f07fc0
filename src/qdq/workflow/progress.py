"""Progress bars of the workflow: what runs, named after the run it belongs to, on stderr.

Every long step of :mod:`qdq.workflow` (collecting calibration statistics, scoring PTQ methods, QAT
epochs) takes ``progress``: ``False`` shows nothing, ``True`` a bar named after the step ("QAT 1/2"),
and a string a bar named after the run and the step, ``"<progress> · <step>"`` (e.g.
``"digits_mobilenet W4A8 · QAT 1/2"``), so that a job running many models says which one is at work.
Bars are tqdm's, written to stderr and removed when done.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["Progress", "counter", "progress_bar", "step_name"]

T = TypeVar("T")

#: what ``progress`` arguments accept: off, on, or on with the run's name
Progress = bool | str


def step_name(progress: Progress, step: str) -> str:
    """The bar's description: ``step``, after the run's name when ``progress`` is one."""
    return f"{progress} · {step}" if isinstance(progress, str) and progress else step


def progress_bar(iterable: Iterable[T], progress: Progress, step: str, *, total: int | None = None) -> Iterable[T]:
    """``iterable`` itself when ``progress`` is off, else a tqdm bar over it named by :func:`step_name`."""
    if progress is False or progress is None:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=step_name(progress, step), total=total, leave=False, file=sys.stderr,
                dynamic_ncols=True)  # fmt: skip


def counter(progress: Progress, step: str, total: int) -> Any:
    """A bar of ``total`` units to advance with ``update()`` (and ``close()``), or a no-op when off."""
    if progress is False or progress is None:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(desc=step_name(progress, step), total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


class _NoBar:
    """The bar of ``progress=False``: accepts the calls of a tqdm bar and shows nothing."""

    def update(self, n: int = 1) -> None:
        return None

    def set_postfix_str(self, text: str) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None
