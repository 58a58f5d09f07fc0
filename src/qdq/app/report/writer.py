""":func:`write_report`: one or several models' reports into one folder, every file written atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from qdq.app.report.document import Block, Heading, section_blocks
from qdq.app.report.filenames import plot_prefixes
from qdq.app.report.html_page import to_html
from qdq.app.report.inputs import ReportData, histograms, latency_rows
from qdq.app.report.md_page import to_markdown
from qdq.app.report.plots import write_plots
from qdq.app.report.summary import SCHEMA_VERSION, jsonable, model_summary
from qdq.atomic import write_bytes_atomic
from qdq.errors import QdqConfigError

__all__ = ["write_report"]


def write_report(
    out_dir: str | os.PathLike[str],
    data: ReportData | Sequence[ReportData],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> dict[str, Path]:
    """Write the report of one model, or of several side by side, into ``out_dir`` (created if needed).

    Files: the plots (PNG, ``dpi`` dots per inch), ``report.md``, ``report.html`` and ``summary.json``
    (written last). With several models, plot names get a ``<model>_`` prefix and each model gets a
    section. Bad input (a latency row without its keys, a histogram with the wrong number of edges)
    raises before anything is written.

    Returns:
        file name (relative to ``out_dir``) -> path, for every file written.

    Raises:
        QdqConfigError: no ``ReportData``, or a malformed part of one.
    """
    reports = [data] if isinstance(data, ReportData) else list(data)
    if not reports:
        raise QdqConfigError("write_report needs at least one ReportData.")
    for report in reports:
        latency_rows(report.latency)
        histograms(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or reports[0].title
    blocks: list[Block] = []
    models, written = [], {}
    for report, prefix in zip(reports, plot_prefixes([r.model for r in reports])):
        plots = write_plots(out, report, prefix, dpi)
        written.update({name: out / name for name in plots.values()})
        if len(reports) > 1:
            blocks.append(Heading(2, report.model))
        blocks += section_blocks(report, plots, 3 if len(reports) > 1 else 2)
        models.append(model_summary(report, plots))
    summary = {"schema_version": SCHEMA_VERSION, "title": title, "models": models,
               "files": sorted([*written, "report.md", "report.html"])}  # fmt: skip
    for name, text in (("report.md", to_markdown(title, blocks)), ("report.html", to_html(title, blocks))):
        written[name] = write_bytes_atomic(out / name, text.encode("utf-8"))
    payload = json.dumps(jsonable(summary), indent=2, allow_nan=False) + "\n"
    written["summary.json"] = write_bytes_atomic(out / "summary.json", payload.encode("utf-8"))
    return written
