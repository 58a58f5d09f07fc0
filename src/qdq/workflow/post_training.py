"""Post-training quantization: one calibration pass, every method evaluated, the best one kept.

The seed recipe (calibrate with max, entropy, mse and four percentiles; keep what evaluates best) needed
one pass over the data per method. Here a single histogram pass serves all of them; ``"auto"`` (a range per
quantizer by its layer's output error, :mod:`qdq.workflow.auto_calibration`) adds one more pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.calib.registry import CALIBRATION_METHODS, check_method
from qdq.markdown import markdown_table
from qdq.quantizer import disabled_quantizers
from qdq.workflow.calibration import ForwardFn, collect_stats, load_amax, method_label, named_quantizers
from qdq.workflow.diagnostics import CalibrationReport, calibration_report, warn_clipping
from qdq.workflow.progress import Progress, progress_bar

__all__ = [
    "DEFAULT_PERCENTILES",
    "MethodResult",
    "PTQResult",
    "disabled_quantizers",
    "method_grid",
    "ptq",
    "restore_amax",
    "snapshot_amax",
]

_log = logging.getLogger(__name__)

EvalFn = Callable[[nn.Module], float]
DEFAULT_PERCENTILES = (99.9, 99.99, 99.999, 99.9999)


@dataclass
class MethodResult:
    """Evaluation of one calibration method.

    Attributes:
        method, options: the method and its options (``percentile``).
        score: ``eval_fn``'s score with this method's ranges.
        amax: every quantizer's range, by name.
        diagnostics: what the activation ranges clip (:func:`qdq.calibration_report`).
        quantizer_methods: activation quantizer name -> how its range was set (``"auto: mse"``...).
    """

    method: str
    options: dict[str, Any]
    score: float
    amax: dict[str, torch.Tensor] = field(repr=False)
    diagnostics: CalibrationReport | None = field(default=None, repr=False)
    quantizer_methods: dict[str, str | None] = field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        return method_label(self.method, self.options)

    @property
    def worst_clipping(self) -> str:
        """The largest clipping error of any quantizer, and its name ("" without diagnostics)."""
        worst = self.diagnostics.worst(1) if self.diagnostics is not None else []
        return f"{100 * worst[0].clipping_error:.2f} % ({worst[0].name})" if worst else ""


@dataclass
class PTQResult:
    """Scores of the float model and of each calibration method; ``best`` is loaded in the model."""

    float_score: float
    results: list[MethodResult]
    best: MethodResult

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


def restore_amax(
    model: nn.Module, amax: dict[str, torch.Tensor], methods: dict[str, str | None] | None = None
) -> None:
    """Put back the amax values taken by :func:`snapshot_amax` (and the quantizers' ``amax_method``)."""
    modules = dict(model.named_modules())
    for name, value in amax.items():
        modules[name].amax = value
    for name, method in (methods or {}).items():
        modules[name].amax_method = method


def method_grid(methods: Sequence[str], percentiles: Sequence[float]) -> list[tuple[str, dict[str, Any]]]:
    """``(method, options)`` for each method to try; ``"percentile"`` once per percentile."""
    grid: list[tuple[str, dict[str, Any]]] = []
    for method in methods:
        if method == "percentile":
            grid += [("percentile", {"percentile": p}) for p in percentiles]
        else:
            grid.append((method if method == "auto" else check_method(method), {}))
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
) -> PTQResult:
    """Calibrate ``model`` with every method from one pass over ``calib_data``; keep the best.

    Args:
        model: a quantized model (:func:`qdq.quantize_model` and, if wanted, placement already applied).
        calib_data: calibration batches (see :func:`qdq.workflow.calibration.collect_stats`).
        eval_fn: ``eval_fn(model) -> score``, higher is better (e.g. top-1 accuracy in percent).
        methods: calibration methods to try; ``"percentile"`` expands to each of ``percentiles``; ``"auto"``
            (a range per quantizer, :func:`qdq.workflow.auto_calibration.select_amax`) passes over
            ``calib_data`` once more, which must then be re-iterable (a list or a DataLoader).
        progress: bars for the statistics pass and the scoring; a string names them after the run.

    Returns:
        A :class:`PTQResult`; the model is left with the best method's ranges loaded. If they clip a large
        share of some activation's energy, a :class:`~qdq.errors.QdqCalibrationWarning` says which.
    """
    grid = method_grid(methods, percentiles)
    if any(method == "auto" for method, _ in grid):
        from qdq.workflow.auto_calibration import check_reiterable

        check_reiterable(calib_data)
    with disabled_quantizers(model):
        float_score = float(eval_fn(model))
    collect_stats(model, calib_data, num_batches=num_batches, calibrator="histogram",
                  forward_fn=forward_fn, progress=progress)  # fmt: skip
    results = []
    for method, options in progress_bar(grid, progress, f"PTQ: scoring {len(grid)} calibrations"):
        _load(model, method, options, calib_data, num_batches, weight_method, forward_fn, progress)
        score = float(eval_fn(model))
        used = {name: q.amax_method for name, q in named_quantizers(model, weights=False)}
        results.append(MethodResult(method, options, score, snapshot_amax(model), calibration_report(model), used))
        _log.info("PTQ %s: %.3f", results[-1].label, score)
    best = max(results, key=lambda r: r.score)  # first of equals: the grid's order breaks ties
    restore_amax(model, best.amax, best.quantizer_methods)
    warn_clipping(model, stacklevel=2)
    return PTQResult(float_score, results, best)


def _load(
    model: nn.Module,
    method: str,
    options: dict[str, Any],
    calib_data: Iterable[Any],
    num_batches: int | None,
    weight_method: str,
    forward_fn: ForwardFn | None,
    progress: Progress,
) -> None:
    """Load one method's ranges from the statistics collected (``auto`` runs its comparison pass)."""
    if method == "auto":
        from qdq.workflow.auto_calibration import select_amax

        select_amax(model, calib_data, num_batches=num_batches, weight_method=weight_method, forward_fn=forward_fn,
                    progress=progress)  # fmt: skip
    else:
        load_amax(model, method, weight_method=weight_method, warn=False, **options)
