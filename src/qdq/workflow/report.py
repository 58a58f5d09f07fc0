"""The report of a quantization run: ``report.md``, ``report.html``, ``summary.json`` and PNG plots.

Build a :class:`ReportData` per model (or per configuration: W8A8, W4A8...) from what the workflow
returned, then call :func:`write_report`::

    result = qdq.ptq(model, calib_loader, evaluate)
    data = ReportData(model="resnet-digits", dataset="digits", ptq=result,
                      histograms=collect_histograms(model, result))
    write_report("out", data)

Files written into ``out_dir`` (each atomically: a temporary file in the same folder, then ``os.replace``):

* ``accuracy.png``: a bar per configuration (``ReportData.accuracy``, or PTQ methods and QAT when that
  is empty), the float score as a dashed line;
* ``sensitivity.png``: per layer, horizontal bars "only this layer quantized" and "all but this one";
* ``latency.png``: median latency bars per runtime / batch / threads, one per variant (FP32, INT8...),
  the speed-up over FP32 written above each quantized bar;
* ``hist_<quantizer>.png``: the activation histogram (log counts) with a vertical line per method's amax;
* ``report.md`` and ``report.html`` (HTML5; plots referenced by **relative path**, so keep the folder
  together; every text escaped);
* ``summary.json``: every number, stable keys (absent parts are ``null`` or empty), written last.

Parts with no data (no sensitivity, no latency, no histograms...) are left out of the report, not errors.
With several :class:`ReportData`, plot names get a ``<model>_`` prefix and each model gets a section.
File names are made of ``[A-Za-z0-9._-]`` only (other characters become ``_``, clashes get a hash).

matplotlib is imported only when plotting, and only its object API is used (no pyplot state).
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import math
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from qdq.atomic import write_bytes_atomic
from qdq.errors import QdqConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from torch import nn

    from qdq.runtime.base import BenchmarkResult
    from qdq.workflow.ptq import PTQResult
    from qdq.workflow.qat import QATResult
    from qdq.workflow.sensitivity import SensitivityResult

__all__ = [
    "LayerHistogram",
    "ReportData",
    "collect_histograms",
    "latency_row",
    "read_histogram",
    "write_report",
]

SCHEMA_VERSION = 1
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":")
_LATENCY_KEYS = ("runtime", "variant", "batch", "threads", "min_ms", "median_ms", "p90_ms", "speedup")
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|#])")


# --- inputs ----------------------------------------------------------------------------------------------


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
        qat: the :func:`qdq.qat` result, or a dict ``{"epochs": [{"epoch", "loss", "lr", "score"}...],
            "final_score": ...}``.
        sensitivity: the :func:`qdq.workflow.sensitivity.sensitivity` result.
        latency: rows ``{"runtime", "variant" ("FP32"/"INT8"), "batch", "threads", "min_ms", "median_ms"}``
            (``p90_ms`` optional), or :class:`~qdq.runtime.base.BenchmarkResult` objects.
        histograms: quantizer name -> :class:`LayerHistogram` (see :func:`collect_histograms`); plain
            ``(counts, edges, {method: amax})`` tuples are accepted.
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


# --- reading histograms from calibrators -----------------------------------------------------------------


def read_histogram(calibrator: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``(counts, edges)`` of a :class:`~qdq.calib.HistogramCalibrator`, or ``None`` if it holds none.

    Uses the public ``bin_counts`` / ``bin_width`` properties. A per-channel histogram is summed into one
    at the widest channel's bin width; widths are powers of two apart, so this re-binning is exact.
    """
    counts_t, width_t = getattr(calibrator, "bin_counts", None), getattr(calibrator, "bin_width", None)
    if counts_t is None or width_t is None:
        return None
    counts = counts_t.detach().cpu().numpy().astype(np.int64).reshape(-1, counts_t.shape[-1])
    widths = width_t.detach().cpu().numpy().astype(np.float64).reshape(-1)
    merged, width = _merge_channels(counts, widths)
    return merged, np.arange(merged.size + 1, dtype=np.float64) * width


def _merge_channels(counts: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, float]:
    """Sum per-channel histograms (rows) into one with the largest bin width."""
    width = float(widths.max())
    if counts.shape[0] == 1:
        return counts[0].copy(), width
    bins = counts.shape[1]
    merged = np.zeros(bins, dtype=np.int64)
    index = np.arange(bins)
    for row, channel_width in zip(counts, widths):
        factor = bins if channel_width <= 0 else min(bins, max(1, round(width / channel_width)))
        np.add.at(merged, index // factor, row)
    return merged, width


def collect_histograms(
    model: nn.Module, ptq: PTQResult | None = None, *, max_layers: int | None = 8
) -> dict[str, LayerHistogram]:
    """Activation histograms held by ``model``'s calibrators, with each PTQ method's amax.

    Call it after :func:`qdq.workflow.calibrate.collect_stats` (or :func:`qdq.ptq`, which leaves the
    histograms in place) and before the calibrators are reset. Quantizers without a histogram are
    skipped. With more than ``max_layers`` of them, evenly spaced ones are kept (first and last included).
    A per-channel amax is shown as its largest channel.
    """
    from qdq.workflow.calibrate import named_quantizers

    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, quantizer in named_quantizers(model, weights=False):
        histogram = read_histogram(quantizer.calibrator)
        if histogram is not None:
            found[name] = histogram
    names = _spread(list(found), max_layers)
    return {name: LayerHistogram(*found[name], _method_amax(ptq, name)) for name in names}


def _spread(names: list[str], count: int | None) -> list[str]:
    """At most ``count`` evenly spaced items of ``names`` (first and last kept), in order."""
    if count is None or len(names) <= count:
        return names
    if count <= 0:
        return []
    picks = np.unique(np.linspace(0, len(names) - 1, count).round().astype(int))
    return [names[i] for i in picks]


def _method_amax(ptq: PTQResult | None, name: str) -> dict[str, float]:
    """Amax of quantizer ``name`` for each PTQ method (largest channel if per channel)."""
    if ptq is None:
        return {}
    return {r.label: float(r.amax[name].detach().abs().max()) for r in ptq.results if name in r.amax}


# --- normalised views of the inputs ----------------------------------------------------------------------


def _accuracy_rows(data: ReportData) -> dict[str, float]:
    """``data.accuracy``, or float / PTQ methods / QAT when it is empty."""
    if data.accuracy:
        return {str(k): float(v) for k, v in data.accuracy.items()}
    rows: dict[str, float] = {}
    if data.ptq is not None:
        rows["FP32"] = float(data.ptq.float_score)
        rows.update({f"PTQ {r.label}": float(r.score) for r in data.ptq.results})
    qat = _qat_dict(data.qat)
    if qat is not None and qat["final_score"] is not None:
        rows["QAT"] = float(qat["final_score"])
    return rows


def _qat_dict(qat: QATResult | Mapping[str, Any] | None) -> dict[str, Any] | None:
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


def _latency_rows(rows: Iterable[Mapping[str, Any] | BenchmarkResult]) -> list[dict[str, Any]]:
    """Rows as dicts, each with ``speedup`` (FP32 median / this median, same runtime, batch, threads)."""
    out = []
    for row in rows:
        item = dict(row) if isinstance(row, Mapping) else latency_row(row)
        missing = [k for k in ("runtime", "variant", "batch", "median_ms") if k not in item]
        if missing:
            raise QdqConfigError(f"latency row {item} lacks {missing}; give runtime, variant, batch and median_ms.")
        out.append({**{key: item.get(key) for key in _LATENCY_KEYS}, **item})  # fixed order of the known keys
    baselines = {_latency_group(r): r["median_ms"] for r in out if str(r["variant"]).upper() == "FP32"}
    for item in out:
        base = baselines.get(_latency_group(item))
        item["speedup"] = None if base is None or not item["median_ms"] else float(base) / float(item["median_ms"])
    return out


def _latency_group(row: Mapping[str, Any]) -> tuple[str, int, Any]:
    return (str(row["runtime"]), int(row["batch"]), row["threads"])


def _histograms(data: ReportData) -> dict[str, LayerHistogram]:
    out = {}
    for name, value in data.histograms.items():
        counts, edges, amax = value
        counts, edges = np.asarray(counts, dtype=np.float64).reshape(-1), np.asarray(edges, dtype=np.float64)
        if edges.shape != (counts.size + 1,):
            raise QdqConfigError(f"histogram {name!r}: {counts.size} counts need {counts.size + 1} edges.")
        out[str(name)] = LayerHistogram(counts, edges, {str(k): float(v) for k, v in dict(amax).items()})
    return out


# --- file names and atomic writes ------------------------------------------------------------------------


def _slug(name: str, max_len: int = 80) -> str:
    """A file-name-safe version of ``name``: ``[A-Za-z0-9._-]``, no leading dot, at most ``max_len``."""
    slug = _SAFE_CHARS.sub("_", name).strip("._-") or "x"
    if len(slug) > max_len:
        slug = f"{slug[: max_len - 9]}-{_short_hash(name)}"
    return slug


def _short_hash(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]


def _unique_slugs(names: Iterable[str]) -> dict[str, str]:
    """Distinct slugs for distinct names (a clash gets the name's hash appended)."""
    slugs: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        slug = _slug(name)
        if slug.lower() in taken:  # case-insensitive file systems
            slug = f"{slug}-{_short_hash(name)}"
        taken.add(slug.lower())
        slugs[name] = slug
    return slugs


def _save_figure(figure: Figure, path: Path, dpi: int) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return write_bytes_atomic(path, buffer.getvalue())


# --- plots -----------------------------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _padded_limits(values: Sequence[float], floor: float | None = 0.0) -> tuple[float, float]:
    """Axis limits around ``values`` with room for labels (scores differ by tenths: zoom in)."""
    lo, hi = min(values), max(values)
    pad = max(0.15 * (hi - lo), 0.5)
    lower = lo - 3 * pad
    return (lower if floor is None else max(floor, lower)), hi + 1.5 * pad


def _bar_color(name: str) -> str:
    upper = name.upper()
    if upper.startswith(("FP32", "FLOAT")):
        return _COLORS[7]
    if "QAT" in upper:
        return _COLORS[2]
    if "PTQ" in upper:
        return _COLORS[0]
    return _COLORS[1]


def _accuracy_figure(rows: Mapping[str, float], reference: float | None, metric: str, title: str) -> Figure:
    names, values = list(rows), list(rows.values())
    figure = _new_figure(max(5.0, 0.75 * len(names) + 2.0), 4.2)
    ax = figure.add_subplot()
    bars = ax.bar(range(len(names)), values, color=[_bar_color(n) for n in names], width=0.7)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8, padding=2)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label=f"FP32 reference {reference:.2f}")
        figure.legend(loc="outside upper right", fontsize=8)
    ax.set_ylim(*_padded_limits([*values, *([] if reference is None else [reference])]))
    tilt = len(names) > 4
    ax.set_xticks(range(len(names)), names, rotation=30 if tilt else 0, ha="right" if tilt else "center", fontsize=8)
    ax.set_ylabel(f"{metric} (axis zoomed)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return figure


def _sensitivity_figure(result: SensitivityResult, metric: str, title: str) -> Figure:
    layers = result.layers
    figure = _new_figure(7.5, max(2.8, 0.32 * len(layers) + 1.8))
    ax = figure.add_subplot()
    y = np.arange(len(layers))
    only = [s.only_this_quantized for s in layers]
    all_but = [s.all_but_this_quantized for s in layers]
    ax.barh(y - 0.2, only, height=0.38, color=_COLORS[3], label="only this layer quantized")
    ax.barh(y + 0.2, all_but, height=0.38, color=_COLORS[0], label="all but this layer quantized")
    ax.axvline(result.float_score, color="black", linestyle="--", linewidth=1, label=f"float {result.float_score:.2f}")
    ax.axvline(result.quantized_score, color=_COLORS[1], linestyle=":", linewidth=1.5,
               label=f"fully quantized {result.quantized_score:.2f}")  # fmt: skip
    values = [*only, *all_but, result.float_score, result.quantized_score]
    ax.set_xlim(*_padded_limits(values))
    ax.set_yticks(y, [s.name for s in layers], fontsize=8)
    ax.set_ylim(len(layers) - 0.5, -0.5)  # first layer on top, no empty margin
    ax.set_xlabel(f"{metric} (axis zoomed)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    figure.legend(fontsize=7, loc="outside lower center", ncols=2)
    return figure


def _latency_figure(rows: list[dict[str, Any]], title: str) -> Figure:
    groups = list(dict.fromkeys(_latency_group(r) for r in rows))
    variants = sorted(dict.fromkeys(str(r["variant"]) for r in rows), key=lambda v: v.upper() != "FP32")
    by_key = {(_latency_group(r), str(r["variant"])): r for r in rows}
    width = 0.8 / len(variants)
    figure = _new_figure(max(5.0, 1.3 * len(groups) * len(variants) + 1.5), 4.2)
    ax = figure.add_subplot()
    x = np.arange(len(groups))
    for i, variant in enumerate(variants):
        found = [by_key.get((g, variant)) for g in groups]
        heights = [np.nan if r is None else float(r["median_ms"]) for r in found]
        bars = ax.bar(x + (i - (len(variants) - 1) / 2) * width, heights, width * 0.95,
                      color=_COLORS[7] if variant.upper() == "FP32" else _COLORS[i % 7], label=variant)  # fmt: skip
        labels = [_speedup_label(r) for r in found]
        ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
    medians = [float(r["median_ms"]) for r in rows if r["median_ms"]]
    if medians and max(medians) / max(min(medians), 1e-12) > 50:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.set_xticks(x, [_group_label(g) for g in groups], fontsize=8)
    ax.set_ylabel("median latency (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return figure


def _speedup_label(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return ""
    if row["speedup"] is None or str(row["variant"]).upper() == "FP32":
        return f"{float(row['median_ms']):.3g}"
    return f"{float(row['median_ms']):.3g}\n×{row['speedup']:.2f}"


def _group_label(group: tuple[str, int, Any]) -> str:
    runtime, batch, threads = group
    return f"{runtime}\nbatch {batch}, {'default' if threads is None else threads} threads"


def _display_bins(hist: LayerHistogram, max_bins: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty bins past the data and the largest amax, then merge bins down to ``max_bins``."""
    counts, edges = hist.counts, hist.edges
    nonzero = np.flatnonzero(counts)
    last = int(nonzero[-1]) + 1 if nonzero.size else counts.size
    limit = max([float(edges[last]), *hist.amax.values()])
    keep = int(np.clip(np.searchsorted(edges, limit, side="left"), 1, counts.size))
    counts, edges = counts[:keep], edges[: keep + 1]
    factor = math.ceil(keep / max_bins)
    if factor > 1:
        starts = np.arange(0, keep, factor)
        counts, edges = np.add.reduceat(counts, starts), edges[np.r_[starts, keep]]
    return counts, edges


def _histogram_figure(name: str, hist: LayerHistogram) -> Figure:
    """Log-count histogram with a vertical line per method's amax (legend outside, on the right)."""
    counts, edges = _display_bins(hist)
    figure = _new_figure(9.0, 3.8)
    ax = figure.add_subplot()
    shown = np.where(counts > 0, counts, 0.5).astype(np.float64)
    ax.stairs(shown, edges, baseline=0.5, fill=True, color=_COLORS[0], alpha=0.45)
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(float(shown.max()) * 3, 10.0))  # at least a decade: major tick labels only
    _amax_lines(ax, hist.amax)
    ax.set_xlim(float(edges[0]), max([float(edges[-1]), *hist.amax.values()]) * 1.03)
    ax.set_xlabel("|activation|")
    ax.set_ylabel("count (log scale)")
    ax.set_title(name, fontsize=10)
    ax.grid(alpha=0.25)
    if hist.amax:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="amax by method", title_fontsize=7)
    return figure


def _amax_lines(ax: Any, amax: Mapping[str, float]) -> None:
    """A vertical line per method, with a marker at a staggered height so that equal amax stay visible."""
    for i, (method, value) in enumerate(sorted(amax.items(), key=lambda item: item[1])):
        color, style = _COLORS[(i + 1) % len(_COLORS)], _LINESTYLES[i % len(_LINESTYLES)]
        ax.axvline(value, color=color, linestyle=style, linewidth=1.5, label=f"{method}: {value:.4g}")
        height = 0.95 - 0.08 * (i % 10)
        ax.plot([value], [height], marker="v", color=color, markersize=6, transform=ax.get_xaxis_transform())


def _write_plots(out: Path, data: ReportData, prefix: str, dpi: int) -> dict[str, str]:
    """Write every plot ``data`` has material for; returns plot key -> file name."""
    files: dict[str, str] = {}
    label = f"{data.model} — " if data.model else ""

    def save(key: str, filename: str, figure: Figure) -> None:
        _save_figure(figure, out / filename, dpi)
        files[key] = filename

    accuracy = _accuracy_rows(data)
    if accuracy:
        save("accuracy", f"{prefix}accuracy.png",
             _accuracy_figure(accuracy, data.reference_score, data.metric, f"{label}accuracy"))  # fmt: skip
    if data.sensitivity is not None and data.sensitivity.layers:
        save("sensitivity", f"{prefix}sensitivity.png",
             _sensitivity_figure(data.sensitivity, data.metric, f"{label}per-layer sensitivity"))  # fmt: skip
    latency = _latency_rows(data.latency)
    if latency:
        save("latency", f"{prefix}latency.png", _latency_figure(latency, f"{label}latency, FP32 vs INT8"))
    histograms = _histograms(data)
    slugs = _unique_slugs(histograms)
    for name, hist in histograms.items():
        save(f"hist:{name}", f"{prefix}hist_{slugs[name]}.png", _histogram_figure(name, hist))
    return files


# --- document blocks, rendered to Markdown and HTML ------------------------------------------------------


@dataclass
class _Heading:
    level: int
    text: str


@dataclass
class _Paragraph:
    text: str


@dataclass
class _List:
    items: list[str]


@dataclass
class _Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class _Image:
    src: str
    alt: str


_Block = _Heading | _Paragraph | _List | _Table | _Image


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return ""
    if isinstance(value, float | int | np.floating | np.integer) and not isinstance(value, bool):
        number = float(value)
        return "" if math.isnan(number) else format(number, spec)
    return str(value)


def _section_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[_Block]:
    """The blocks of one model's report; ``level`` is the heading level of its parts."""
    blocks: list[_Block] = []
    facts = [f"Model: {data.model}"] + ([f"dataset: {data.dataset}"] if data.dataset else [])
    blocks.append(_Paragraph(", ".join(facts) + "."))
    if data.notes:
        blocks.append(_List([str(n) for n in data.notes]))
    blocks += _accuracy_blocks(data, plots, level)
    blocks += _ptq_blocks(data, level)
    blocks += _qat_blocks(data, level)
    blocks += _sensitivity_blocks(data, plots, level)
    blocks += _latency_blocks(data, plots, level)
    blocks += _histogram_blocks(data, plots, level)
    return blocks


def _accuracy_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[_Block]:
    rows = _accuracy_rows(data)
    if not rows:
        return []
    reference = data.reference_score
    table = _Table(["configuration", data.metric, "vs FP32"],
                   [[name, _fmt(v), "" if reference is None else _fmt(v - reference, "+.2f")]
                    for name, v in rows.items()])  # fmt: skip
    return [_Heading(level, "Accuracy"), table, *_image(plots, "accuracy", "accuracy per configuration")]


def _ptq_blocks(data: ReportData, level: int) -> list[_Block]:
    ptq = data.ptq
    if ptq is None:
        return []
    rows = [["float (no quantization)", _fmt(ptq.float_score), ""]]
    rows += [[r.label + (" (best)" if r is ptq.best else ""), _fmt(r.score), _fmt(r.score - ptq.float_score, "+.2f")]
             for r in ptq.results]  # fmt: skip
    return [_Heading(level, "Post-training quantization (calibration methods)"),
            _Table(["calibration", data.metric, "vs float"], rows)]  # fmt: skip


def _qat_blocks(data: ReportData, level: int) -> list[_Block]:
    qat = _qat_dict(data.qat)
    if qat is None or not qat["epochs"]:
        return []
    keys = list(dict.fromkeys(k for epoch in qat["epochs"] for k in epoch))
    specs = {"epoch": ".0f", "loss": ".4f", "lr": ".3g"}
    rows = [[_fmt(e.get(k), specs.get(k, ".2f")) for k in keys] for e in qat["epochs"]]
    blocks: list[_Block] = [_Heading(level, "Quantization-aware training"), _Table(keys, rows)]
    if qat["final_score"] is not None:
        blocks.append(_Paragraph(f"Final {data.metric}: {_fmt(qat['final_score'])}."))
    return blocks


def _sensitivity_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[_Block]:
    result = data.sensitivity
    if result is None or not result.layers:
        return []
    text = f"Float {_fmt(result.float_score)}, fully quantized {_fmt(result.quantized_score)}."
    rows = [[s.name, _fmt(s.only_this_quantized), _fmt(s.all_but_this_quantized)] for s in result.layers]
    return [_Heading(level, "Per-layer sensitivity"), _Paragraph(text),
            _Table(["layer", "only this quantized", "all but this quantized"], rows),
            *_image(plots, "sensitivity", "per-layer sensitivity")]  # fmt: skip


def _latency_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[_Block]:
    rows = _latency_rows(data.latency)
    if not rows:
        return []
    headers = ["runtime", "variant", "batch", "threads", "min (ms)", "median (ms)", "p90 (ms)", "speed-up vs FP32"]
    table = [[str(r["runtime"]), str(r["variant"]), str(r["batch"]), "default" if r["threads"] is None
              else str(r["threads"]), _fmt(r["min_ms"], ".3f"), _fmt(r["median_ms"], ".3f"), _fmt(r["p90_ms"], ".3f"),
              "" if r["speedup"] is None else f"×{r['speedup']:.2f}"] for r in rows]  # fmt: skip
    return [_Heading(level, "Latency"), _Table(headers, table), *_image(plots, "latency", "latency FP32 vs INT8")]


def _histogram_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[_Block]:
    histograms = _histograms(data)
    if not histograms:
        return []
    methods = list(dict.fromkeys(m for h in histograms.values() for m in h.amax))
    blocks: list[_Block] = [_Heading(level, "Activation histograms and amax per method")]
    if methods:
        rows = [[name, *(_fmt(h.amax.get(m), ".4g") for m in methods)] for name, h in histograms.items()]
        blocks.append(_Table(["quantizer", *methods], rows))
    for name in histograms:
        blocks += _image(plots, f"hist:{name}", f"activation histogram of {name}")
    return blocks


def _image(plots: Mapping[str, str], key: str, alt: str) -> list[_Block]:
    return [_Image(plots[key], alt)] if key in plots else []


def _md_escape(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", text).replace("\n", " ")


def _to_markdown(title: str, blocks: Sequence[_Block]) -> str:
    lines = [f"# {_md_escape(title)}", ""]
    for block in blocks:
        if isinstance(block, _Heading):
            lines += [f"{'#' * block.level} {_md_escape(block.text)}", ""]
        elif isinstance(block, _Paragraph):
            lines += [_md_escape(block.text), ""]
        elif isinstance(block, _List):
            lines += [f"- {_md_escape(item)}" for item in block.items] + [""]
        elif isinstance(block, _Table):
            lines += [*_md_table(block), ""]
        else:
            lines += [f"![{_md_escape(block.alt)}]({urllib.parse.quote(block.src)})", ""]
    return "\n".join(lines)


def _md_table(table: _Table) -> list[str]:
    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(_md_escape(c) for c in cells) + " |"

    return [row(table.headers), "|" + "---|" * len(table.headers), *(row(r) for r in table.rows)]


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3}td{font-variant-numeric:tabular-nums}img{max-width:100%;height:auto}
figure{margin:1em 0}figcaption{color:#666;font-size:.9em}"""


def _to_html(title: str, blocks: Sequence[_Block]) -> str:
    esc = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{esc(title)}</h1>"]  # fmt: skip
    for block in blocks:
        if isinstance(block, _Heading):
            parts.append(f"<h{block.level}>{esc(block.text)}</h{block.level}>")
        elif isinstance(block, _Paragraph):
            parts.append(f"<p>{esc(block.text)}</p>")
        elif isinstance(block, _List):
            parts.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, _Table):
            parts.append(_html_table(block))
        else:
            src = esc(urllib.parse.quote(block.src))
            parts.append(f'<figure><img src="{src}" alt="{esc(block.alt)}"><figcaption>{esc(block.alt)}'
                         "</figcaption></figure>")  # fmt: skip
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _html_table(table: _Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"


# --- summary.json ----------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Plain JSON values: tensors and arrays as lists, NaN/Inf as null, unknown objects as strings."""
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if hasattr(value, "detach") and hasattr(value, "tolist"):  # torch.Tensor, without importing torch
        return _jsonable(value.detach().cpu().tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _ptq_summary(ptq: PTQResult | None) -> dict[str, Any] | None:
    """Scores per method and the per-tensor (scalar) amax of each method, by quantizer name."""
    if ptq is None:
        return None
    return {
        "float": ptq.float_score,
        "methods": {r.label: r.score for r in ptq.results},
        "options": {r.label: {"method": r.method, **r.options} for r in ptq.results},
        "best": ptq.best.label,
        "scalar_amax": {r.label: {n: float(a) for n, a in r.amax.items() if a.numel() == 1} for r in ptq.results},
    }


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


def _model_summary(data: ReportData, plots: Mapping[str, str]) -> dict[str, Any]:
    histograms = _histograms(data)
    return {
        "model": data.model,
        "dataset": data.dataset,
        "metric": data.metric,
        "float_score": data.reference_score,
        "accuracy": _accuracy_rows(data),
        "ptq": _ptq_summary(data.ptq),
        "qat": _qat_dict(data.qat),
        "sensitivity": _sensitivity_summary(data.sensitivity),
        "latency": _latency_rows(data.latency),
        "histograms": {name: _histogram_summary(h, plots.get(f"hist:{name}")) for name, h in histograms.items()},
        "plots": {k: v for k, v in plots.items() if not k.startswith("hist:")},
        "notes": [str(n) for n in data.notes],
        "extra": data.extra,
    }


# --- entry point -----------------------------------------------------------------------------------------


def _prefixes(reports: Sequence[ReportData]) -> list[str]:
    """Plot-name prefixes: none for one report, ``<model>_`` for several (``<model>-<n>_`` on clashes)."""
    if len(reports) == 1:
        return [""]
    slugs = [_slug(r.model) for r in reports]
    lowered = [s.lower() for s in slugs]
    return [f"{s}_" if lowered.count(s.lower()) == 1 else f"{s}-{i + 1}_" for i, s in enumerate(slugs)]


def write_report(
    out_dir: str | os.PathLike[str],
    data: ReportData | Sequence[ReportData],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> dict[str, Path]:
    """Write the report of one model, or of several side by side, into ``out_dir`` (created if needed).

    Returns:
        file name (relative to ``out_dir``) -> path, for every file written: the plots, ``report.md``,
        ``report.html`` and ``summary.json`` (the last one written).
    """
    reports = [data] if isinstance(data, ReportData) else list(data)
    if not reports:
        raise QdqConfigError("write_report needs at least one ReportData.")
    for report in reports:  # bad input fails before anything is written
        _latency_rows(report.latency)
        _histograms(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or reports[0].title
    blocks: list[_Block] = []
    models, written = [], {}
    for report, prefix in zip(reports, _prefixes(reports)):
        plots = _write_plots(out, report, prefix, dpi)
        written.update({name: out / name for name in plots.values()})
        if len(reports) > 1:
            blocks.append(_Heading(2, report.model))
        blocks += _section_blocks(report, plots, 3 if len(reports) > 1 else 2)
        models.append(_model_summary(report, plots))
    summary = {"schema_version": SCHEMA_VERSION, "title": title, "models": models,
               "files": sorted([*written, "report.md", "report.html"])}  # fmt: skip
    for name, text in (("report.md", _to_markdown(title, blocks)), ("report.html", _to_html(title, blocks))):
        written[name] = write_bytes_atomic(out / name, text.encode("utf-8"))
    payload = json.dumps(_jsonable(summary), indent=2, allow_nan=False) + "\n"
    written["summary.json"] = write_bytes_atomic(out / "summary.json", payload.encode("utf-8"))
    return written
