"""The digits demo's Keras 3 run: the ResNet-style digits CNN written in Keras, through the same job as the
PyTorch runs (FP32, PTQ with every calibrator from one pass, QAT with the seed's schedule, Q/DQ export for the
target, INT8 engines on each runtime with accuracy, fidelity and latency, report), giving the same summary:
one more row of the demo table.

The data are the PyTorch runs' (:func:`qdq.app.data.digits_datasets`: the same split and normalisation), in
Keras's layout (NHWC). Needs the ``tf`` extra; TensorFlow is imported when a function here is called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from qdq.app.pipeline import PipelineConfig, measure_engines
from qdq.atomic import write_text_atomic
from qdq.calib.registry import CALIBRATION_METHODS

__all__ = ["KERAS_MODEL", "digits_arrays", "keras_demo_runs", "keras_digits_resnet", "run_keras_job", "train_keras"]

#: the name of the Keras digits model in configs and tables
KERAS_MODEL = "keras_digits_resnet"


def digits_arrays(size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: the digits of the PyTorch runs as NHWC float32 / int64 arrays."""
    from qdq.app.data import digits_datasets

    def arrays(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
        images = np.stack([np.asarray(dataset[i][0]) for i in range(len(dataset))])
        labels = np.asarray([dataset[i][1] for i in range(len(dataset))], np.int64)
        return np.ascontiguousarray(images.transpose(0, 2, 3, 1), np.float32), labels

    train, test = digits_datasets(size=size, seed=seed)
    return (*arrays(train), *arrays(test))


def keras_digits_resnet(num_classes: int = 10, size: int = 32) -> Any:
    """The Keras twin of :func:`qdq.app.models.digits_resnet`: stem 3x3 conv stride 2 (16 ch) - BN - ReLU,
    basic blocks 16 @16², 32 @8², 64 @4² (1x1 conv shortcut where the shape changes), global average pool,
    Dense. Input ``(size, size, 3)``, NHWC."""
    from qdq.keras._backend import keras

    layers = keras().layers

    def conv_bn(x: Any, width: int, kernel: int, stride: int, name: str) -> Any:
        x = layers.Conv2D(width, kernel, stride, padding="same", use_bias=False, name=f"{name}_conv")(x)
        return layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)  # PyTorch's default (0.1) in Keras

    inputs = keras().Input((size, size, 3), name="image")
    x = layers.ReLU(name="stem_relu")(conv_bn(inputs, 16, 3, 2, "stem"))
    width = 16
    for i, out in enumerate((16, 32, 64)):
        stride = 1 if out == width else 2
        y = layers.ReLU(name=f"block{i}_relu1")(conv_bn(x, out, 3, stride, f"block{i}_1"))
        y = conv_bn(y, out, 3, 1, f"block{i}_2")
        shortcut = x if stride == 1 else conv_bn(x, out, 1, stride, f"block{i}_down")
        x = layers.ReLU(name=f"block{i}_relu2")(layers.Add(name=f"block{i}_add")([y, shortcut]))
        width = out
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, name="fc")(x)
    return keras().Model(inputs, outputs, name=KERAS_MODEL)


def train_keras(model: Any, x: np.ndarray, y: np.ndarray, epochs: int, lr: float, *, batch_size: int = 32,
                seed: int = 0) -> Any:  # fmt: skip
    """Train ``model`` with the PyTorch runs' recipe: SGD (momentum 0.9, weight decay 5e-4), linear warm-up
    over 10 % of the steps, then cosine to 0, cross-entropy on logits."""
    from qdq.keras._backend import keras

    k = keras()
    k.utils.set_random_seed(seed)
    steps = epochs * int(np.ceil(len(x) / batch_size))
    warmup = max(1, steps // 10)
    schedule = k.optimizers.schedules.CosineDecay(0.0, steps - warmup, warmup_target=lr, warmup_steps=warmup)
    model.compile(k.optimizers.SGD(schedule, momentum=0.9, weight_decay=5e-4),
                  k.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
    return model


def _accuracy(predict: Any, x: np.ndarray, y: np.ndarray, batch_size: int) -> float:
    """Top-1 accuracy in percent of ``predict(batch) -> logits`` over ``x`` / ``y``."""
    correct = 0
    for start in range(0, len(x), batch_size):
        logits = np.asarray(predict(x[start : start + batch_size]))
        correct += int((logits.argmax(axis=1) == y[start : start + batch_size]).sum())
    return 100.0 * correct / len(x)


def run_keras_job(
    cfg: PipelineConfig, model: Any, data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
) -> dict[str, Any]:
    """Quantize the trained Keras ``model`` for ``cfg.target`` at ``cfg``'s widths, PTQ (``cfg.calib``), QAT
    (``cfg.qat_epochs``), export, engines (``cfg.runtimes``) and report into ``cfg.out``; the summary, also
    written to ``summary.json`` (under ``"pipeline"``, as the PyTorch job does)."""
    import qdq.keras as qk

    x_train, y_train, x_test, y_test = data
    if cfg.eval_batches:
        x_test, y_test = x_test[: cfg.eval_batches * cfg.batch_size], y_test[: cfg.eval_batches * cfg.batch_size]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def evaluate(m: Any) -> float:
        return _accuracy(m.predict_on_batch, x_test, y_test, cfg.batch_size)

    summary: dict[str, Any] = {"config": cfg.to_dict(), "accuracy": {"FP32": evaluate(model)}}
    qk.export_onnx(model, out / "model_fp32.onnx", target="tensorrt")  # no wrappers: the float graph
    qmodel = qk.quantize_model(model, num_bits=cfg.activation_bits, weight_bits=cfg.weight_bits, target=cfg.target)
    calib = [x_train[i : i + cfg.batch_size] for i in range(0, cfg.calib_batches * cfg.batch_size, cfg.batch_size)]
    methods = CALIBRATION_METHODS if cfg.calib == "all" else (cfg.calib,)
    ptq = qk.ptq(qmodel, calib, evaluate, methods)
    summary["ptq"] = ptq.to_dict()
    summary["accuracy"]["PTQ " + ptq.best.label] = ptq.best.score
    qat = None
    if cfg.qat_epochs:
        qat = qk.qat(qmodel, x_train, y_train, epochs=cfg.qat_epochs, lr=cfg.train_lr, eval_fn=evaluate,
                     batch_size=cfg.batch_size, seed=cfg.seed)  # fmt: skip
        summary["qat"] = {"epochs": qat.epochs}
        summary["accuracy"]["QAT"] = qat.final_score
    int8 = qk.export_onnx(qmodel, out / "model.onnx")
    summary["files"] = {"onnx": int8.name, "fp32_onnx": "model_fp32.onnx"}
    batches = [x_test[i : i + cfg.batch_size] for i in range(0, len(x_test), cfg.batch_size)]
    summary["engines"], summary["latency"] = measure_engines(
        cfg, qk.fold_batchnorms(qmodel), int8, out / "model_fp32.onnx", batches,
        lambda predict: _accuracy(predict, x_test, y_test, cfg.batch_size),
    )  # fmt: skip
    for runtime, engine in summary["engines"].items():
        summary["accuracy"][f"INT8 engine ({runtime})"] = engine["accuracy"]
    _report(cfg, summary, ptq, qat)
    return summary


def _report(cfg: PipelineConfig, summary: dict[str, Any], ptq: Any, qat: Any) -> None:
    from qdq.app.report import ReportData, write_report
    from qdq.app.report.summary import jsonable

    notes = [
        f"{runtime}: INT8 engine top-1 {e['accuracy']:.2f} %, agrees with Keras fake-quant on "
        f"{e['top1_agreement']:.2f} % of {e['samples']} samples, max error {e['max_error_steps']:.2f} output steps"
        for runtime, e in summary["engines"].items()
    ]
    data = ReportData(
        title=f"qdq: {cfg.model} (Keras) on {cfg.data}, W{cfg.weight_bits}A{cfg.activation_bits}, target {cfg.target}",
        model=cfg.model, dataset=cfg.data, accuracy={k: v for k, v in summary["accuracy"].items() if v is not None},
        ptq=ptq, qat=qat, latency=summary["latency"], notes=notes,
    )  # fmt: skip
    out = Path(cfg.out)
    write_report(out, data)
    record = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    record["pipeline"] = jsonable(summary)
    write_text_atomic(out / "summary.json", json.dumps(record, indent=2))


def keras_demo_runs(settings: Any, out: Path, train_lr: float, batch_size: int) -> dict[str, Any]:
    """Train the Keras digits CNN once (``settings.train_epochs``) and run the job for each of
    ``settings.schemes`` (``(label, weight_bits, activation_bits)``), as :func:`qdq.app.demo.run_demo` does for
    the PyTorch models; ``{"keras_digits_resnet <scheme>": summary}``."""
    data = digits_arrays(32)
    model = train_keras(keras_digits_resnet(), data[0], data[1], settings.train_epochs, train_lr, batch_size=batch_size)
    runs = {}
    for scheme, weight_bits, activation_bits in settings.schemes:
        cfg = PipelineConfig(
            model=KERAS_MODEL, data="digits", out=str(out / KERAS_MODEL / scheme), calib="all",
            calib_batches=settings.calib_batches, qat_epochs=settings.qat_epochs, train_lr=train_lr,
            target="onnxruntime", runtimes=list(settings.runtimes), weight_bits=weight_bits,
            activation_bits=activation_bits, batch_size=batch_size, bench_iters=settings.bench_iters,
            eval_batches=settings.eval_batches,
        )  # fmt: skip
        runs[f"{KERAS_MODEL} {scheme}"] = run_keras_job(cfg, model, data)
    return runs
