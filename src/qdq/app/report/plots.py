"""The report's PNG plots: accuracy, per-layer sensitivity, latency and activation histograms.

matplotlib is imported only when plotting, and only its object API is used (no pyplot state). Each
file is written atomically.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.app.report.filenames import unique_slugs
from qdq.app.report.inputs import LayerHistogram, ReportData, accuracy_rows, histograms, latency_group, latency_rows
from qdq.atomic import write_bytes_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from qdq.workflow.diagnostics import CalibrationReport
    from qdq.workflow.sensitivity_analysis import SensitivityResult

__all__ = ["write_plots"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":")
#: at most this many bars in a histogram plot (neighbouring bins are merged)
_DISPLAY_BINS = 256


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
    groups = list(dict.fromkeys(latency_group(r) for r in rows))
    variants = sorted(dict.fromkeys(str(r["variant"]) for r in rows), key=lambda v: v.upper() != "FP32")
    by_key = {(latency_group(r), str(r["variant"])): r for r in rows}
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


def _display_bins(hist: LayerHistogram, max_bins: int = _DISPLAY_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty bins past the data and the largest amax, then merge groups of ``2**s`` neighbouring
    bins (:func:`qdq.calib.binning.rebin`, the calibrators' own re-binning) down to at most ``max_bins``."""
    counts, edges = hist.counts, hist.edges
    nonzero = np.flatnonzero(counts)
    last = int(nonzero[-1]) + 1 if nonzero.size else counts.size
    limit = max([float(edges[last]), *hist.amax.values()])
    keep = int(np.clip(np.searchsorted(edges, limit, side="left"), 1, counts.size))
    counts, edges = counts[:keep], edges[: keep + 1]
    shift = (-(-keep // max_bins) - 1).bit_length()  # smallest s with ceil(keep / 2**s) <= max_bins
    if shift == 0:
        return counts, edges
    import torch

    from qdq.calib import binning

    merged = binning.rebin(torch.from_numpy(counts).reshape(1, -1), torch.tensor([shift]))[0].numpy()
    starts = np.arange(0, keep, 1 << shift)
    return merged[: starts.size], edges[np.r_[starts, keep]]


def _histogram_figure(name: str, hist: LayerHistogram, methods: Sequence[str]) -> Figure:
    """Log-count histogram with a vertical line per method's amax, styled by its place in ``methods`` (legend
    outside, on the right)."""
    figure = _new_figure(9.0, 3.8)
    ax = figure.add_subplot()
    _draw_histogram(ax, hist, methods)
    ax.set_title(name, fontsize=10)
    if hist.amax:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="amax by method", title_fontsize=7)
    return figure


def _draw_histogram(ax: Any, hist: LayerHistogram, methods: Sequence[str], extra: Sequence[float] = ()) -> None:
    """The log-count histogram of ``hist`` and a line per method's amax, on ``ax`` (styled by :func:`_amax_lines`);
    the x axis also reaches the values of ``extra``."""
    reach = {**hist.amax, **{f"extra {i}": value for i, value in enumerate(extra)}}
    counts, edges = _display_bins(LayerHistogram(hist.counts, hist.edges, reach))
    shown = np.where(counts > 0, counts, 0.5).astype(np.float64)
    ax.stairs(shown, edges, baseline=0.5, fill=True, color=_COLORS[0], alpha=0.45)
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(float(shown.max()) * 3, 10.0))  # at least a decade: major tick labels only
    _amax_lines(ax, hist.amax, methods)
    ax.set_xlim(float(edges[0]), max([float(edges[-1]), *hist.amax.values(), *extra]) * 1.03)
    ax.set_xlabel("|activation|")
    ax.set_ylabel("count (log scale)")
    ax.grid(alpha=0.25)


def _calibration_figure(
    report: CalibrationReport, hists: Mapping[str, LayerHistogram], methods: Sequence[str], count: int = 4
) -> Figure | None:
    """The ``count`` quantizers with the largest clipping error that have a histogram: each with every PTQ
    method's range (styled by its place in ``methods``) and the range kept (thick black line), titled with what it
    clips."""
    worst = [d for d in report.worst() if d.name in hists][:count]
    if not worst:
        return None
    figure = _new_figure(9.5, 2.7 * len(worst) + 0.4)
    for ax, row in zip(figure.subplots(len(worst), 1, squeeze=False)[:, 0], worst):
        _draw_histogram(ax, hists[row.name], methods, [row.amax])
        ax.axvline(row.amax, color="black", linewidth=2.5, label=f"kept ({row.method or '?'}): {row.amax:.4g}")
        error = 100 * (row.clipping_error or 0.0)
        values = 100 * (row.clipped_values or 0.0)
        ax.set_title(f"{row.name}: clipping error {error:.2f} %, {values:.2f} % of the values above amax", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="amax", title_fontsize=7)
    return figure


def _amax_lines(ax: Any, amax: Mapping[str, float], methods: Sequence[str]) -> None:
    """A vertical line per method, listed by value, with a marker at a staggered height so that equal amax stay
    visible. A method's colour and dash come from its place in ``methods`` (the report's methods, in one order),
    so it looks the same in every plot of the report."""
    order = {method: i for i, method in enumerate(dict.fromkeys([*methods, *amax]))}
    for rank, (method, value) in enumerate(sorted(amax.items(), key=lambda item: item[1])):
        i = order[method]
        color, style = _COLORS[(i + 1) % len(_COLORS)], _LINESTYLES[i % len(_LINESTYLES)]
        ax.axvline(value, color=color, linestyle=style, linewidth=1.5, label=f"{method}: {value:.4g}")
        height = 0.95 - 0.08 * (rank % 10)
        ax.plot([value], [height], marker="v", color=color, markersize=6, transform=ax.get_xaxis_transform())


def _save_figure(figure: Figure, path: Path, dpi: int) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return write_bytes_atomic(path, buffer.getvalue())


def write_plots(out: Path, data: ReportData, prefix: str, dpi: int) -> dict[str, str]:
    """Write every plot ``data`` has material for; returns plot key -> file name."""
    files: dict[str, str] = {}
    label = f"{data.model} — " if data.model else ""

    def save(key: str, filename: str, figure: Figure) -> None:
        _save_figure(figure, out / filename, dpi)
        files[key] = filename

    accuracy = accuracy_rows(data)
    if accuracy:
        save("accuracy", f"{prefix}accuracy.png",
             _accuracy_figure(accuracy, data.reference_score, data.metric, f"{label}accuracy"))  # fmt: skip
    if data.sensitivity is not None and data.sensitivity.layers:
        save("sensitivity", f"{prefix}sensitivity.png",
             _sensitivity_figure(data.sensitivity, data.metric, f"{label}per-layer sensitivity"))  # fmt: skip
    latency = latency_rows(data.latency)
    if latency:
        save("latency", f"{prefix}latency.png", _latency_figure(latency, f"{label}latency, FP32 vs INT8"))
    hists = histograms(data)
    methods = list(dict.fromkeys(method for hist in hists.values() for method in hist.amax))
    if data.calibration is not None:
        figure = _calibration_figure(data.calibration, hists, methods)
        if figure is not None:
            save("calibration", f"{prefix}calibration_worst.png", figure)
    slugs = unique_slugs(hists)
    for name, hist in hists.items():
        save(f"hist:{name}", f"{prefix}hist_{slugs[name]}.png", _histogram_figure(name, hist, methods))
    return files
