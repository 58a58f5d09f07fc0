"""One placement rule on and off on the public zoo: the default call (``auto``) through ``quantize_onnx`` with each
target as registered and with the same target less that rule, same data; the metric on the two evaluation sets.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/zoo_ablation.py --rule output_tail --models silero,nudenet
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import warnings
from pathlib import Path

import _zoo_models as zoo

import qdq
from qdq.targets import get_target

TARGETS = ("onnxruntime", "tensorrt")


def _summary(metrics: dict) -> str:
    """The numbers of one evaluation set (floats only, 4 decimals)."""
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))


def ablate(name: str, rule: str, folder: Path) -> list[list[str]]:
    """Rows ``[model, target, with, without]`` for ``rule`` on the zoo model ``name``."""
    model = zoo.load(name)
    rows = []
    for target_name in TARGETS:
        target = get_target(target_name)
        if rule not in [r.name for r in target.placement_rules]:
            continue
        without = dataclasses.replace(target, placement_rules=tuple(r for r in target.placement_rules
                                                                    if r.name != rule))  # fmt: skip
        cells = []
        for label, chosen in (("with", target), ("without", without)):
            path = folder / f"{name}_{target_name}_{label}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qdq.quantize_onnx(model.source, model.calibration, path, target=chosen, progress=False)
            metrics = model.evaluate(path)
            cells.append(" / ".join(_summary(metrics[s]) for s in ("A", "B")))
        rows.append([name, target_name, *cells])
        print(f"{name} {target_name}: with {cells[0]}; without {cells[1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rule", default="output_tail")
    parser.add_argument("--models", default="nudenet,silero,ppocr-det,u2netp,mobilenetv2")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            rows += ablate(name.strip(), args.rule, Path(folder))
    print(f"\n| model | target | with {args.rule} (A / B) | without (A / B) |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
