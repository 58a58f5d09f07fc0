"""Calibration methods as registered objects: how a quantizer's range (amax) comes out of collected statistics.

A :class:`CalibrationMethod` is everything qdq knows about one method, in one place:

* its **name**, what ``qdq.calibrate(model, data, method=...)``, ``qdq.load_amax``, ``qdq.ptq(methods=...)``,
  ``qdq.calib.calibrate_weights``, the Keras front end and ``qdq quantize --calib`` accept;
* the **statistics** it reads: the registered calibrators (:mod:`qdq.calib.registry`) whose statistics give its
  range, the cheapest first (``max``: a max calibrator or a histogram; ``entropy``: a histogram);
* its **options** with their defaults (``percentile``: ``{"percentile": 99.99}``);
* whether it can set a **weight**'s range (entropy compares activation distributions: it cannot);
* how it computes the range, one of two ways: ``compute(calibrator, **options)`` from one quantizer's statistics
  (every method but ``auto``), or ``select(model, data, ...)``, a pass over the model after the statistics were
  collected (or collecting them itself: ``collects``), which loads the ranges itself (a *model-level* method:
  ``auto``, the default);
* how reports **label** it: its name and the options that tell its variants apart (``"percentile 99.99"``).

The registry (:data:`METHOD_REGISTRY`) holds the built-ins ``max``, ``entropy``, ``mse``, ``percentile`` and
``auto``; adding a method is one :func:`register_method` call from anywhere, and every entry point then accepts
it. :data:`METHOD_NAMES`, :data:`CALIBRATION_METHODS` and :data:`WEIGHT_METHODS` are live, read-only views of the
registered names (never a stale copy). Everything that names a method resolves it here (:func:`get_method`), so
an unknown name gets one error listing every registered method.

``auto``'s pass over the model lives in :mod:`qdq.workflow.auto_calibration`, a layer above this one: the
built-in names it as a :class:`~qdq.lazy.LazyCallable`, imported on its first call (by ``qdq.calibrate`` or
``qdq.ptq``, in that layer), so importing this module imports nothing above it.

Example (the 99.9th percentile of ``|x|``, from the histogram)::

    register_method(CalibrationMethod(
        "p999", statistics="histogram",
        compute=lambda calibrator: calibrator.compute_amax("percentile", percentile=99.9)))
    qdq.calibrate(model, data, method="p999")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, overload

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.lazy import LazyCallable
from qdq.registry import Registry

from .histogram import DEFAULT_PERCENTILE, DEFAULT_START_BIN, DEFAULT_STRIDE

__all__ = [
    "CALIBRATION_METHODS",
    "METHOD_NAMES",
    "METHOD_REGISTRY",
    "WEIGHT_METHODS",
    "CalibrationMethod",
    "MethodNames",
    "get_method",
    "method_label",
    "register_method",
    "unregister_method",
]

#: ``compute(calibrator, **options) -> amax``: float32, the calibrator's keepdims shape; None without data.
ComputeFn = Callable[..., Any]
#: ``select(model, data, *, num_batches, weight_method, forward_fn, progress, strict, **options)``: see
#: :attr:`CalibrationMethod.select`.
SelectFn = Callable[..., Any]


@dataclass(frozen=True, eq=False)
class CalibrationMethod:
    """One calibration method (see the module docstring).

    Attributes:
        name: its registered name.
        statistics: the registered calibrators whose statistics give its range, the cheapest first (a name or a
            tuple of names): ``qdq.calibrate`` collects with the first; ``qdq.ptq``'s histogram pass serves every
            method that lists ``"histogram"``.
        compute: ``compute(calibrator, **options) -> amax | None``, the range from one quantizer's statistics
            (float32, the calibrator's keepdims shape: 0-d per tensor; None when it saw no data). Raise
            :class:`~qdq.errors.QdqConfigError` when the calibrator's statistics cannot give it.
        select: for a model-level method instead of ``compute``: ``select(model, data, *, num_batches,
            weight_method, forward_fn, progress, strict, **options)``, called once the statistics are collected
            in ``model``'s activation quantizers; it sets their ranges and ``amax_method`` (and the weights' by
            ``weight_method``, as :func:`qdq.load_amax` does), and may return a report.
        options: the options it takes, with their defaults: every call gets ``{**options, **given}``.
        labelled: the options whose values name its variants in reports (``("percentile",)``).
        weights: whether it can set a weight's range (:func:`qdq.calib.calibrate_weights`); a model-level method
            cannot. Default: True with ``compute``, False with ``select``.
        accepts: ``accepts(calibrator) -> bool``: whether that calibrator's statistics give this method's range
            (None: assume they do, and let ``compute`` raise); callers skip or refuse the others with advice.
        collects: a model-level method whose ``select`` collects the statistics itself, in its own one pass
            (``auto`` holds batches out of them); otherwise ``qdq.calibrate`` collects them before calling it.
        description: one sentence for documentation.

    Raises:
        QdqConfigError / QdqTypeError: a malformed definition (no name, neither or both of compute and select,
            an option labelled that it does not take, a model-level method said to set weights).
    """

    name: str
    statistics: str | tuple[str, ...]
    compute: ComputeFn | None = None
    select: SelectFn | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    labelled: tuple[str, ...] = ()
    weights: bool | None = None
    accepts: Callable[[Any], bool] | None = None
    collects: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqConfigError(f"a calibration method's name must be a non-empty str, got {self.name!r}.")
        who = f"calibration method {self.name!r}"
        statistics = (self.statistics,) if isinstance(self.statistics, str) else tuple(self.statistics)
        if not statistics or not all(isinstance(s, str) and s for s in statistics):
            raise QdqConfigError(f"{who}: statistics must name registered calibrators, got {self.statistics!r}.")
        if (self.compute is None) == (self.select is None):
            raise QdqTypeError(f"{who}: give exactly one of compute= (a range per quantizer) and select= (a pass "
                               "over the model).")  # fmt: skip
        if not callable(self.compute or self.select) or (self.accepts is not None and not callable(self.accepts)):
            raise QdqTypeError(f"{who}: compute, select and accepts must be callable.")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise QdqTypeError(f"{who}: options must map option names to their defaults, got {self.options!r}.")
        labelled = (self.labelled,) if isinstance(self.labelled, str) else tuple(self.labelled)
        unknown = [o for o in labelled if o not in self.options]
        if unknown:
            raise QdqConfigError(f"{who}: labelled names {unknown}, which are not among its options "
                                 f"{list(self.options)}.")  # fmt: skip
        weights = self.select is None if self.weights is None else bool(self.weights)
        if self.collects and self.select is None:
            raise QdqConfigError(f"{who}: only a model-level method (select=) can collect its own statistics.")
        if weights and self.select is not None:
            raise QdqConfigError(f"{who}: a model-level method (select=) chooses activation ranges; it cannot set "
                                 "a weight's range (weights=False).")  # fmt: skip
        object.__setattr__(self, "statistics", statistics)
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        object.__setattr__(self, "labelled", labelled)
        object.__setattr__(self, "weights", weights)

    @property
    def model_level(self) -> bool:
        """Whether its ranges come from a pass over the model (``select``) rather than from statistics alone."""
        return self.select is not None

    @property
    def calibrator(self) -> str:
        """The calibrator ``qdq.calibrate`` collects with: the first of :attr:`statistics`."""
        return self.statistics[0]

    def reads(self, calibrator: str) -> bool:
        """Whether the statistics of the registered calibrator named ``calibrator`` give this method's range."""
        return calibrator in self.statistics

    def resolve_options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Its options with ``given`` over the defaults.

        Raises:
            QdqTypeError: an option it does not take (with the ones it takes).
        """
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            takes = f"takes the options {list(self.options)}" if self.options else "takes no option"
            raise QdqTypeError(f"calibration method {self.name!r} {takes}; got {unknown}."
                               f"{did_you_mean(unknown[0], self.options)}")  # fmt: skip
        return {**self.options, **given}

    def label(self, options: Mapping[str, Any] | None = None) -> str:
        """How reports name it with ``options``: its name and its labelled options' values (``"percentile 99.99"``)."""
        resolved = self.resolve_options(options)
        return " ".join([self.name, *(str(resolved[o]) for o in self.labelled)])

    def compute_amax(self, calibrator: Any, **options: Any) -> Any:
        """The range from ``calibrator``'s statistics with ``options`` (over the defaults); None without data.

        Raises:
            QdqConfigError: a model-level method (it has no range per quantizer), or statistics that cannot give it.
            QdqTypeError: an option it does not take.
        """
        if self.compute is None:
            raise QdqConfigError(
                f"calibration method {self.name!r} chooses its ranges with a pass over the model; "
                "it has no range from one quantizer's statistics: use qdq.calibrate or qdq.ptq."
            )
        resolved = self.resolve_options(options)
        if self.accepts is not None and not self.accepts(calibrator):
            raise QdqConfigError(f"the statistics of a {type(calibrator).__name__} cannot give method {self.name!r}"
                                 f" (it reads {' or '.join(self.statistics)} statistics).")  # fmt: skip
        return self.compute(calibrator, **resolved)


#: name -> method, in registration order (the order ``qdq.ptq`` tries them).
METHOD_REGISTRY: Registry[str, CalibrationMethod] = Registry("calibration method")


class MethodNames(Sequence[str]):
    """The names of the registered methods that pass a filter, read from the registry at each use.

    A read-only sequence (``in``, ``len``, iteration, indexing; equal to a tuple or list of the same names);
    ``tuple(view)`` is a snapshot. It never holds a copy, so a default argument or an import of it stays current
    when methods are registered.
    """

    def __init__(self, keep: Callable[[CalibrationMethod], bool], what: str) -> None:
        self._keep = keep
        self.description = what  #: which methods it names

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, method in METHOD_REGISTRY.items() if self._keep(method))

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MethodNames | tuple | list):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable: its names change as methods are registered

    def __repr__(self) -> str:
        return repr(self._names())


#: Every registered method, in registration order (``auto`` and the methods registered from outside included).
METHOD_NAMES = MethodNames(lambda method: True, "every registered calibration method")
#: The methods computed from statistics alone, in the order post-training quantization tries them (the built-ins:
#: ``"max"``, then the histogram methods); model-level methods (``auto``) are not among them.
CALIBRATION_METHODS = MethodNames(lambda method: not method.model_level, "the methods computed from statistics")
#: The methods that can set a weight's range (entropy compares activation distributions: it is not one).
WEIGHT_METHODS = MethodNames(lambda method: bool(method.weights), "the methods that set a weight's range")


def get_method(name: str | CalibrationMethod, *, who: str = "") -> CalibrationMethod:
    """The registered method ``name`` (a :class:`CalibrationMethod` is returned as it is).

    Args:
        who: a prefix for the error (``"calibrate_weights: "``).

    Raises:
        QdqConfigError: an unknown name: one error listing every registered method, and the closest.
        QdqTypeError: ``name`` is not a str.
    """
    if isinstance(name, CalibrationMethod):
        return name
    if not isinstance(name, str):
        raise QdqTypeError(f"{who}a calibration method is named by a str, got {type(name).__name__} {name!r}.")
    method = METHOD_REGISTRY.find(name)
    if method is None:
        names = list(METHOD_NAMES)
        raise QdqConfigError(
            f"{who}unknown calibration method {name!r}; the registered methods are {names}: pass one of them, or "
            f"register yours with qdq.calib.register_method(CalibrationMethod(...)).{did_you_mean(name, names)}"
        )
    return method


def method_label(method: str | CalibrationMethod, options: Mapping[str, Any] | None = None) -> str:
    """How reports name ``method`` with ``options``: ``"entropy"``, ``"percentile 99.99"``
    (:meth:`CalibrationMethod.label` of the registered method)."""
    return get_method(method).label(options)


def register_method(method: CalibrationMethod, *, override: bool = False) -> CalibrationMethod:
    """Register ``method`` under its name (``override=True`` replaces a registered one, in its place); returns it.

    Raises:
        QdqTypeError: ``method`` is not a :class:`CalibrationMethod`.
        QdqConfigError: the name is taken and ``override`` is False.
    """
    if not isinstance(method, CalibrationMethod):
        raise QdqTypeError(f"register_method needs a qdq.calib.CalibrationMethod, got {type(method).__name__}.")
    return METHOD_REGISTRY.register(method.name, method, override=override)


def unregister_method(name: str) -> CalibrationMethod:
    """Remove the method ``name`` and return it; a built-in name gets its built-in method back (in its place).

    Raises:
        QdqConfigError: ``name`` is not registered.
    """
    removed = get_method(name)
    if name in _BUILTINS:
        METHOD_REGISTRY.register(name, _BUILTINS[name], override=True)
    else:
        METHOD_REGISTRY.unregister(name)
    return removed


# --- the built-ins ----------------------------------------------------------------------------------------------


def _by_calibrator(algorithm: str, *options: str) -> ComputeFn:
    """The range by the calibrator's own algorithm ``algorithm`` (``calibrator.compute_amax(algorithm, ...)``)."""

    def compute(calibrator: Any, **values: Any) -> Any:
        return calibrator.compute_amax(algorithm, **{o: values[o] for o in options})

    compute.__name__ = compute.__qualname__ = f"compute_{algorithm}"
    return compute


def _computes(algorithm: str) -> Callable[[Any], bool]:
    """Whether a calibrator implements ``algorithm`` (its ``methods``)."""
    return lambda calibrator: algorithm in getattr(calibrator, "methods", ())


_SEARCH = {"start_bin": DEFAULT_START_BIN, "stride": DEFAULT_STRIDE}
_BUILTINS: dict[str, CalibrationMethod] = {
    method.name: method
    for method in (
        CalibrationMethod("max", ("max", "histogram"), _by_calibrator("max"), accepts=_computes("max"),
                          description="the largest magnitude seen"),
        CalibrationMethod("entropy", "histogram", _by_calibrator("entropy", *_SEARCH), options=_SEARCH,
                          weights=False, accepts=_computes("entropy"),
                          description="the range whose quantized distribution is closest in KL divergence"),
        CalibrationMethod("mse", "histogram", _by_calibrator("mse", *_SEARCH), options=_SEARCH,
                          accepts=_computes("mse"), description="the range with the smallest mean squared error"),
        CalibrationMethod("percentile", "histogram", _by_calibrator("percentile", "percentile"),
                          options={"percentile": DEFAULT_PERCENTILE}, labelled=("percentile",),
                          accepts=_computes("percentile"), description="a percentile of the magnitudes"),
        CalibrationMethod("auto", "histogram", select=LazyCallable("qdq.workflow.auto_calibration", "select_amax"),
                          collects=True, options={"bias_correction": True, "equalize": True},
                          description="the method whose quantized model stays closest to the float model on "
                          "calibration batches held out from setting the ranges (qdq.workflow.auto_calibration)"),
    )
}  # fmt: skip
for _method in _BUILTINS.values():
    METHOD_REGISTRY.register(_method.name, _method)
