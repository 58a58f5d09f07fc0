"""NNCF's ``quantize_with_accuracy_control`` on nudenet, in its own process (``tune.py`` runs it).

Same calibration images, same tuning images (NNCF's validation set) and the same metric as qdq's search:
detections F1 against FP32's, per image so that NNCF can rank on subsets. Writes the INT8 file and prints one
JSON line: the file, the wall time, NNCF's own evaluation count where it reports it.

Usage: python benchmarks/_nncf_tune.py OUT.onnx --calib-images N --eval-images N --max-drop D
(in a venv with ``pip install --no-deps nncf`` and its light dependencies: ``tune.py`` says which).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _onnx_in_models as models
import numpy as np


def main() -> None:
    import nncf
    import onnx
    import onnxruntime as ort

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--calib-images", type=int, default=32)
    parser.add_argument("--eval-images", type=int, default=64)
    parser.add_argument("--max-drop", type=float, default=0.05)
    args = parser.parse_args()
    source = models.package_file("nudenet", "320n.onnx")
    model = onnx.load(str(source))
    calibration = models.nudenet_split("calibration", args.calib_images).samples
    evaluation = models.nudenet_split("evaluation", args.eval_images)
    # qdq's tuning split: the even batches of 8
    tuning = [i for i in range(len(evaluation.samples)) if (i // 8) % 2 == 0]
    fp32 = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    reference = {i: fp32.run(None, {"images": evaluation.samples[i][None]})[0][0] for i in tuning}

    def validate(candidate, items) -> float:
        proto = candidate if isinstance(candidate, onnx.ModelProto) else None
        session = (ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
                   if proto is not None else None)  # fmt: skip
        hits = found = expected = 0
        for image, index in items:
            out = session.run(None, {"images": image})[0][0] if session is not None else candidate(image)[0][0]
            extent = evaluation.truth[index]
            mine = models.nudenet_detections(out, extent)
            theirs = models.nudenet_detections(reference[index], extent)
            hits, found, expected = hits + models.matched(mine, theirs), found + len(mine), expected + len(theirs)
        return 1.0 if found + expected == 0 else 2 * hits / (found + expected)

    calib_set = nncf.Dataset([{"images": x[None]} for x in calibration])
    valid_set = nncf.Dataset([(evaluation.samples[i][None], i) for i in tuning])
    started = time.perf_counter()
    quantized = nncf.quantize_with_accuracy_control(
        model, calib_set, valid_set, validation_fn=validate, max_drop=args.max_drop,
        drop_type=nncf.DropType.ABSOLUTE, subset_size=len(calibration),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    onnx.save(quantized, args.out)
    print(json.dumps({"path": str(Path(args.out)), "seconds": seconds, "nncf": nncf.__version__}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    np.seterr(all="ignore")
    main()
