"""What a report shows: :class:`ReportData` per model, and its parts in one normalised form.

The writers (plots, pages, ``summary.json``) read ``ReportData`` only through the views here, so a
part given in any accepted form (a PTQ result or a plain score table, benchmark results or latency
dicts, histogram tuples...) is shown the same way everywhere. Bad parts raise ``QdqConfigError``
before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from qdq.errors import QdqConfigError

if TYPE_CHECKING:
    from qdq.runtime.base import BenchmarkResult
    from qdq.workflow.diagnostics import CalibrationReport
    from qdq.workflow.fine_tuning import QATResult
    from qdq.workflow.post_training import PTQResult
    from qdq.workflow.sensitivity_analysis import SensitivityResult

__all__ = [
    "LATENCY_KEYS",
    "LayerHistogram",
    "ReportData",
    "accuracy_rows",
    "histograms",
    "latency_group",
    "latency_row",
    "latency_rows",
    "qat_dict",
]

#: keys of a latency row, in the order tables and ``summary.json`` show them; ``speedup_low`` /
#: ``speedup_high`` are the spread of a speed-up measured in interleaved rounds (None otherwise)
LATENCY_KEYS = ("runtime", "variant", "batch", "threads", "median_ms", "speedup", "speedup_low", "speedup_high")


class LayerHistogram(NamedTuple):
    """One activation histogram: ``counts[i]`` values fell in ``[edges[i], edges[i+1])``; amax by method."""

    counts: np.ndarray
    edges: np.ndarray
    amax: dict[str, float]


@dataclass
class ReportData:
    """Everything one model's report shows; every part but ``model`` is optional.

    Attributes:
        title: page title (the first one's, when several are written together).
        model: model name (section heading, plot-name prefix when several).
        dataset: dataset name.
        accuracy: configuration name -> score, e.g. ``{"FP32": 98.9, "PTQ entropy": 98.7, "ORT INT8": 98.7}``.
        float_score: the float reference; default ``ptq.float_score``, else ``accuracy["FP32"]``.
        ptq: the :func:`qdq.ptq` result.
        calibration: :func:`qdq.calibration_report` of the ranges kept (what each quantizer's range clips, how
            it was set); its worst quantizers are plotted from ``histograms``.
        qat: the :func:`qdq.qat` result, or a dict ``{"epochs": [{"epoch", "loss", "lr", "score"}...],
            "final_score": ...}``.
        sensitivity: the :func:`qdq.sensitivity` result.
        latency: rows ``{"runtime", "variant" ("FP32"/"INT8"), "batch", "threads", "median_ms"}`` (times in
            milliseconds), optionally with their ``speedup`` over FP32 and its spread ``speedup_low`` /
            ``speedup_high`` as measured interleaved (:func:`qdq.runtime.compare_models`), or
            :class:`~qdq.runtime.base.BenchmarkResult` objects.
        histograms: quantizer name -> :class:`LayerHistogram` (see
            :func:`qdq.app.report.histograms.collect_histograms`); plain ``(counts, edges, {method: amax})``
            tuples are accepted.
        notes: free text lines, shown as a list.
        extra: more machine-readable values, copied into ``summary.json`` only.
        metric: what the scores measure (axis and column label).
    """

    title: str = "qdq quantization report"
    model: str = "model"
    dataset: str = ""
    accuracy: dict[str, float] = field(default_factory=dict)
    float_score: float | None = None
    ptq: PTQResult | None = None
    calibration: CalibrationReport | None = None
    qat: QATResult | Mapping[str, Any] | None = None
    sensitivity: SensitivityResult | None = None
    latency: list[Mapping[str, Any] | BenchmarkResult] = field(default_factory=list)
    histograms: dict[str, LayerHistogram] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    metric: str = "top-1 (%)"

    @property
    def reference_score(self) -> float | None:
        """The float model's score: ``float_score``, else the PTQ float score, else ``accuracy["FP32"]``."""
        if self.float_score is not None:
            return float(self.float_score)
        if self.ptq is not None:
            return float(self.ptq.float_score)
        value = self.accuracy.get("FP32")
        return None if value is None else float(value)


def latency_row(result: BenchmarkResult, variant: str | None = None) -> dict[str, Any]:
    """A latency row of :class:`ReportData` from a benchmark result (variant: its precision, upper-cased)."""
    return {
        "runtime": result.backend,
        "variant": variant or result.precision.upper(),
        "batch": result.batch,
        "threads": result.threads,
        "min_ms": result.min_ms,
        "median_ms": result.median_ms,
        "p90_ms": result.p90_ms,
        "label": result.label,
    }


def accuracy_rows(data: ReportData) -> dict[str, float]:
    """``data.accuracy``, or float / PTQ methods / QAT when it is empty."""
    if data.accuracy:
        return {str(k): float(v) for k, v in data.accuracy.items()}
    rows: dict[str, float] = {}
    if data.ptq is not None:
        rows["FP32"] = float(data.ptq.float_score)
        rows.update({f"PTQ {r.label}": float(r.score) for r in data.ptq.results})
    qat = qat_dict(data.qat)
    if qat is not None and qat["final_score"] is not None:
        rows["QAT"] = float(qat["final_score"])
    return rows


def qat_dict(qat: QATResult | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{"epochs": [per-epoch dicts], "final_score": score or None}``, or None without QAT."""
    if qat is None:
        return None
    if isinstance(qat, Mapping):
        epochs, final = qat.get("epochs", []), qat.get("final_score")
    else:
        epochs, final = qat.epochs, qat.final_score
    epochs = [dict(e) for e in epochs]
    if final is None and epochs:
        final = epochs[-1].get("score")
    return {"epochs": epochs, "final_score": final}


def latency_rows(rows: Iterable[Mapping[str, Any] | BenchmarkResult]) -> list[dict[str, Any]]:
    """Rows as dicts, each with ``speedup``: the row's own (measured interleaved), else FP32 median / this
    median (same runtime, batch, threads).

    Raises:
        QdqConfigError: a row lacks ``runtime``, ``variant``, ``batch`` or ``median_ms``.
    """
    out = []
    for row in rows:
        item = dict(row) if isinstance(row, Mapping) else latency_row(row)
        missing = [k for k in ("runtime", "variant", "batch", "median_ms") if k not in item]
        if missing:
            raise QdqConfigError(f"latency row {item} lacks {missing}; give runtime, variant, batch and median_ms.")
        out.append({**{key: item.get(key) for key in LATENCY_KEYS}, **item})  # fixed order of the known keys
    baselines = {latency_group(r): r["median_ms"] for r in out if str(r["variant"]).upper() == "FP32"}
    for item in out:
        if item["speedup"] is not None:
            continue
        base = baselines.get(latency_group(item))
        item["speedup"] = None if base is None or not item["median_ms"] else float(base) / float(item["median_ms"])
    return out


def latency_group(row: Mapping[str, Any]) -> tuple[str, int, Any]:
    """What must match for two latency rows to be compared: (runtime, batch, threads)."""
    return (str(row["runtime"]), int(row["batch"]), row["threads"])


def histograms(data: ReportData) -> dict[str, LayerHistogram]:
    """``data.histograms`` as float64 arrays and float amax values, checked.

    Raises:
        QdqConfigError: a histogram whose edges are not one more than its counts.
    """
    out = {}
    for name, value in data.histograms.items():
        counts, edges, amax = value
        counts, edges = np.asarray(counts, dtype=np.float64).reshape(-1), np.asarray(edges, dtype=np.float64)
        if edges.shape != (counts.size + 1,):
            raise QdqConfigError(f"histogram {name!r}: {counts.size} counts need {counts.size + 1} edges.")
        out[str(name)] = LayerHistogram(counts, edges, {str(k): float(v) for k, v in dict(amax).items()})
    return out
