"""The content of a report page, independent of its format: a list of blocks per model.

:func:`section_blocks` turns one :class:`~qdq.app.report.inputs.ReportData` into headings, paragraphs,
lists, tables (cells already formatted as text) and images; :mod:`~qdq.app.report.md_page` and
:mod:`~qdq.app.report.html_page` render the same blocks, so both pages always say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qdq.app.report.inputs import ReportData, accuracy_rows, histograms, latency_rows, qat_dict

__all__ = ["Block", "BulletList", "Heading", "Image", "Paragraph", "Table", "section_blocks"]


@dataclass
class Heading:
    """A section title; ``level`` 2 for a model, 3 for its parts when several models share a page."""

    level: int
    text: str


@dataclass
class Paragraph:
    """Plain text (escaped by the renderers)."""

    text: str


@dataclass
class BulletList:
    """An unordered list of plain-text items."""

    items: list[str]


@dataclass
class Table:
    """A table of text cells, one list per row, as many cells as ``headers``."""

    headers: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    """A plot, by file name relative to the page; ``alt`` is also its caption."""

    src: str
    alt: str


Block = Heading | Paragraph | BulletList | Table | Image


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return ""
    if isinstance(value, float | int | np.floating | np.integer) and not isinstance(value, bool):
        number = float(value)
        return "" if math.isnan(number) else format(number, spec)
    return str(value)


def section_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    """The blocks of one model's report; ``level`` is the heading level of its parts."""
    blocks: list[Block] = []
    facts = [f"Model: {data.model}"] + ([f"dataset: {data.dataset}"] if data.dataset else [])
    blocks.append(Paragraph(", ".join(facts) + "."))
    if data.notes:
        blocks.append(BulletList([str(n) for n in data.notes]))
    blocks += _accuracy_blocks(data, plots, level)
    blocks += _ptq_blocks(data, level)
    blocks += _calibration_blocks(data, plots, level)
    blocks += _qat_blocks(data, level)
    blocks += _sensitivity_blocks(data, plots, level)
    blocks += _latency_blocks(data, plots, level)
    blocks += _histogram_blocks(data, plots, level)
    return blocks


def _accuracy_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    rows = accuracy_rows(data)
    if not rows:
        return []
    reference = data.reference_score
    table = Table(["configuration", data.metric, "vs FP32"],
                   [[name, _fmt(v), "" if reference is None else _fmt(v - reference, "+.2f")]
                    for name, v in rows.items()])  # fmt: skip
    return [Heading(level, "Accuracy"), table, *_image(plots, "accuracy", "accuracy per configuration")]


def _ptq_blocks(data: ReportData, level: int) -> list[Block]:
    ptq = data.ptq
    if ptq is None:
        return []
    clipping = any(r.diagnostics is not None for r in ptq.results)  # the column only with diagnostics
    rows = [["float (no quantization)", _fmt(ptq.float_score), "", *([""] if clipping else [])]]
    rows += [[r.label + (" (best)" if r is ptq.best else ""), _fmt(r.score), _fmt(r.score - ptq.float_score, "+.2f"),
              *([r.worst_clipping] if clipping else [])] for r in ptq.results]  # fmt: skip
    headers = ["calibration", data.metric, "vs float", *(["largest clipping error"] if clipping else [])]
    return [Heading(level, "Post-training quantization (calibration methods)"), Table(headers, rows)]


def _calibration_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    report = data.calibration
    if report is None or not report.quantizers:
        return []
    flagged = report.flagged()
    methods = list(dict.fromkeys(d.method or "?" for d in report.quantizers))
    text = (f"{len(report.quantizers)} activation quantizers, ranges set by {', '.join(methods)}; "
            f"{len(flagged)} clip away {100 * report.limit:g} % or more of their activation's energy"
            + (f": {', '.join(d.name for d in flagged)}." if flagged else "."))  # fmt: skip
    caption = "the quantizers with the largest clipping error: histogram and ranges"
    return [Heading(level, "Calibration diagnostics"), Paragraph(text), Table(list(report.headers), report.rows()),
            Paragraph(report.legend), *_image(plots, "calibration", caption)]  # fmt: skip


def _qat_blocks(data: ReportData, level: int) -> list[Block]:
    qat = qat_dict(data.qat)
    if qat is None or not qat["epochs"]:
        return []
    keys = list(dict.fromkeys(k for epoch in qat["epochs"] for k in epoch))
    specs = {"epoch": ".0f", "loss": ".4f", "lr": ".3g"}
    rows = [[_fmt(e.get(k), specs.get(k, ".2f")) for k in keys] for e in qat["epochs"]]
    blocks: list[Block] = [Heading(level, "Quantization-aware training"), Table(keys, rows)]
    if qat["final_score"] is not None:
        blocks.append(Paragraph(f"Final {data.metric}: {_fmt(qat['final_score'])}."))
    return blocks


def _sensitivity_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    result = data.sensitivity
    if result is None or not result.layers:
        return []
    text = f"Float {_fmt(result.float_score)}, fully quantized {_fmt(result.quantized_score)}."
    rows = [[s.name, _fmt(s.only_this_quantized), _fmt(s.all_but_this_quantized)] for s in result.layers]
    return [Heading(level, "Per-layer sensitivity"), Paragraph(text),
            Table(["layer", "only this quantized", "all but this quantized"], rows),
            *_image(plots, "sensitivity", "per-layer sensitivity")]  # fmt: skip


def _latency_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    rows = latency_rows(data.latency)
    if not rows:
        return []
    headers = ["runtime", "variant", "batch", "threads", "median (ms)", "speed-up vs FP32"]
    table = [[str(r["runtime"]), str(r["variant"]), str(r["batch"]), "default" if r["threads"] is None
              else str(r["threads"]), _fmt(r["median_ms"], ".3f"), _speedup_cell(r)] for r in rows]  # fmt: skip
    blocks: list[Block] = [Heading(level, "Latency"), Table(headers, table)]
    if any(r.get("rounds") for r in rows):
        first = next(r for r in rows if r.get("rounds"))
        blocks.append(Paragraph(
            f"FP32 and INT8 timed in {first['rounds']} interleaved rounds of {first.get('iters', '?')} runs each; "
            "median (ms) is the median of the rounds' medians, per inference of the batch; speed-up is the median "
            "of the rounds' FP32/INT8 ratios, 25th-75th percentile in brackets (> 1: INT8 faster)."))  # fmt: skip
    return [*blocks, *_image(plots, "latency", "latency FP32 vs INT8")]


def _speedup_cell(row: Mapping[str, Any]) -> str:
    if row["speedup"] is None:
        return ""
    if row.get("speedup_low") is None or row.get("speedup_high") is None:
        return f"×{row['speedup']:.2f}"
    return f"×{row['speedup']:.2f} ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"


def _histogram_blocks(data: ReportData, plots: Mapping[str, str], level: int) -> list[Block]:
    hists = histograms(data)
    if not hists:
        return []
    methods = list(dict.fromkeys(m for h in hists.values() for m in h.amax))
    blocks: list[Block] = [Heading(level, "Activation histograms and amax per method")]
    if methods:
        rows = [[name, *(_fmt(h.amax.get(m), ".4g") for m in methods)] for name, h in hists.items()]
        blocks.append(Table(["quantizer", *methods], rows))
    for name in hists:
        blocks += _image(plots, f"hist:{name}", f"activation histogram of {name}")
    return blocks


def _image(plots: Mapping[str, str], key: str, alt: str) -> list[Block]:
    return [Image(plots[key], alt)] if key in plots else []
