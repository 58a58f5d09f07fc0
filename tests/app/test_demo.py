"""The demo's table, legend and footnotes from run summaries, and its registry of model families (no training:
a registered family with a stand-in job shows how new rows join the table)."""

from __future__ import annotations

import json
import re

import pytest

from qdq.app.demo import (
    DEMO_MODELS,
    DemoModel,
    DemoRun,
    DemoSettings,
    Scheme,
    demo_legend,
    demo_table,
    register_demo_model,
    render,
    run_demo,
    with_models,
)
from qdq.errors import QdqConfigError


def _engine(accuracy=98.5, verdict="PASS", int8=10, floats=0, fallback=None, divergence=None, agreement=100.0):
    return {"accuracy": accuracy, "verdict": verdict, "top1_agreement": agreement, "min_agreement": 99.5,
            "max_error_steps": 0.5 if verdict == "PASS" else 40.2, "max_allowed_steps": 8.0, "samples": 1000,
            "int8_layers": int8, "float_layers": floats, "fallback": fallback, "divergence": divergence}  # fmt: skip


def _latency(runtime, speedups):
    rows = []
    for batch, (median, low, high) in speedups.items():
        rows.append({"runtime": runtime, "variant": "FP32", "batch": batch, "threads": 2, "median_ms": 1.0,
                     "speedup": 1.0})  # fmt: skip
        rows.append({"runtime": runtime, "variant": "INT8", "batch": batch, "threads": 2, "median_ms": 1.0 / median,
                     "speedup": median, "speedup_low": low, "speedup_high": high})  # fmt: skip
    return rows


def _summary(ort=(2.1, 1.9, 2.3), ov=(1.5, 1.4, 1.6), ort_engine=None, ov_engine=None, qat=98.75):
    accuracy = {"FP32": 98.9, "PTQ mse": 98.25}
    if qat is not None:
        accuracy["QAT"] = qat
    return {
        "accuracy": accuracy,
        "engines": {"onnxruntime": ort_engine or _engine(), "openvino": ov_engine or _engine()},
        "latency": _latency("onnxruntime", {1: (1.1, 1.0, 1.2), 8: ort}) + _latency("openvino", {8: ov}),
    }


def _cells(table: str, label: str) -> list[str]:
    model, scheme = label.split()
    line = next(line for line in table.splitlines() if re.match(rf"\| {model} +\| {scheme} +\|", line))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_every_speedup_cell_is_a_median_with_its_spread_and_accuracy_cells_name_the_method():
    table, footnotes = demo_table([DemoRun("digits_resnet", Scheme(8, 8), _summary(qat=None))], batch=8)
    header = [h.strip() for h in table.splitlines()[0].strip("|").split("|")]
    assert header == ["model", "scheme", "FP32", "PTQ (best)", "QAT", "INT8 onnxruntime", "INT8 openvino",
                      "speed-up onnxruntime (b8)", "speed-up openvino (b8)"]  # fmt: skip
    cells = _cells(table, "digits_resnet W8A8")
    assert cells[2:] == ["98.90", "98.25 (mse)", "—", "98.50", "98.50", "2.10x (1.90-2.30)", "1.50x (1.40-1.60)"]
    assert footnotes == []


def test_a_cell_with_float_layers_says_how_many_and_why():
    ort = _engine(int8=1, floats=9, fallback="ORT has no int4 conv")
    table, footnotes = demo_table([DemoRun("digits_resnet", Scheme(4, 4), _summary(ort=(0.07, 0.06, 0.08),
                                                                                      ort_engine=ort))])  # fmt: skip
    assert _cells(table, "digits_resnet W4A4")[7] == "0.07x (0.06-0.08): 9 of 10 layers float, ORT has no int4 conv"
    assert footnotes == []


def test_a_slow_cell_with_every_layer_in_int8_gets_a_footnote_with_what_was_measured():
    table, footnotes = demo_table([DemoRun("digits_mobilenet", Scheme(8, 8), _summary(ov=(0.9, 0.8, 1.0)))])
    assert _cells(table, "digits_mobilenet W8A8")[8] == "0.90x (0.80-1.00) [1]"
    assert len(footnotes) == 1 and footnotes[0].startswith("[1] digits_mobilenet W8A8 on openvino: every weighted")
    assert "0.90x FP32 at batch 8 (FP32 1.000 ms per batch, INT8 1.111 ms)" in footnotes[0]
    what = "elementwise layers run in float between the int8 ones"
    ov = {**_engine(), "float_between": 14, "float_between_what": what}
    run = DemoRun("digits_mobilenet", Scheme(4, 4), _summary(ov=(1.0, 0.95, 1.09), ov_engine=ov))
    _, footnotes = demo_table([run])
    assert footnotes[0].endswith(f"INT8 1.000 ms); openvino reports 14 {what} (the clamps of 4-bit activations).")


def test_a_failed_engine_is_flagged_with_where_it_departs():
    where = "openvino departs from PyTorch at blocks.1.block.0._input_quantizer: 21.9 % of its codes differ"
    ov = _engine(accuracy=96.4, verdict="FAIL", agreement=96.89, divergence=where)
    table, footnotes = demo_table([DemoRun("digits_mobilenet", Scheme(4, 4), _summary(ov_engine=ov))])
    assert _cells(table, "digits_mobilenet W4A4")[6] == "96.40 FAIL [1]"
    assert "agrees with the fake-quant model on 96.89 % of the test images (threshold 99.5 %)" in footnotes[0]
    assert "max error 40.2 output steps (threshold 8)" in footnotes[0] and where in footnotes[0]


def test_the_legend_states_metric_images_batch_threads_statistic_and_machine():
    runs = [DemoRun("digits_resnet", Scheme(8, 8), _summary())]
    machine = {"cpu": "Test CPU", "cores": 2, "threads": 2, "vnni": ["avx512_vnni"], "int8_saturates": False,
               "load_average": [0.5, 1.25]}  # fmt: skip
    legend = "\n".join(demo_legend(DemoSettings(), runs, machine, 123.4, {"keras_digits_resnet": "no TensorFlow"}))
    for fact in ("4,000 train / 1,000 test", "top-1 % on the 1,000 test images", "batch 8, 2 threads",
                 "median over 7 rounds of 20 runs", "25th-75th percentile", "FP32 and INT8 interleaved",
                 "Test CPU, 2 cores, VNNI (avx512_vnni)", "load average 0.5 before the run, 1.25 after",
                 "took 123 s", "keras_digits_resnet: not run (no TensorFlow)", "digits_resnet: ResNet-style",
                 "the best of 8 calibrations"):  # max, entropy, mse, the 4 default percentiles, auto
        assert fact in legend, fact
    no_vnni = {**machine, "vnni": [], "int8_saturates": True}
    assert "no VNNI" in "\n".join(demo_legend(DemoSettings(), runs, no_vnni, 1.0))


@pytest.fixture
def stand_in_family():
    """A model family registered for the test: trained to a constant, its job returns a fixed summary."""
    calls = []

    def train(settings, progress):
        calls.append(("train", progress))
        return "trained"

    def run(trained, cfg, progress):
        calls.append(("run", trained, cfg.scheme, progress))
        return _summary()

    family = register_demo_model(DemoModel("stand_in", "a stand-in family", train, run, schemes=("W8A8", "W4A4")))
    yield calls
    DEMO_MODELS.unregister(family.name)


def test_a_registered_family_joins_the_table_without_touching_it(stand_in_family, tmp_path):
    settings = with_models(DemoSettings(), ["stand_in"])
    summary = run_demo(tmp_path, settings=settings, progress=True)
    assert stand_in_family == [("train", "stand_in FP32"), ("run", "trained", "W8A8", "stand_in W8A8"),
                               ("run", "trained", "W4A4", "stand_in W4A4")]  # fmt: skip
    assert list(summary["runs"]) == ["stand_in W8A8", "stand_in W4A4"]
    assert _cells(summary["table"], "stand_in W4A4")[7] == "2.10x (1.90-2.30)"
    written = (tmp_path / "README.md").read_text()
    assert render(summary) in written and "stand_in: a stand-in family." in written
    assert json.loads((tmp_path / "summary.json").read_text())["table"] == summary["table"]


def test_unknown_models_and_a_missing_extra():
    with pytest.raises(QdqConfigError, match="Unknown demo model 'resnet'"):
        with_models(DemoSettings(), ["resnet"])
    assert list(DEMO_MODELS)[:3] == ["digits_resnet", "digits_mobilenet", "keras_digits_resnet"]
    reason = DEMO_MODELS.get("keras_digits_resnet").missing()
    assert reason is None or "tensorflow" in reason.lower()


@pytest.mark.parametrize("name", ["digits_vit", "digits_bert"])
def test_digit_transformers_are_optional_w8a8_rows_whose_qat_uses_their_recipe(monkeypatch, tmp_path, name):
    import torch

    from qdq.app import demo
    from qdq.app.digit_transformers import RECIPES

    family = DEMO_MODELS.get(name)
    assert not family.default and family.schemes == ("W8A8",)
    assert name not in [n for n, m in DEMO_MODELS.items() if m.default]
    seen = {}
    monkeypatch.setattr(demo, "run_pipeline", lambda cfg, model, progress: seen.update(cfg=cfg, model=model) or {})
    trained = torch.nn.Linear(2, 2)
    family.run(trained, DemoSettings().job(name, Scheme(8, 8), tmp_path), False)
    assert seen["cfg"].train_lr == RECIPES[name].lr and seen["cfg"].train_optimizer == "adamw"
    assert seen["model"] is not trained and torch.equal(seen["model"].weight, trained.weight)
