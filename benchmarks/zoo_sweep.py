"""No crash on any public model, for either target, with any method: every zoo model quantized by ``quantize_onnx``
for ``onnxruntime``, ``tensorrt`` with a float16 remainder and ``tensorrt`` with a float32 one, with each
registered calibration method, and for ``onnxruntime`` with the default method and each weight method other than
``max`` (``weight_method``), on the quick calibration set; each TensorRT file through ``qdq check``. Nothing is
evaluated (``benchmarks/zoo.py`` does that): a row is ``ok``, ``ok check PASS`` or the error.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/zoo_sweep.py [--models nudenet,silero] [--weights-only]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import _zoo_models as zoo

import qdq
from qdq.calib.methods import CALIBRATION_METHODS
from qdq.targets.tensorrt.check import check_tensorrt

TARGETS = (("onnxruntime", None), ("tensorrt", {"float": "float16"}), ("tensorrt", None))
WEIGHT_METHODS = ("mse", "percentile")  # with the default method, for onnxruntime (max: every other row)


def sweep(name: str, folder: Path, weights_only: bool = False) -> list[tuple[str, str, str, str]]:
    """``(model, target, method, state)`` for every target and method on the zoo model ``name`` (``weights_only``:
    the weight methods' rows alone)."""
    model = zoo.load(name, quick=True)
    runs = [] if weights_only else [(target, options, method, "max") for target, options in TARGETS
                                    for method in CALIBRATION_METHODS]  # fmt: skip
    runs += [("onnxruntime", None, "auto", weights) for weights in WEIGHT_METHODS]
    rows = []
    for target, options, method, weights in runs:
        label = target + (f" {options['float']}" if options else "")
        shown = method + (f", weights {weights}" if weights != "max" else "")
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = qdq.quantize_onnx(model.source, model.calibration, folder / f"{name}.onnx", target=target,
                                           target_options=options, method=method, weight_method=weights,
                                           progress=False)  # fmt: skip
            state = "ok"
            if target == "tensorrt":
                report = check_tensorrt(result.path)
                state += " check PASS" if report.ok else f" check FAIL: {report}"
        except Exception as err:  # the sweep records every failure and goes on
            state = f"CRASH {type(err).__name__}: {str(err)[:200]}"
        rows.append((name, label, shown, state))
        print(f"{name} {label} {shown}: {state} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.MODELS))
    parser.add_argument("--weights-only", action="store_true", help="only the rows of the weight methods")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            rows += sweep(name.strip(), Path(folder), args.weights_only)
    crashes = [r for r in rows if r[3].startswith("CRASH")]
    checks = [r for r in rows if "check" in r[3]]
    passed = sum("check PASS" in r[3] for r in checks)
    print(f"\n{len(rows)} files: {len(crashes)} crashes; qdq check PASS on {passed} of {len(checks)} TensorRT files")
    for row in crashes + [r for r in checks if "PASS" not in r[3]]:
        print("  " + " | ".join(row))


if __name__ == "__main__":
    main()
