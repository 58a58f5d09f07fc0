"""Post-training quantization: one calibration pass, every method evaluated, the best one kept.

The seed recipe (calibrate with max, entropy, mse and four percentiles; keep what evaluates best) needed
one pass over the data per method. Here a single histogram pass serves all of them (every registered method that
reads histograms, :attr:`qdq.calib.CalibrationMethod.statistics`); a method that reads other statistics gets one
pass for them; a model-level method (``"auto"``: a range per quantizer by its layer's output error,
:mod:`qdq.workflow.auto_calibration`) adds its own pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from qdq.calib.methods import CALIBRATION_METHODS, CalibrationMethod, get_method, method_label
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer, disabled_quantizers
from qdq.workflow.calibration import load_amax
from qdq.workflow.collection import ForwardFn, check_reiterable, collect_stats, named_quantizers
from qdq.workflow.diagnostics import CalibrationReport, calibration_report, warn_clipping
from qdq.workflow.distributed import unwrap
from qdq.workflow.progress import Progress, progress_bar

__all__ = [
    "DEFAULT_PERCENTILES",
    "PTQ_STATISTICS",
    "MethodResult",
    "PTQResult",
    "disabled_quantizers",
    "method_grid",
    "ptq",
    "ptq_statistics",
    "restore_amax",
    "snapshot_amax",
]

_log = logging.getLogger(__name__)

EvalFn = Callable[[nn.Module], float]
#: the percentiles a method with a ``percentile`` option is tried with
DEFAULT_PERCENTILES = (99.9, 99.99, 99.999, 99.9999)
#: the calibrator whose one pass serves every method that reads its statistics
PTQ_STATISTICS = "histogram"
#: a range as a front end holds it: a tensor (PyTorch, :func:`ptq`), a float (Keras, :func:`qdq.keras.ptq`)
RangeT = TypeVar("RangeT")


@dataclass
class MethodResult(Generic[RangeT]):
    """Evaluation of one calibration method.

    Attributes:
        method, options: the method and its options (``percentile``).
        score: ``eval_fn``'s score with this method's ranges.
        amax: every quantizer's range, by name (tensors from :func:`ptq`, floats from :func:`qdq.keras.ptq`).
        diagnostics: what the activation ranges clip (:func:`qdq.calibration_report`).
        quantizer_methods: activation quantizer name -> how its range was set (``"auto: mse"``...).
    """

    method: str
    options: dict[str, Any]
    score: float
    amax: dict[str, RangeT] = field(repr=False)
    diagnostics: CalibrationReport | None = field(default=None, repr=False)
    quantizer_methods: dict[str, str | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._label = method_label(self.method, self.options)  # read once: the result outlives a registration

    @property
    def label(self) -> str:
        """How reports name the method with its options (``"percentile 99.99"``)."""
        return self._label

    @property
    def worst_clipping(self) -> str:
        """The largest clipping error of any quantizer, and its name ("" without diagnostics)."""
        worst = self.diagnostics.worst(1) if self.diagnostics is not None else []
        error = worst[0].clipping_error if worst else None  # worst(): known errors only
        return f"{100 * error:.2f} % ({worst[0].name})" if error is not None else ""


@dataclass
class PTQResult(Generic[RangeT]):
    """Scores of the float model and of each calibration method; ``best`` is loaded in the model."""

    float_score: float
    results: list[MethodResult[RangeT]]
    best: MethodResult[RangeT]

    def table(self) -> str:
        """Markdown table: method, score, difference to float, the largest clipping error of a quantizer."""
        rows = [["float (no quantization)", f"{self.float_score:.2f}", "", ""]]
        rows += [[result.label + (" (best)" if result is self.best else ""), f"{result.score:.2f}",
                  f"{result.score - self.float_score:+.2f}", result.worst_clipping]
                 for result in self.results]  # fmt: skip
        return markdown_table(["calibration", "score", "vs float", "largest clipping error"], rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "float": self.float_score,
            "methods": {r.label: r.score for r in self.results},
            "best": self.best.label,
        }


def snapshot_amax(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every stored amax, by quantizer name."""
    return {name: q.amax.clone() for name, q in named_quantizers(model) if q.amax is not None}


def restore_amax(model: nn.Module, amax: dict[str, torch.Tensor], methods: dict[str, str | None] | None = None) -> None:
    """Put back the amax values taken by :func:`snapshot_amax` (and the quantizers' ``amax_method``)."""
    modules = dict(model.named_modules())
    for name, value in amax.items():
        modules[name].amax = value
    for name, method in (methods or {}).items():
        modules[name].amax_method = method


def method_grid(methods: Sequence[str], percentiles: Sequence[float]) -> list[tuple[str, dict[str, Any]]]:
    """``(method, options)`` for each registered method to try; one per percentile for a method with a
    ``percentile`` option (``"percentile"``).

    Raises:
        QdqConfigError: an unknown method (one error listing every registered method).
    """
    grid: list[tuple[str, dict[str, Any]]] = []
    for name in methods:
        method = get_method(name)
        if "percentile" in method.options:
            grid += [(method.name, {"percentile": p}) for p in percentiles]
        else:
            grid.append((method.name, {}))
    return grid


def ptq(
    model: nn.Module,
    calib_data: Iterable[Any],
    eval_fn: EvalFn,
    methods: Sequence[str] = CALIBRATION_METHODS,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    num_batches: int | None = None,
    weight_method: str = "max",
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
) -> PTQResult[torch.Tensor]:
    """Calibrate ``model`` with every method from one pass over ``calib_data``; keep the best.

    Args:
        model: a quantized model (:func:`qdq.quantize_model` and, if wanted, placement already applied).
        calib_data: calibration batches (see :func:`qdq.workflow.calibration.collect_stats`).
        eval_fn: ``eval_fn(model) -> score``, higher is better (e.g. top-1 accuracy in percent).
        methods: registered calibration methods to try (default: :data:`qdq.calib.CALIBRATION_METHODS`, every
            method computed from statistics, read when called); a method with a ``percentile`` option expands to
            each of ``percentiles``. One histogram pass (:data:`PTQ_STATISTICS`) serves every method that reads
            histograms; a method that reads other statistics gets a pass for them. A model-level method
            (``"auto"``: a range per quantizer, :func:`qdq.workflow.auto_calibration.select_amax`) passes over
            ``calib_data`` once more, which must then be re-iterable (a list or a DataLoader); what it changes in
            the model (weights equalized, biases corrected, the stem's quantizers disabled) is kept only where it
            wins, and the methods scored after it see the model as given.
        progress: bars for the statistics pass and the scoring; a string names them after the run.

    Returns:
        A :class:`PTQResult`; the model is left with the best method's ranges loaded (and the statistics they came
        from). If they clip a large share of some activation's energy, a
        :class:`~qdq.errors.QdqCalibrationWarning` says which.

    Raises:
        QdqConfigError: an unknown method (one error listing every registered method).
    """
    grid = [(get_method(name), options) for name, options in method_grid(methods, percentiles)]
    for method, _ in grid:
        if method.model_level:
            check_reiterable(calib_data, method.name)
    with disabled_quantizers(model):
        float_score = float(eval_fn(model))
    statistics: dict[str, dict[str, Any]] = {}  # calibrator name -> the calibrators of the pass, by quantizer
    for kind in dict.fromkeys(ptq_statistics(method) for method, _ in grid):
        collect_stats(model, calib_data, num_batches=num_batches, calibrator=kind, forward_fn=forward_fn,
                      progress=progress)  # fmt: skip
        statistics[kind] = {name: q._calibrator for name, q in named_quantizers(unwrap(model), weights=False)}
    results: list[MethodResult[torch.Tensor]] = []
    changed: dict[int, dict[str, torch.Tensor]] = {}  # result index -> the parameters its model-level method set
    stems: dict[int, list[TensorQuantizer]] = {}  # result index -> the quantizers its model-level method disabled
    for method, options in progress_bar(grid, progress, f"PTQ: scoring {len(grid)} calibrations"):
        _use(model, statistics[ptq_statistics(method)])
        given = _state(model) if method.select is not None else None  # auto equalizes and corrects biases in place
        enabled = [q for _, q in named_quantizers(unwrap(model))] if given is not None else []
        _load(model, method, options, calib_data, num_batches, weight_method, forward_fn, progress)
        score = float(eval_fn(model))
        used = {name: q.amax_method for name, q in named_quantizers(model, weights=False)}
        results.append(MethodResult(method.name, options, score, snapshot_amax(model), calibration_report(model),
                                    used))  # fmt: skip
        if given is not None:  # the next methods' ranges are the statistics of the model as given, its stem int8
            changed[len(results) - 1] = _state(model)
            unwrap(model).load_state_dict(given, strict=False)
            stems[len(results) - 1] = [q for q in enabled if not q.is_enabled]
            for quantizer in stems[len(results) - 1]:
                quantizer.enable()
        _log.info("PTQ %s: %.3f", results[-1].label, score)
    best_at = max(range(len(results)), key=lambda i: results[i].score)  # first of equals: the grid's order
    best = results[best_at]
    if best_at in changed:
        unwrap(model).load_state_dict(changed[best_at], strict=False)
    for quantizer in stems.get(best_at, []):
        quantizer.disable()
    restore_amax(model, best.amax, best.quantizer_methods)
    _use(model, statistics[ptq_statistics(grid[best_at][0])])
    warn_clipping(model, stacklevel=2)
    return PTQResult(float_score, results, best)


def ptq_statistics(method: CalibrationMethod) -> str:
    """The calibrator whose pass serves ``method`` in :func:`ptq`: :data:`PTQ_STATISTICS` (the histogram) when it
    reads those statistics, else the first it reads."""
    return PTQ_STATISTICS if method.reads(PTQ_STATISTICS) else method.calibrator


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters and buffers, its quantizers' left out (each method's ranges are snapshot
    apart): what a model-level method may change in place (weights equalized, biases or BatchNorm means corrected)."""
    root = unwrap(model)
    quantizers = tuple(f"{name}." for name, module in root.named_modules() if isinstance(module, TensorQuantizer))
    return {name: tensor.detach().clone() for name, tensor in root.state_dict().items()
            if not name.startswith(quantizers)}  # fmt: skip


def _use(model: nn.Module, calibrators: dict[str, Any]) -> None:
    """Give each activation quantizer the calibrator (and statistics) of one pass."""
    modules = dict(unwrap(model).named_modules())
    for name, calibrator in calibrators.items():
        modules[name].calibrator = calibrator


def _load(
    model: nn.Module,
    method: CalibrationMethod,
    options: dict[str, Any],
    calib_data: Iterable[Any],
    num_batches: int | None,
    weight_method: str,
    forward_fn: ForwardFn | None,
    progress: Progress,
) -> None:
    """Load one method's ranges from the statistics collected (a model-level method runs its own pass)."""
    if method.select is not None:
        method.select(model, calib_data, num_batches=num_batches, weight_method=weight_method, forward_fn=forward_fn,
                      progress=progress, strict=True, **method.resolve_options(options))  # fmt: skip
    else:
        load_amax(model, method.name, weight_method=weight_method, warn=False, **options)
