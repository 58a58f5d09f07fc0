"""Post-training quantization: one calibration pass, every method evaluated, the best one kept.

The seed recipe (calibrate with max, entropy, mse and four percentiles; keep what evaluates best) needed
one pass over the data per method. Here a single histogram pass serves all of them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.calib.registry import CALIBRATION_METHODS, check_method
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer
from qdq.workflow.calibration import ForwardFn, collect_stats, load_amax, named_quantizers

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
    """Evaluation of one calibration method."""

    method: str
    options: dict[str, Any]
    score: float
    amax: dict[str, torch.Tensor] = field(repr=False)

    @property
    def label(self) -> str:
        if self.method == "percentile":
            return f"percentile {self.options['percentile']}"
        return self.method


@dataclass
class PTQResult:
    """Scores of the float model and of each calibration method; ``best`` is loaded in the model."""

    float_score: float
    results: list[MethodResult]
    best: MethodResult

    def table(self) -> str:
        """Markdown table: method, score, difference to float."""
        rows = [["float (no quantization)", f"{self.float_score:.2f}", ""]]
        rows += [[result.label + (" (best)" if result is self.best else ""), f"{result.score:.2f}",
                  f"{result.score - self.float_score:+.2f}"] for result in self.results]  # fmt: skip
        return markdown_table(["calibration", "score", "vs float"], rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "float": self.float_score,
            "methods": {r.label: r.score for r in self.results},
            "best": self.best.label,
        }


def snapshot_amax(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every stored amax, by quantizer name."""
    return {name: q.amax.clone() for name, q in named_quantizers(model) if q.amax is not None}


def restore_amax(model: nn.Module, amax: dict[str, torch.Tensor]) -> None:
    """Put back the amax values taken by :func:`snapshot_amax`."""
    modules = dict(model.named_modules())
    for name, value in amax.items():
        modules[name].amax = value


@contextlib.contextmanager
def disabled_quantizers(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily run ``model`` in float (every quantizer disabled)."""
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    enabled = [q.is_enabled for q in quantizers]
    try:
        for quantizer in quantizers:
            quantizer.disable()
        yield model
    finally:
        for quantizer, was_enabled in zip(quantizers, enabled):
            if was_enabled:
                quantizer.enable()


def method_grid(methods: Sequence[str], percentiles: Sequence[float]) -> list[tuple[str, dict[str, Any]]]:
    """``(method, options)`` for each method to try; ``"percentile"`` once per percentile."""
    grid: list[tuple[str, dict[str, Any]]] = []
    for method in methods:
        if method == "percentile":
            grid += [("percentile", {"percentile": p}) for p in percentiles]
        else:
            grid.append((check_method(method), {}))
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
    progress: bool = True,
) -> PTQResult:
    """Calibrate ``model`` with every method from one pass over ``calib_data``; keep the best.

    Args:
        model: a quantized model (:func:`qdq.quantize_model` and, if wanted, placement already applied).
        calib_data: calibration batches (see :func:`qdq.workflow.calibration.collect_stats`).
        eval_fn: ``eval_fn(model) -> score``, higher is better (e.g. top-1 accuracy in percent).
        methods: calibration methods to try; ``"percentile"`` expands to each of ``percentiles``.

    Returns:
        A :class:`PTQResult`; the model is left with the best method's ranges loaded.
    """
    grid = method_grid(methods, percentiles)
    with disabled_quantizers(model):
        float_score = float(eval_fn(model))
    collect_stats(model, calib_data, num_batches=num_batches, calibrator="histogram",
                  forward_fn=forward_fn, progress=progress)  # fmt: skip
    results = []
    for method, options in grid:
        load_amax(model, method, weight_method=weight_method, **options)
        score = float(eval_fn(model))
        results.append(MethodResult(method, options, score, snapshot_amax(model)))
        _log.info("PTQ %s: %.3f", results[-1].label, score)
    best = max(results, key=lambda r: r.score)  # first of equals: the grid's order breaks ties
    restore_amax(model, best.amax)
    return PTQResult(float_score, results, best)
