"""``qdq demo``: the whole recipe, offline, on scikit-learn's bundled digits, in a few minutes on 2 cores.

Two small CNNs are trained from scratch (a ResNet-style one and a MobileNet/EfficientNet-style one with
depthwise convolutions and SiLU), and where TensorFlow is installed the ResNet-style one written in Keras 3
(:mod:`qdq.app.keras_digits`), through the same job. Each goes through W8A8, W4A8 and W4A4 quantization
(W4A4 is the setting hard enough on this data for PTQ to lose accuracy and QAT to win it back): PTQ with
every calibrator (one pass), QAT with the seed's schedule, Q/DQ export, and the INT8 engines on ONNX Runtime
and OpenVINO. One table compares accuracy (FP32, PTQ, QAT, each engine) and latency; each run writes its
report.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qdq.app.keras_digits import KERAS_MODEL
from qdq.app.pipeline import PipelineConfig, run_pipeline
from qdq.atomic import write_text_atomic
from qdq.markdown import markdown_table

__all__ = ["DemoSettings", "run_demo"]

TRAIN_LR = 0.1
BATCH_SIZE = 32


@dataclass(frozen=True)
class DemoSettings:
    """Budget of the demo; ``quick()`` is a seconds-long smoke run of the same pipeline."""

    train_epochs: int = 6
    qat_epochs: int = 2
    calib_batches: int = 8
    bench_iters: int = 30
    eval_batches: int | None = None
    runtimes: tuple[str, ...] = ("onnxruntime", "openvino")
    models: tuple[str, ...] = ("digits_resnet", "digits_mobilenet", KERAS_MODEL)
    schemes: tuple[tuple[str, int, int], ...] = (("W8A8", 8, 8), ("W4A8", 4, 8), ("W4A4", 4, 4))

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(train_epochs=1, qat_epochs=1, calib_batches=2, bench_iters=3, eval_batches=2,
                   runtimes=("onnxruntime",), models=("digits_resnet",), schemes=(("W8A8", 8, 8),))  # fmt: skip


def _train(name: str, settings: DemoSettings, progress: bool) -> torch.nn.Module:
    from qdq.app.data import digits_datasets, make_loaders
    from qdq.app.models import load_model
    from qdq.app.train import train_classifier

    torch.manual_seed(0)
    train, test = digits_datasets(size=32)
    train_loader, _ = make_loaders(train, test, batch_size=BATCH_SIZE, seed=0)
    model = load_model(name)
    train_classifier(model, train_loader, settings.train_epochs, TRAIN_LR, progress=progress)
    return model.eval()


def run_demo(out: str | Path = "qdq-demo", quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train, quantize, export and deploy the two digits CNNs; return (and write) the summary."""
    settings = DemoSettings.quick() if quick else DemoSettings()
    out = Path(out)
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    for name in settings.models:
        if name == KERAS_MODEL:
            runs.update(_keras_runs(settings, out))
            continue
        model = _train(name, settings, progress)
        for scheme, weight_bits, activation_bits in settings.schemes:
            cfg = PipelineConfig(
                model=name, data="digits", out=str(out / name / scheme), calib="all",
                calib_batches=settings.calib_batches, qat_epochs=settings.qat_epochs, train_lr=TRAIN_LR,
                target="onnxruntime", runtimes=list(settings.runtimes), weight_bits=weight_bits,
                activation_bits=activation_bits, batch_size=BATCH_SIZE,
                bench_iters=settings.bench_iters, eval_batches=settings.eval_batches,
            )  # fmt: skip
            runs[f"{name} {scheme}"] = run_pipeline(cfg, copy.deepcopy(model), progress=progress)
    summary = {"seconds": round(time.perf_counter() - started, 1), "runs": runs, "table": demo_table(runs)}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    write_text_atomic(out / "README.md", "# qdq demo\n\n" + summary["table"] + "\n")
    return summary


def _keras_runs(settings: DemoSettings, out: Path) -> dict[str, Any]:
    """The Keras digits runs, or none (with a note) where TensorFlow is not installed."""
    from qdq.errors import QdqBackendUnavailable

    try:
        from qdq.keras._backend import keras

        keras()
    except QdqBackendUnavailable as err:
        print(f"qdq demo: skipping the Keras run ({err})")
        return {}
    from qdq.app.keras_digits import keras_demo_runs

    return keras_demo_runs(settings, out, TRAIN_LR, BATCH_SIZE)


def demo_table(runs: dict[str, Any]) -> str:
    """One markdown table: accuracy of every stage and engine, and INT8 speed-up per runtime (batch 8)."""
    header = ["run", "FP32", "PTQ (best)", "QAT"]
    runtimes = sorted({r for run in runs.values() for r in run.get("engines", {})})
    header += [f"INT8 {r}" for r in runtimes] + [f"speed-up {r}" for r in runtimes]
    rows = []
    for label, run in runs.items():
        acc = run["accuracy"]
        ptq = next((v for k, v in acc.items() if k.startswith("PTQ")), None)
        cells = [label, _pct(acc.get("FP32")), _pct(ptq), _pct(acc.get("QAT"))]
        cells += [_pct(run["engines"][r]["accuracy"]) if r in run["engines"] else "" for r in runtimes]
        cells += [_speedup(run["latency"], r) for r in runtimes]
        rows.append(cells)
    return markdown_table(header, rows)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _speedup(latency: list[dict[str, Any]], runtime: str) -> str:
    rows = [r for r in latency if r["runtime"] == runtime]
    if not rows:
        return ""
    batch = max(r["batch"] for r in rows)
    times = {r["variant"]: r["median_ms"] for r in rows if r["batch"] == batch}
    if "FP32" not in times or "INT8" not in times:
        return ""
    return f"{times['FP32'] / times['INT8']:.2f}x (b{batch})"
