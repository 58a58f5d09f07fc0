"""Calibrators by name, so configs can name them with plain strings.

Built-in names: ``"max"`` (:class:`MaxCalibrator`), ``"histogram"`` (:class:`HistogramCalibrator`)
and ``"entropy"``, ``"mse"``, ``"percentile"`` (a :class:`HistogramCalibrator` whose default method is
that name).

A calibrator collects statistics; a calibration *method* turns them into a range. The methods are registered
objects of their own (:mod:`qdq.calib.methods`); the names this module has always exported for them
(:data:`CALIBRATION_METHODS`, :data:`WEIGHT_METHODS`, :func:`check_method`, :func:`statistics_calibrator`) read
that registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.registry import Registry

from .base import Calibrator
from .histogram import DEFAULT_NUM_BINS, DEFAULT_PERCENTILE, DEFAULT_START_BIN, DEFAULT_STRIDE, HistogramCalibrator
from .max import MaxCalibrator
from .methods import CALIBRATION_METHODS, WEIGHT_METHODS, get_method

__all__ = [
    "CALIBRATION_METHODS",
    "WEIGHT_METHODS",
    "calibrator_names",
    "calibrator_parameters",
    "check_method",
    "make_calibrator",
    "register_calibrator",
    "statistics_calibrator",
    "unregister_calibrator",
]

CalibratorFactory = Callable[..., Calibrator]
F = TypeVar("F", bound=CalibratorFactory)


def _histogram_with(method: str) -> CalibratorFactory:
    def make(
        num_bits: int = 8,
        axis: Any = None,
        unsigned: bool = False,
        num_bins: int = DEFAULT_NUM_BINS,
        skip_zeros: bool = False,
        *,
        percentile: float = DEFAULT_PERCENTILE,
        start_bin: int = DEFAULT_START_BIN,
        stride: int = DEFAULT_STRIDE,
    ) -> HistogramCalibrator:
        return HistogramCalibrator(
            num_bits,
            axis,
            unsigned,
            num_bins,
            skip_zeros,
            method,
            percentile=percentile,
            start_bin=start_bin,
            stride=stride,
        )

    make.__doc__ = f"A HistogramCalibrator whose default method is {method!r}."
    return make


_BUILTINS: dict[str, CalibratorFactory] = {
    "max": MaxCalibrator,
    "histogram": HistogramCalibrator,
    **{m: _histogram_with(m) for m in ("entropy", "mse", "percentile")},
}
_registry: Registry[str, CalibratorFactory] = Registry("calibrator")
for _name, _factory in _BUILTINS.items():
    _registry.register(_name, _factory)


def statistics_calibrator(method: str) -> str:
    """The calibrator ``qdq.calibrate`` collects with for the registered ``method``: its first statistics
    (:attr:`~qdq.calib.methods.CalibrationMethod.calibrator`; ``"max"`` for max, ``"histogram"`` for the others)."""
    return get_method(method).calibrator


def check_method(method: str, *, who: str = "") -> str:
    """``method`` when it is a registered calibration method (:func:`qdq.calib.methods.get_method`); else one
    clear error listing every registered method (``who``: its prefix).

    Raises:
        QdqConfigError: an unknown method, with the registered ones and the closest.
    """
    return get_method(method, who=who).name


def register_calibrator(name: str, factory: F | None = None, *, override: bool = False) -> F | Callable[[F], F]:
    """Register ``factory`` (a Calibrator subclass or a function returning one) under ``name``.

    Usable directly, ``register_calibrator("mine", MyCalibrator)``, or as a class decorator,
    ``@register_calibrator("mine")``.

    Raises:
        QdqConfigError: ``name`` is empty or already registered (pass ``override=True`` to replace it).
        QdqTypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise QdqConfigError(f"a calibrator name must be a non-empty str, got {name!r}.")

    def add(f: F) -> F:
        if not callable(f):
            raise QdqTypeError(f"register_calibrator({name!r}) needs a class or function, got {type(f).__name__}.")
        _registry.register(name, f, override=override)
        return f

    return add if factory is None else add(factory)


def unregister_calibrator(name: str) -> None:
    """Remove ``name``; a built-in name gets its built-in calibrator back.

    Raises:
        QdqConfigError: ``name`` is not registered.
    """
    _registry.unregister(name)
    if name in _BUILTINS:
        _registry.register(name, _BUILTINS[name])


def calibrator_names() -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(_registry))


def calibrator_parameters(name: str) -> tuple[str, ...]:
    """The keyword arguments the calibrator registered as ``name`` takes (``("num_bits", "axis", ..., "num_bins",
    ...)``), or ``()`` when its factory has no signature to read.

    Raises:
        QdqConfigError: unknown name (the message lists the registered ones).
    """
    try:
        signature = inspect.signature(_registry.get(name))
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in signature.parameters.values() if p.kind in kinds and p.name != "self")


def make_calibrator(name: str, /, **kwargs: Any) -> Calibrator:
    """Build the calibrator registered as ``name`` with keyword arguments ``kwargs``.

    Example:
        >>> cal = make_calibrator("percentile", axis=0, percentile=99.9)
        >>> type(cal).__name__, cal.method
        ('HistogramCalibrator', 'percentile')

    Raises:
        QdqConfigError: unknown name (the message lists the registered ones).
        QdqTypeError: an argument the calibrator does not take.
    """
    factory = _registry.get(name)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: let the call check
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as err:
            params = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
            hint = did_you_mean(next(iter(set(kwargs) - set(params)), ""), params)
            raise QdqTypeError(f"make_calibrator({name!r}): {err}; it takes {params}.{hint}") from err
    return factory(**kwargs)
