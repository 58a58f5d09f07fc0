"""Report writer: every file written, valid PNGs, summary.json round trip, Markdown/HTML content and escaping."""

from __future__ import annotations

import json
import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from qdq.app.report import (
    LayerHistogram,
    ReportData,
    collect_histograms,
    latency_row,
    read_histogram,
    write_report,
)
from qdq.calib import HistogramCalibrator
from qdq.errors import QdqConfigError
from qdq.runtime.base import BenchmarkResult
from qdq.workflow.diagnostics import calibration_report
from qdq.workflow.post_training import MethodResult, PTQResult, ptq
from qdq.workflow.sensitivity_analysis import LayerSensitivity, SensitivityResult

LAYER = "features.conv1._input_quantizer"


def _calibrator() -> HistogramCalibrator:
    """A real calibrator with known data: 0..99 in [0, 128) over 64 bins of width 2 (two values per bin)."""
    cal = HistogramCalibrator(num_bins=64, start_bin=8)
    cal.collect(torch.arange(100.0))
    return cal


def _ptq_result() -> PTQResult:
    weight = torch.tensor([[1.0], [2.0]])  # per channel: left out of summary.json's scalar amax
    results = [
        MethodResult("max", {}, 97.25, {LAYER: torch.tensor(99.0), "features.conv1._weight_quantizer": weight}),
        MethodResult("entropy", {}, 98.0, {LAYER: torch.tensor(61.5), "features.conv1._weight_quantizer": weight}),
        MethodResult("percentile", {"percentile": 99.9}, 98.5, {LAYER: torch.tensor(90.0)}),
    ]
    return PTQResult(98.75, results, results[2])


def _data() -> ReportData:
    counts, edges = read_histogram(_calibrator())
    cal = _calibrator()
    amax = {m: float(cal.compute_amax(m)) for m in ("max", "entropy", "mse")}
    amax["percentile 99"] = float(cal.compute_amax("percentile", percentile=99))
    bench = BenchmarkResult.from_times(
        [3.0, 2.0, 4.0], label="int8", backend="openvino", precision="int8", batch=8, threads=2, warmup=1
    )
    return ReportData(
        title="Digits report",
        model="resnet-digits",
        dataset="digits",
        accuracy={"FP32": 98.75, "PTQ percentile 99.9": 98.5, "QAT": 98.625, "ORT INT8": 98.5},
        ptq=_ptq_result(),
        qat={
            "epochs": [
                {"epoch": 1, "loss": 0.3125, "lr": 1e-4, "score": 98.25},
                {"epoch": 2, "loss": 0.25, "lr": 1e-6, "score": 98.625},
            ]
        },
        sensitivity=SensitivityResult(
            98.75, 97.25, [LayerSensitivity("features.conv1", 97.5, 98.5), LayerSensitivity("classifier", 98.0, 97.75)]
        ),
        latency=[
            {"runtime": "onnxruntime", "variant": "FP32", "batch": 1, "threads": 2, "min_ms": 1.5, "median_ms": 2.0},
            {"runtime": "onnxruntime", "variant": "INT8", "batch": 1, "threads": 2, "min_ms": 0.75, "median_ms": 0.8},
            {"runtime": "openvino", "variant": "FP32", "batch": 8, "threads": 2, "min_ms": 5.0, "median_ms": 6.0},
            bench,
            {"runtime": "onnxruntime", "variant": "FP32", "batch": 8, "threads": 2, "median_ms": 2.0},
            {"runtime": "onnxruntime", "variant": "INT8", "batch": 8, "threads": 2, "median_ms": 1.0, "speedup": 2.1,
             "speedup_low": 1.9, "speedup_high": 2.3, "rounds": 7, "iters": 20},
        ],
        histograms={LAYER: LayerHistogram(counts, edges, amax)},
        notes=["calibrated on 512 images <b>bold?</b> & more"],
        extra={"seed": 0, "numpy": np.float32(0.5), "nan": float("nan"), "tensor": torch.tensor([1.0, 2.0])},
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    out = tmp_path_factory.mktemp("report")
    return out, write_report(out, _data())


def _summary(out: Path) -> dict:
    def reject(constant: str) -> None:
        raise AssertionError(f"summary.json holds {constant}")

    return json.loads((out / "summary.json").read_text(encoding="utf-8"), parse_constant=reject)


class _HtmlChecker(HTMLParser):
    """Records tags, img sources, text; flags end tags that do not close the innermost open element."""

    VOID = frozenset({"meta", "img", "br", "hr", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: Counter[str] = Counter()
        self.images: list[str] = []
        self.text: list[str] = []
        self.doctype = ""

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse_html(path: Path) -> _HtmlChecker:
    checker = _HtmlChecker()
    checker.feed(path.read_text(encoding="utf-8"))
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    return checker


def _assert_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert 200 <= image.shape[0] <= 2000 and 300 <= image.shape[1] <= 2500, image.shape
    assert float(image[..., :3].std()) > 0.01  # not blank
    return image


# --- histograms from calibrators -------------------------------------------------------------------------


def test_read_histogram_of_a_real_calibrator():
    counts, edges = read_histogram(_calibrator())
    assert counts.shape == (64,) and edges.shape == (65,)
    assert edges[0] == 0 and edges[1] == 2 and edges[-1] == 128
    assert counts.sum() == 100 and list(counts[:50]) == [2] * 50 and counts[50:].sum() == 0
    assert read_histogram(HistogramCalibrator()) is None  # nothing collected


def test_read_histogram_sums_channels_exactly_at_the_widest_width():
    cal = HistogramCalibrator(axis=0, num_bins=64)
    small, large = torch.arange(100.0) / 128, torch.arange(100.0)  # ranges 1 and 128
    cal.collect(torch.stack([small, large]))
    counts, edges = read_histogram(cal)
    assert edges[1] == 2 and edges[-1] == 128
    expected, _ = np.histogram(np.concatenate([small.numpy(), large.numpy()]), bins=edges)
    assert np.array_equal(counts, expected) and counts[0] == 102


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 3),
    )
    return qdq.quantize_model(net)


def test_collect_histograms_after_ptq_holds_each_methods_amax():
    model = _tiny_model()
    scores = iter(range(100))
    result = ptq(model, [torch.randn(8, 1, 4, 4) for _ in range(3)], lambda m: float(next(scores)), progress=False)
    every = collect_histograms(model, result, max_layers=None)
    assert len(every) == 3 and all(name.endswith("input_quantizer") for name in every)
    for name, (counts, edges, amax) in every.items():
        assert counts.sum() > 0 and edges.size == counts.size + 1
        assert amax == {r.label: pytest.approx(float(r.amax[name])) for r in result.results}
        assert edges[-1] >= amax["max"]
    names = list(every)
    assert list(collect_histograms(model, result, max_layers=2)) == [names[0], names[-1]]
    assert collect_histograms(model)[names[0]].amax == {}  # without a PTQ result: histograms only


def test_calibration_section_tables_and_plots_the_worst_quantizers(tmp_path):
    """After an entropy calibration that cuts a sparse tail: the section's table (every quantizer, its method,
    PASS/FAIL), the legend, the plot of the worst quantizers, and summary.json's record."""
    model = _tiny_model()
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(16, 1, 4, 4, generator=gen).clamp(min=0) ** 6 for _ in range(3)]  # sparse heavy tail
    scores = iter([90.0, 10.0, 50.0])  # float, entropy, max: max is kept
    with pytest.warns(qdq.QdqCalibrationWarning):
        result = ptq(model, data, lambda m: next(scores), ("entropy",), progress=False)
    report = calibration_report(model)
    assert report.flagged()
    worst = [d.name for d in report.worst(4)]
    data = ReportData(model="tail", ptq=result, calibration=report, histograms=collect_histograms(model, include=worst))
    files = write_report(tmp_path, data, dpi=60)
    assert "calibration_worst.png" in files
    _assert_png(tmp_path / "calibration_worst.png")
    text = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Calibration diagnostics" in text and "clipping error" in text and "](calibration_worst.png)" in text
    worst_row = report.worst(1)[0]
    ptq_row = next(r for r in _table_rows(text) if r[0] == "entropy (best)")
    assert ptq_row[3] == f"{100 * worst_row.clipping_error:.2f} % ({worst_row.name})".replace("_", "\\_")
    rows = {r[0].replace("\\", ""): r for r in _table_rows(text) if r[0].endswith("_quantizer")}
    assert set(rows) == {d.name for d in report.quantizers}
    for d in report.quantizers:
        assert rows[d.name][1] == "entropy" and rows[d.name][-1] == ("FAIL" if d in report.flagged() else "PASS")
    (summary,) = _summary(tmp_path)["models"]
    assert summary["calibration"]["flagged"] == [d.name for d in report.flagged()]
    assert summary["calibration"]["quantizers"][0]["method"] == "entropy"
    assert summary["ptq"]["largest_clipping_error"] == {"entropy": worst_row.clipping_error}


# --- write_report ----------------------------------------------------------------------------------------


def test_every_file_is_written_and_pngs_are_valid_images(report):
    out, files = report
    names = {
        "report.md",
        "report.html",
        "summary.json",
        "accuracy.png",
        "sensitivity.png",
        "latency.png",
        f"hist_{LAYER}.png",
    }
    assert set(files) == names
    assert all(path == out / name and path.is_file() for name, path in files.items())
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary files left behind
    for name in names:
        if name.endswith(".png"):
            _assert_png(out / name)


def test_summary_json_round_trips_the_numbers(report):
    out, _ = report
    summary = _summary(out)
    assert summary["schema_version"] == 1 and summary["title"] == "Digits report"
    assert all((out / name).is_file() for name in summary["files"])
    (model,) = summary["models"]
    assert model["model"] == "resnet-digits" and model["dataset"] == "digits" and model["float_score"] == 98.75
    assert model["accuracy"] == {"FP32": 98.75, "PTQ percentile 99.9": 98.5, "QAT": 98.625, "ORT INT8": 98.5}
    assert model["ptq"]["methods"] == {"max": 97.25, "entropy": 98.0, "percentile 99.9": 98.5}
    assert model["ptq"]["best"] == "percentile 99.9"
    assert model["ptq"]["options"]["percentile 99.9"] == {"method": "percentile", "percentile": 99.9}
    assert model["ptq"]["scalar_amax"]["entropy"] == {LAYER: 61.5}  # the per-channel weight amax left out
    assert model["qat"]["final_score"] == 98.625 and model["qat"]["epochs"][0]["loss"] == 0.3125
    assert model["sensitivity"]["layers"][1] == {
        "name": "classifier",
        "only_this_quantized": 98.0,
        "all_but_this_quantized": 97.75,
    }
    latency = {(r["runtime"], r["variant"], r["batch"]): r for r in model["latency"]}
    assert latency["onnxruntime", "INT8", 1]["speedup"] == pytest.approx(2.5)
    assert latency["openvino", "INT8", 8]["median_ms"] == 3.0 and latency["openvino", "INT8", 8]["speedup"] == 2.0
    assert latency["openvino", "INT8", 8]["p90_ms"] == pytest.approx(3.8)
    interleaved = latency["onnxruntime", "INT8", 8]  # its own speed-up, measured interleaved, is kept
    assert (interleaved["speedup"], interleaved["speedup_low"], interleaved["speedup_high"]) == (2.1, 1.9, 2.3)
    hist = model["histograms"][LAYER]
    assert hist["amax"]["max"] == 99.0 and hist["bins"] == 64 and hist["range"] == [0.0, 128.0]
    assert hist["total"] == 100 and hist["plot"] == f"hist_{LAYER}.png"
    assert model["plots"] == {"accuracy": "accuracy.png", "sensitivity": "sensitivity.png", "latency": "latency.png"}
    assert model["extra"] == {"seed": 0, "numpy": 0.5, "nan": None, "tensor": [1.0, 2.0]}
    assert model["notes"] == ["calibrated on 512 images <b>bold?</b> & more"]


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row in ``text`` (split on unescaped pipes, padding stripped)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_markdown_holds_the_tables_with_the_numbers(report):
    out, _ = report
    text = (out / "report.md").read_text(encoding="utf-8")
    assert text.startswith("# Digits report\n")
    rows = _table_rows(text)
    for row in (
        ["FP32", "98.75", "+0.00"],
        ["ORT INT8", "98.50", "-0.25"],
        ["percentile 99.9 (best)", "98.50", "-0.25"],
        ["2", "0.2500", "1e-06", "98.62"],
        ["features.conv1", "97.50", "98.50"],
        ["onnxruntime", "INT8", "1", "2", "0.800", "×2.50"],
        ["openvino", "INT8", "8", "2", "3.000", "×2.00"],
        ["onnxruntime", "INT8", "8", "2", "1.000", "×2.10 (1.90-2.30)"],
    ):
        assert row in rows, row
    amax_row = next(r for r in rows if r[0] == r"features.conv1.\_input\_quantizer")
    assert amax_row[1] == "99"  # the max of the collected data (first method column)
    for image in ("accuracy.png", "sensitivity.png", "latency.png", f"hist_{LAYER}.png"):
        assert f"]({image})" in text
    assert r"\<b\>bold?\</b\> & more" in text  # no raw HTML from a note


def test_html_is_valid_escaped_and_every_image_exists(report):
    out, files = report
    page = _parse_html(out / "report.html")
    assert page.doctype.lower() == "doctype html"
    assert page.tags["table"] == 6  # accuracy, PTQ, QAT, sensitivity, latency, amax
    assert sorted(page.images) == sorted(name for name in files if name.endswith(".png"))
    assert all((out / src).is_file() for src in page.images)
    assert page.tags["b"] == 0 and "calibrated on 512 images <b>bold?</b> & more" in "".join(page.text)


def test_missing_parts_are_left_out(tmp_path):
    files = write_report(tmp_path, ReportData(model="m", accuracy={"FP32": 99.0, "INT8": 98.5}), dpi=60)
    assert set(files) == {"accuracy.png", "report.md", "report.html", "summary.json"}
    text = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "Accuracy" in text and "Latency" not in text and "sensitivity" not in text.lower()
    (model,) = _summary(tmp_path)["models"]
    assert model["float_score"] == 99.0
    assert (model["ptq"], model["qat"], model["sensitivity"], model["latency"], model["histograms"]) == (
        None,
        None,
        None,
        [],
        {},
    )
    assert _parse_html(tmp_path / "report.html").images == ["accuracy.png"]
    bare = write_report(tmp_path / "bare", ReportData(model="nothing"))
    assert set(bare) == {"report.md", "report.html", "summary.json"}


def test_accuracy_defaults_to_ptq_and_qat_scores(tmp_path):
    write_report(tmp_path, ReportData(ptq=_ptq_result(), qat={"epochs": [{"epoch": 1, "loss": 0.1, "score": 99.0}]}))
    (model,) = _summary(tmp_path)["models"]
    assert model["accuracy"] == {
        "FP32": 98.75,
        "PTQ max": 97.25,
        "PTQ entropy": 98.0,
        "PTQ percentile 99.9": 98.5,
        "QAT": 99.0,
    }


def test_layer_names_are_sanitised_in_file_names_and_escaped_in_text(tmp_path):
    counts, edges = np.array([5, 0, 1]), np.array([0.0, 1.0, 2.0, 3.0])
    names = ["blocks/0:conv<1>.in", "../../evil", "a/b", "a_b", "A_B", "x" * 300, "<script>alert(1)</script>"]
    data = ReportData(histograms={n: (counts, edges, {"max": 2.5}) for n in names})
    files = write_report(tmp_path, data, dpi=50)
    plots = [name for name in files if name.startswith("hist_")]
    assert len(plots) == len(names) and len({p.lower() for p in plots}) == len(names)
    for name in plots:
        assert re.fullmatch(r"hist_[A-Za-z0-9][A-Za-z0-9._-]*\.png", name) and len(name) < 120, name
        assert files[name].parent == tmp_path and files[name].is_file()
    assert sorted(p.name for p in tmp_path.parent.iterdir() if "evil" in p.name) == []
    html_text = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in html_text and "&lt;script&gt;alert(1)&lt;/script&gt;" in html_text
    page = _parse_html(tmp_path / "report.html")
    assert page.tags["script"] == 0 and all((tmp_path / src).is_file() for src in page.images)
    assert r"blocks/0:conv\<1\>.in" in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert set(_summary(tmp_path)["models"][0]["histograms"]) == set(names)


def test_several_models_get_prefixed_plots_and_one_section_each(tmp_path):
    reports = [ReportData(model=name, accuracy={"FP32": 99.0, "INT8": 98.0}) for name in ("resnet", "mobile net")]
    reports.append(ReportData(model="resnet", accuracy={"FP32": 97.0}))
    files = write_report(tmp_path, reports, title="Both", dpi=50)
    assert {n for n in files if n.endswith(".png")} == {
        "resnet-1_accuracy.png",
        "mobile_net_accuracy.png",
        "resnet-3_accuracy.png",
    }
    summary = _summary(tmp_path)
    assert summary["title"] == "Both" and [m["model"] for m in summary["models"]] == ["resnet", "mobile net", "resnet"]
    assert "## mobile net\n" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_rewriting_replaces_files_and_leaves_no_temporary_files(tmp_path):
    write_report(tmp_path, ReportData(accuracy={"FP32": 1.0}), dpi=50)
    write_report(tmp_path, ReportData(accuracy={"FP32": 2.0}), dpi=50)
    assert _summary(tmp_path)["models"][0]["accuracy"] == {"FP32": 2.0}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latency_row_from_a_benchmark_and_bad_inputs(tmp_path):
    bench = BenchmarkResult.from_times(
        [1.0, 3.0], label="fp32", backend="onnxruntime", precision="fp32", batch=4, threads=None, warmup=0
    )
    row = latency_row(bench)
    assert row["variant"] == "FP32" and row["runtime"] == "onnxruntime" and row["median_ms"] == 2.0
    assert latency_row(bench, "INT8 QAT")["variant"] == "INT8 QAT"
    with pytest.raises(QdqConfigError, match="median_ms"):
        write_report(tmp_path / "out", ReportData(latency=[{"runtime": "ort", "variant": "INT8", "batch": 1}]))
    with pytest.raises(QdqConfigError, match="edges"):
        write_report(tmp_path / "out", ReportData(histograms={"x": (np.ones(3), np.arange(3.0), {})}))
    with pytest.raises(QdqConfigError):
        write_report(tmp_path / "out", [])
    assert not (tmp_path / "out").exists()  # nothing written for bad input


def test_plotted_histograms_merge_groups_of_neighbouring_bins():
    """1000 bins shown as at most 256 bars: groups of 4 (the smallest power of two that fits), summed."""
    from qdq.app.report.plots import _display_bins

    counts, edges = np.arange(1000, dtype=np.float64), np.arange(1001) * 0.5
    shown, shown_edges = _display_bins(LayerHistogram(counts, edges, {"max": 499.75}), max_bins=256)
    assert shown.shape == (250,) and shown_edges.shape == (251,)
    np.testing.assert_array_equal(shown, counts.reshape(250, 4).sum(axis=1))
    assert shown_edges[1] == 2.0 and shown_edges[-1] == 500.0


def test_a_method_has_one_line_style_in_every_plot_whatever_the_order_of_its_range():
    """Two histograms whose methods' ranges sort differently: each method's line keeps its colour and dash."""
    from matplotlib.figure import Figure

    from qdq.app.report.plots import _draw_histogram

    counts, edges = np.ones(8), np.arange(9.0)
    first = LayerHistogram(counts, edges, {"max": 8.0, "entropy": 2.0, "mse": 5.0})
    second = LayerHistogram(counts, edges, {"max": 8.0, "entropy": 6.0, "mse": 3.0})
    methods = ["max", "entropy", "mse"]
    styles = []
    for hist in (first, second):
        ax = Figure().add_subplot()
        _draw_histogram(ax, hist, methods)
        lines = {line.get_label().split(":")[0]: (line.get_color(), line.get_linestyle()) for line in ax.get_lines()
                 if not line.get_label().startswith("_")}  # fmt: skip
        styles.append(lines)
        # the legend lists them by value
        labels = [text.split(":")[0] for text in ax.get_legend_handles_labels()[1]]
        assert labels == sorted(hist.amax, key=hist.amax.get)
    assert styles[0] == styles[1]
    assert len(set(styles[0].values())) == 3
