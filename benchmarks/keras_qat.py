"""Keras QAT cost: keras.applications.ResNet50 quantized by qdq.keras against the same network in float.

* train step (forward + loss + backward + SGD, ``train_on_batch``), qdq vs float: issue 12's target <= 1.3x;
* histogram calibration pass (``qdq.keras.collect_stats`` over the batches) vs the float forward over the
  same batches (``predict_on_batch``): target <= 1.5x. Both are warm (traced by an earlier call); the first
  calls, which trace, are timed and printed apart.

Both models live in one process and are timed interleaved, round by round, so machine noise hits both; the
ratios of the per-variant minimum and median are printed. There is no Keras 3 peer to compare with: TFMOT
rejects Keras 3 models and NVIDIA's TF2 toolkit cannot train on TensorFlow >= 2.16 (notes, tf_toolkit.md).

Usage: python benchmarks/keras_qat.py [--size 224] [--batch 32] [--rounds 3] [--steps 2] [--calib-batches 4]
       [--target tensorrt|onnxruntime] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

from qdq.markdown import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed train steps per variant per round")
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--target", default="tensorrt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from qdq.keras._backend import keras, tf

    tf().config.threading.set_intra_op_parallelism_threads(args.threads)  # inter-op: TensorFlow's default
    import qdq.keras as qk

    k = keras()
    k.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(args.batch, args.size, args.size, 3)).astype(np.float32)
    y = rng.integers(0, 1000, size=args.batch)
    calib = [rng.uniform(-1, 1, size=x.shape).astype(np.float32) for _ in range(args.calib_batches)]

    model = k.applications.ResNet50(weights=None, input_shape=x.shape[1:], classifier_activation=None)
    qmodel = qk.quantize_model(model, custom_qdq_cases=[qk.ResNetV1QDQCase()], target=args.target)
    # first calls trace: the float forward's predict function, the quantized model's calibration probe
    first = {"float forward": _timed(lambda: model.predict_on_batch(calib[0])),
             "histogram calibration": _timed(lambda: qk.collect_stats(qmodel, calib[:1], "histogram"))}  # fmt: skip
    qk.calibrate(qmodel, calib[:1])
    for m in (model, qmodel):
        m.compile(k.optimizers.SGD(1e-3, momentum=0.9), k.losses.SparseCategoricalCrossentropy(from_logits=True))
        for _ in range(2):  # warm-up: tracing
            m.train_on_batch(x, y)
            m.predict_on_batch(x)

    steps: dict[str, list[float]] = {"float": [], "qdq": []}
    n = args.calib_batches
    calibration: dict[str, list[float]] = {"float forward": [], "max calibration": [], "histogram calibration": []}
    for round_index in range(args.rounds):
        order = [("float", model), ("qdq", qmodel)]
        for name, m in order if round_index % 2 == 0 else reversed(order):
            for _ in range(args.steps):
                steps[name].append(_timed(lambda m=m: m.train_on_batch(x, y)))
        passes = [("float forward", lambda: [model.predict_on_batch(b) for b in calib]),
                  ("max calibration", lambda: qk.collect_stats(qmodel, calib, "max")),
                  ("histogram calibration", lambda: qk.collect_stats(qmodel, calib, "histogram"))]  # fmt: skip
        for name, run in passes if round_index % 2 == 0 else reversed(passes):
            calibration[name].append(_timed(run))
    print(f"tensorflow {tf().__version__}, keras {k.__version__}, {args.threads} threads, target {args.target}, "
          f"ResNet50 {args.size}x{args.size}, batch {args.batch}, {args.rounds} rounds")  # fmt: skip
    print(_table("train step", steps, "float"))
    print()
    print(_table(f"pass over {n} batches", calibration, "float forward"))
    print("\nfirst call, 1 batch (traces once per model): "
          + ", ".join(f"{name} {ms:.0f} ms" for name, ms in first.items()))  # fmt: skip


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return (time.perf_counter() - start) * 1e3


def _table(what: str, times: dict[str, list[float]], reference: str) -> str:
    base_min, base_med = min(times[reference]), statistics.median(times[reference])
    rows = [
        [name, f"{min(t):.0f}", f"{statistics.median(t):.0f}",
         f"{min(t) / base_min:.2f} / {statistics.median(t) / base_med:.2f}"]
        for name, t in times.items()
    ]  # fmt: skip
    return markdown_table([what, "min ms", "median ms", f"ratio vs {reference} (min / median)"], rows)


if __name__ == "__main__":
    main()
