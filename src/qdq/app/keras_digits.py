"""The demo's Keras 3 rows: the ResNet-style digits CNN written in Keras, through the same job as the PyTorch
runs (FP32, PTQ with every calibrator from one pass, QAT with the seed's schedule, Q/DQ export for the
target, INT8 engines on each runtime with accuracy, fidelity, int8 coverage and latency, report), giving the
same summary: more rows of the demo table.

The data are the PyTorch runs' (:func:`qdq.app.data.parse_data_spec`: the same split and normalisation), in
Keras's layout (NHWC). Needs the ``tf`` extra; TensorFlow is imported when a function here is called.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qdq.app.pipeline import PipelineConfig, engine_notes, export_notes, qat_skip_reason, run_label
from qdq.atomic import write_text_atomic
from qdq.calib.methods import CALIBRATION_METHODS
from qdq.workflow.progress import Progress, counter

__all__ = [
    "KERAS_MODEL",
    "digits_arrays",
    "keras_digits_resnet",
    "keras_missing",
    "run_keras_job",
    "train_keras",
    "train_keras_digits",
]

#: the name of the Keras digits model in configs and tables
KERAS_MODEL = "keras_digits_resnet"

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def keras_missing() -> str | None:
    """Why the Keras rows cannot run here (TensorFlow not installed), or None."""
    from qdq.errors import QdqBackendUnavailable

    try:
        from qdq.keras._backend import keras

        keras()
    except QdqBackendUnavailable as err:
        return " ".join(str(err).split())
    return None


def digits_arrays(data: str = "mnist", size: int | None = None, seed: int = 0) -> Arrays:
    """``(x_train, y_train, x_test, y_test)``: the PyTorch runs' data (``data`` as in ``qdq quantize --data``)
    as NHWC float32 / int64 arrays, in the order of the split's items."""
    from qdq.app.data import parse_data_spec

    def arrays(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
        images = np.stack([np.asarray(dataset[i][0]) for i in range(len(dataset))])
        labels = np.asarray([dataset[i][1] for i in range(len(dataset))], np.int64)
        return np.ascontiguousarray(images.transpose(0, 2, 3, 1), np.float32), labels

    train, test = parse_data_spec(data, size=size, seed=seed)
    return (*arrays(train), *arrays(test))


def keras_digits_resnet(num_classes: int = 10, size: int = 28) -> Any:
    """The Keras twin of :func:`qdq.app.models.digits_resnet` (same layers, shapes and parameter count): stem
    3x3 conv - BN - ReLU, basic blocks of :data:`~qdq.app.models.DIGITS_RESNET_WIDTHS` channels (1x1 conv
    shortcut where the shape changes), global average pool, Dense. Input ``(size, size, 3)``, NHWC."""
    from qdq.app.models import DIGITS_RESNET_STEM, DIGITS_RESNET_WIDTHS
    from qdq.keras._backend import keras

    layers = keras().layers

    def conv_bn(x: Any, width: int, kernel: int, stride: int, name: str) -> Any:
        x = layers.Conv2D(width, kernel, stride, padding="same", use_bias=False, name=f"{name}_conv")(x)
        return layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)  # PyTorch's default (0.1) in Keras

    inputs = keras().Input((size, size, 3), name="image")
    width, stride = DIGITS_RESNET_STEM
    x = layers.ReLU(name="stem_relu")(conv_bn(inputs, width, 3, stride, "stem"))
    for i, out in enumerate(DIGITS_RESNET_WIDTHS):
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
                seed: int = 0, progress: Progress = False) -> Any:  # fmt: skip
    """Train ``model`` with the PyTorch runs' recipe: SGD (momentum 0.9, weight decay 5e-4), linear warm-up
    over 10 % of the steps, then cosine to 0, cross-entropy on logits. ``progress``: a bar over the steps."""
    from qdq.keras._backend import keras

    k = keras()
    k.utils.set_random_seed(seed)
    steps = epochs * int(np.ceil(len(x) / batch_size))
    warmup = max(1, steps // 10)
    schedule = k.optimizers.schedules.CosineDecay(0.0, steps - warmup, warmup_target=lr, warmup_steps=warmup)
    model.compile(k.optimizers.SGD(schedule, momentum=0.9, weight_decay=5e-4),
                  k.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    with counter(progress, f"{epochs} epochs", steps) as bar:
        step = k.callbacks.LambdaCallback(on_train_batch_end=lambda *_, **__: bar.update())
        model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[step])
    return model


def train_keras_digits(settings: Any, progress: Progress) -> tuple[Any, Arrays]:
    """The demo's Keras training (:class:`qdq.app.demo.DemoModel` ``train``): the model and its data."""
    data = digits_arrays("mnist")
    model = train_keras(keras_digits_resnet(), data[0], data[1], settings.train_epochs, settings.train_lr,
                        batch_size=settings.batch_size, progress=progress)  # fmt: skip
    return model, data


def _accuracy(predict: Any, x: np.ndarray, y: np.ndarray, batch_size: int) -> float:
    """Top-1 accuracy in percent of ``predict(batch) -> logits`` over ``x`` / ``y``."""
    correct = 0
    for start in range(0, len(x), batch_size):
        logits = np.asarray(predict(x[start : start + batch_size]))
        correct += int((logits.argmax(axis=1) == y[start : start + batch_size]).sum())
    return 100.0 * correct / len(x)


def _counted(evaluate: Callable[[Any], float], bar: Any) -> Callable[[Any], float]:
    def run(model: Any) -> float:
        score = evaluate(model)
        bar.update()
        return score

    return run


def run_keras_job(trained: tuple[Any, Arrays], cfg: PipelineConfig, progress: Progress = True) -> dict[str, Any]:
    """Quantize the trained Keras model for ``cfg.target`` at ``cfg``'s widths, PTQ (``cfg.calib``), QAT
    (``cfg.qat_epochs``), export, engines (``cfg.runtimes``) and report into ``cfg.out``; the summary, also
    written to ``summary.json`` (under ``"pipeline"``, as the PyTorch job does). ``trained``: ``(model,
    (x_train, y_train, x_test, y_test))``; the model itself is not changed."""
    import warnings

    import qdq.keras as qk
    from qdq.app.engines import measure_engines
    from qdq.workflow.post_training import method_grid

    model, (x_train, y_train, x_test, y_test) = trained
    progress = run_label(cfg) if progress is True else progress
    if cfg.eval_batches:
        x_test, y_test = x_test[: cfg.eval_batches * cfg.batch_size], y_test[: cfg.eval_batches * cfg.batch_size]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def evaluate(m: Any) -> float:
        return _accuracy(m.predict_on_batch, x_test, y_test, 2 * cfg.batch_size)

    summary: dict[str, Any] = {"config": cfg.to_dict(), "accuracy": {"FP32": evaluate(model)}}
    qk.export_float_onnx(model, out / "model_fp32.onnx", target=cfg.target)  # the INT8 file's FP32 twin
    qmodel = qk.quantize_model(model, num_bits=cfg.activation_bits, weight_bits=cfg.weight_bits, target=cfg.target)
    calib = [x_train[i : i + cfg.batch_size] for i in range(0, cfg.calib_batches * cfg.batch_size, cfg.batch_size)]
    methods = CALIBRATION_METHODS if cfg.calib == "all" else (cfg.calib,)
    scored = len(method_grid(methods, cfg.percentiles)) + 1
    with counter(progress, f"PTQ: calibrating, scoring {scored - 1} calibrations", scored) as bar:
        ptq = qk.ptq(qmodel, calib, _counted(evaluate, bar), methods, percentiles=cfg.percentiles)
    summary["ptq"] = ptq.to_dict()
    summary["accuracy"]["PTQ " + ptq.best.label] = ptq.best.score
    qat = None
    skipped = qat_skip_reason(cfg, summary["accuracy"]) if cfg.qat_epochs else "qat_epochs is 0"
    if skipped is None:
        n = len(x_train) if cfg.qat_batches is None else min(cfg.qat_batches * cfg.batch_size, len(x_train))
        with counter(progress, f"QAT {cfg.qat_epochs} epoch(s) of {n} images", cfg.qat_epochs) as bar:
            qat = qk.qat(qmodel, x_train[:n], y_train[:n], epochs=cfg.qat_epochs, lr=cfg.train_lr,
                         eval_fn=_counted(evaluate, bar), batch_size=cfg.batch_size, seed=cfg.seed)  # fmt: skip
        summary["qat"] = {"epochs": qat.epochs}
        summary["accuracy"]["QAT"] = qat.final_score
    else:
        summary["qat_skipped"] = skipped
    with counter(progress, "export Q/DQ ONNX", 1) as bar, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        int8 = qk.export_onnx(qmodel, None, out / "model.onnx")
        bar.update()
    summary["export_notes"] = export_notes(caught)
    summary["files"] = {"onnx": int8.name, "fp32_onnx": "model_fp32.onnx"}
    batches = [x_test[i : i + cfg.batch_size] for i in range(0, len(x_test), cfg.batch_size)]
    summary["engines"], summary["latency"] = measure_engines(
        cfg, qk.fold_batchnorms(qmodel), int8, out / "model_fp32.onnx", batches,
        lambda predict: _accuracy(predict, x_test, y_test, cfg.batch_size), progress,
    )  # fmt: skip
    for runtime, engine in summary["engines"].items():
        summary["accuracy"][f"INT8 engine ({runtime})"] = engine["accuracy"]
    _report(cfg, summary, ptq, qat)
    return summary


def _report(cfg: PipelineConfig, summary: dict[str, Any], ptq: Any, qat: Any) -> None:
    from qdq.app.report import ReportData, write_report
    from qdq.app.report.summary import jsonable

    data = ReportData(
        title=f"qdq: {cfg.model} (Keras) on {cfg.data}, {cfg.scheme}, target {cfg.target}",
        model=cfg.model, dataset=cfg.data, accuracy={k: v for k, v in summary["accuracy"].items() if v is not None},
        ptq=ptq, qat=qat, latency=summary["latency"],
        notes=[*engine_notes(summary["engines"], reference="Keras"), *summary.get("export_notes", [])],
    )  # fmt: skip
    out = Path(cfg.out)
    write_report(out, data)
    record = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    record["pipeline"] = jsonable(summary)
    write_text_atomic(out / "summary.json", json.dumps(record, indent=2))
