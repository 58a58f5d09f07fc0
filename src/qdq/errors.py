"""Exceptions raised by qdq.

Every error qdq raises on bad user input is a :class:`QdqError`. Each subclass also derives from the
builtin a caller would naturally catch (``ValueError``, ``TypeError``, ``RuntimeError``, ``ImportError``),
so ``except ValueError`` keeps working for code written against the seed toolkit.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any

__all__ = [
    "QdqBackendUnavailable",
    "QdqCalibrationError",
    "QdqCalibrationWarning",
    "QdqConfigError",
    "QdqDistributedError",
    "QdqError",
    "QdqExportError",
    "QdqRuntimeWarning",
    "QdqTypeError",
    "did_you_mean",
]


class QdqError(Exception):
    """Base class of every error raised by qdq."""


class QdqConfigError(QdqError, ValueError):
    """A value given by the user is out of range or inconsistent (amax, num_bits, axis, pattern...)."""


class QdqTypeError(QdqError, TypeError):
    """An argument has the wrong type, or an unknown keyword was given."""


class QdqCalibrationError(QdqError, RuntimeError):
    """Calibration could not produce a range (no data seen, NaN/Inf data, empty loader...)."""


class QdqCalibrationWarning(UserWarning):
    """A calibrated range that will probably cost accuracy (e.g. it clips most of an activation's energy).

    Silence it with ``warnings.filterwarnings("ignore", category=QdqCalibrationWarning)``.
    """


class QdqRuntimeWarning(UserWarning):
    """A runtime's warning about one file it loads, with what it is about as data: ``file`` (the file's name, which
    the message starts with as ``"<file>: "``) and ``kind`` (the same for every file with that cause, whatever its
    counts), so that a caller loading many files (:func:`qdq.tune`) says each kind once, without the file's name
    (:attr:`text`).
    """

    def __init__(self, message: str, *, file: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.file = file
        self.kind = kind or message

    @property
    def text(self) -> str:
        """The message without the leading ``"<file>: "``."""
        return str(self).removeprefix(f"{self.file}: ") if self.file else str(self)

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields survive pickling (multiprocessing)
        return functools.partial(type(self), file=self.file, kind=self.kind), self.args


class QdqExportError(QdqError, RuntimeError):
    """The model cannot be exported as asked (uncalibrated quantizer, opset too old...)."""


class QdqDistributedError(QdqError, RuntimeError):
    """Ranks lost contact (one crashed or timed out) or hold different states where they must agree."""


class QdqBackendUnavailable(QdqError, ImportError):
    """An optional runtime (onnxruntime, openvino, tensorrt) is not installed or has no device."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest match of ``name`` in ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
