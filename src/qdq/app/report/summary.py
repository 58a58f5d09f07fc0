"""``summary.json``: every number of a report, with stable keys (absent parts are ``null`` or empty)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.app.report.inputs import LayerHistogram, ReportData, accuracy_rows, histograms, latency_rows, qat_dict

if TYPE_CHECKING:
    from qdq.workflow.post_training import PTQResult
    from qdq.workflow.sensitivity_analysis import SensitivityResult

__all__ = ["SCHEMA_VERSION", "jsonable", "model_summary"]

#: version of the layout of ``summary.json``; bumped when a key changes meaning or disappears
SCHEMA_VERSION = 1


def jsonable(value: Any) -> Any:
    """Plain JSON values: tensors and arrays as lists, NaN as null, ±inf as the strings ``"inf"`` /
    ``"-inf"`` (e.g. the SQNR of identical outputs), paths as strings, unknown objects as ``str()``."""
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float | np.floating):
        return _float(float(value))
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if hasattr(value, "detach") and hasattr(value, "tolist"):  # torch.Tensor, without importing torch
        return jsonable(value.detach().cpu().tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _float(number: float) -> float | str | None:
    if math.isnan(number):
        return None
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def model_summary(data: ReportData, plots: Mapping[str, str]) -> dict[str, Any]:
    """One model's entry of ``summary.json``; ``plots`` maps plot keys to the file names written."""
    hists = histograms(data)
    return {
        "model": data.model,
        "dataset": data.dataset,
        "metric": data.metric,
        "float_score": data.reference_score,
        "accuracy": accuracy_rows(data),
        "ptq": _ptq_summary(data.ptq),
        "calibration": None if data.calibration is None else data.calibration.to_dict(),
        "qat": qat_dict(data.qat),
        "sensitivity": _sensitivity_summary(data.sensitivity),
        "latency": latency_rows(data.latency),
        "histograms": {name: _histogram_summary(h, plots.get(f"hist:{name}")) for name, h in hists.items()},
        "plots": {k: v for k, v in plots.items() if not k.startswith("hist:")},
        "notes": [str(n) for n in data.notes],
        "extra": data.extra,
    }


def _ptq_summary(ptq: PTQResult | None) -> dict[str, Any] | None:
    """Scores per method, the per-tensor (scalar) amax of each method by quantizer name, and the largest clipping
    error of each method's ranges."""
    if ptq is None:
        return None
    return {
        "float": ptq.float_score,
        "methods": {r.label: r.score for r in ptq.results},
        "options": {r.label: {"method": r.method, **r.options} for r in ptq.results},
        "best": ptq.best.label,
        "scalar_amax": {r.label: {n: float(a) for n, a in r.amax.items() if _one_value(a)} for r in ptq.results},
        "largest_clipping_error": {r.label: _largest_clipping(r) for r in ptq.results},
    }


def _largest_clipping(result: Any) -> float | None:
    """The largest clipping error of a method's ranges (None without diagnostics, e.g. Keras PTQ)."""
    worst = result.diagnostics.worst(1) if getattr(result, "diagnostics", None) is not None else []
    return worst[0].clipping_error if worst else None


def _one_value(amax: Any) -> bool:
    """A per-tensor range: a one-element tensor (PyTorch PTQ) or a number (Keras PTQ)."""
    return amax.numel() == 1 if hasattr(amax, "numel") else np.ndim(amax) == 0


def _sensitivity_summary(result: SensitivityResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    layers = [{"name": s.name, "only_this_quantized": s.only_this_quantized,
               "all_but_this_quantized": s.all_but_this_quantized} for s in result.layers]  # fmt: skip
    return {"float": result.float_score, "quantized": result.quantized_score, "layers": layers}


def _histogram_summary(hist: LayerHistogram, plot: str | None) -> dict[str, Any]:
    return {
        "amax": hist.amax,
        "bins": int(hist.counts.size),
        "range": [float(hist.edges[0]), float(hist.edges[-1])],
        "total": float(hist.counts.sum()),
        "plot": plot,
    }
