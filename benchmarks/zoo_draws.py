"""The default against its calibration draw: how far a zoo model's figure moves with the calibration samples.

For each model, ``--draws K`` disjoint calibration sets of the zoo's size are drawn from the model's seeded
calibration generator (``_zoo_models.load(name, calibration=K * size)``, its batches dealt into K equal groups in
order). Each is quantized by ``qdq.quantize_onnx(path, draw, out, target=...)`` without a method (qdq's default), in
this process, and evaluated on the zoo's evaluation sets A and B. The table gives every draw's headline metric and
SQNR, then the spread. The zoo's own figure (``benchmarks/zoo.py``) is one more draw of the same generator.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/zoo_draws.py [--models mobilenetv2,nudenet] [--draws 4]
        [--target onnxruntime]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import _zoo_models as zoo

import qdq
from qdq.markdown import markdown_table

DEFAULT_MODELS = "nudenet,ppocr-rec,minilm,u2netp,mobilenetv2,opennsfw"


def draws(model: zoo.ZooModel, count: int) -> list[list[zoo.Batch]]:
    """``model``'s calibration batches dealt into ``count`` equal groups, in order (the last batches left over)."""
    size = len(model.calibration) // count
    if size == 0:
        raise SystemExit(f"{model.name}: {len(model.calibration)} calibration batches cannot make {count} draws")
    return [model.calibration[i * size : (i + 1) * size] for i in range(count)]


def measure(name: str, count: int, target: str, folder: Path) -> list[list[object]]:
    """One table row per draw of ``name``: the draw, the headline metric and SQNR on A and B, auto's choice, the
    seconds of the call."""
    calibration, evaluation = zoo.SIZES[name]
    model = zoo.load(name, calibration * count, evaluation)
    rows: list[list[object]] = []
    for number, batches in enumerate(draws(model, count)):
        out = folder / f"{name}_{number}.onnx"
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = qdq.quantize_onnx(str(model.source), batches, str(out), target=target, progress=False,
                                       target_options={"weights": "int8"} if target == "onnxruntime" else None)
        seconds = time.perf_counter() - start
        metrics = model.evaluate(out)
        key = model.headline_key
        auto = result.auto
        stem = f", stem {auto.stem.levels}" if auto is not None and auto.stem is not None else ""
        rows.append([name, number, *(f"{metrics[s][key]:.4g}" for s in zoo.EVAL_SPLITS),
                     " / ".join(f"{metrics[s]['sqnr']:.1f}" for s in zoo.EVAL_SPLITS),
                     f"{auto.chosen if auto is not None else result.method}{stem}", f"{seconds:.1f}"])  # fmt: skip
        print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated (default {DEFAULT_MODELS})")
    parser.add_argument("--draws", type=int, default=4, help="disjoint calibration draws per model (default 4)")
    parser.add_argument("--target", default="onnxruntime")
    args = parser.parse_args(argv)
    headers = ["model", "draw", "headline A", "headline B", "SQNR A / B dB", "auto's choice", "seconds"]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="zoo-draws-") as folder:
        for name in args.models.split(","):
            rows += measure(name, args.draws, args.target, Path(folder))
    print(f"\nCommand: `{' '.join(sys.argv)}`\n")
    print("- headline: the model's metric of issue 43 on evaluation set A and B (`ZooModel.headline_key`: F1, exact "
          "lines %, cosine mean, mask IoU, top-1 agreement %, mean |d score|), against FP32's outputs; SQNR of the "
          "raw output it reads. auto's choice: the method and the stem's depth. seconds: the quantize call.\n")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
