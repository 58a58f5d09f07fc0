"""Exceptions raised by qdq.

Every error qdq raises on bad user input is a :class:`QdqError`. Each subclass also derives from the
builtin a caller would naturally catch (``ValueError``, ``TypeError``, ``RuntimeError``, ``ImportError``),
so ``except ValueError`` keeps working for code written against the seed toolkit.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "QdqBackendUnavailable",
    "QdqCalibrationError",
    "QdqCalibrationWarning",
    "QdqConfigError",
    "QdqDistributedError",
    "QdqError",
    "QdqExportError",
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
