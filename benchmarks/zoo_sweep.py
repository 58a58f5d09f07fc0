"""No crash on any public model, for either target, with any method: every zoo model quantized by ``quantize_onnx``
for ``onnxruntime``, ``tensorrt`` with a float16 remainder and ``tensorrt`` with a float32 one, with each
registered calibration method, on the quick calibration set; each TensorRT file through ``qdq check``. Nothing is
evaluated (``benchmarks/zoo.py`` does that): a row is ``ok``, ``ok check PASS`` or the error.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/zoo_sweep.py [--models nudenet,silero]
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


def sweep(name: str, folder: Path) -> list[tuple[str, str, str, str]]:
    """``(model, target, method, state)`` for every target and method on the zoo model ``name``."""
    model = zoo.load(name, quick=True)
    rows = []
    for target, options in TARGETS:
        label = target + (f" {options['float']}" if options else "")
        for method in CALIBRATION_METHODS:
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = qdq.quantize_onnx(model.source, model.calibration, folder / f"{name}.onnx", target=target,
                                               target_options=options, method=method, progress=False)  # fmt: skip
                state = "ok"
                if target == "tensorrt":
                    report = check_tensorrt(result.path)
                    state += " check PASS" if report.ok else f" check FAIL: {report}"
            except Exception as err:  # the sweep records every failure and goes on
                state = f"CRASH {type(err).__name__}: {str(err)[:200]}"
            rows.append((name, label, method, state))
            print(f"{name} {label} {method}: {state} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.MODELS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            rows += sweep(name.strip(), Path(folder))
    crashes = [r for r in rows if r[3].startswith("CRASH")]
    checks = [r for r in rows if "check" in r[3]]
    passed = sum("check PASS" in r[3] for r in checks)
    print(f"\n{len(rows)} files: {len(crashes)} crashes; qdq check PASS on {passed} of {len(checks)} TensorRT files")
    for row in crashes + [r for r in checks if "PASS" not in r[3]]:
        print("  " + " | ".join(row))


if __name__ == "__main__":
    main()
