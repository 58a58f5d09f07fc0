"""The other model files the zoo's wheels ship: the default (no method) on files no rule was written for.

silero-vad's wheel carries four exports beside the two of the zoo (a sequence model with an LSTM state, an op18 file
whose network sits in one ``If``, a float16 file, the OpenVINO export at batch 1), and rapidocr's carries PP-OCR's
text direction classifier (Paddle, its batch axis declared ``-1``). Each is quantized by
``quantize_onnx(path, data, out, target=...)`` for ``onnxruntime`` and ``tensorrt``, each TensorRT file goes through
``qdq check``, and each file is run on ONNX Runtime against the FP32 file on two held-out sets; the ``onnxruntime``
files are timed against the FP32 file on their first calibration batch (5 interleaved rounds). Inputs: the zoo's
seeded silero-op15 chunks (calibration on the first 4 batches, set A the next 2, set B the last 2) and the zoo's
PP-OCR rec lines cut to the classifier's 192 pixels (its own calibration and evaluation sets). Metrics: SQNR of the
first output, and decisions (argmax; one probability: the side of 0.5) equal to FP32's.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/zoo_extra.py [--models silero_seq,ppocr_cls]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import _zoo_models as zoo
import numpy as np
import onnxruntime as ort

import qdq
from qdq.runtime.benchmark import compare_models
from qdq.targets.tensorrt.check import check_tensorrt

Feeds = list[dict[str, np.ndarray]]


def _silero(feeds: Feeds, keys: tuple[str, ...]) -> Feeds:
    """The zoo's chunks for an export with inputs ``keys`` (``sr``: the rate too; ``h``: the sequence model's
    zero LSTM state; ``one``: one chunk at a time, every 16th)."""
    out: Feeds = []
    for feed in feeds:
        x, state = feed["input"], feed["state"]
        if "h" in keys:
            zero = np.zeros((1, 1, 128), np.float32)
            out.append({"input": x, "h": zero, "c": zero})
        elif "one" in keys:
            out += [{"input": x[i : i + 1], "state": state[:, i : i + 1]} for i in range(0, len(x), 16)]
        else:
            out.append({"input": x, "state": state, **({"sr": feed["sr"]} if "sr" in keys else {})})
    return out


def _cls(feeds: Feeds) -> Feeds:
    return [{"x": np.ascontiguousarray(feed["x"][:, :, :, :192])} for feed in feeds]


#: name -> (package, file in it, zoo model whose inputs it takes, feeds of that model -> feeds of this file)
MODELS: dict[str, tuple[str, str, str, Callable[[Feeds], Feeds]]] = {
    "silero_seq": ("silero_vad", "data/silero_vad_16k_sequence.onnx", "silero-op15", lambda f: _silero(f, ("h",))),
    "silero_ifless18": ("silero_vad", "data/silero_vad_op18_ifless.onnx", "silero-op15",
                        lambda f: _silero(f, ("sr",))),
    "silero_half": ("silero_vad", "data/silero_vad_half.onnx", "silero-op15", lambda f: _silero(f, ())),
    "silero_ov16k": ("silero_vad", "data/silero_vad_openvino_16k.onnx", "silero-op15",
                     lambda f: _silero(f, ("one",))),
    "ppocr_cls": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "ppocr-rec", _cls),
}  # fmt: skip


def _sets(source: zoo.ZooModel, convert: Callable[[Feeds], Feeds]) -> tuple[Feeds, Feeds, Feeds]:
    """Calibration, A and B feeds (silero's evaluation sets are clips, not feeds: its calibration chunks split)."""
    if source.evaluation["A"].feeds:
        return tuple(convert(f) for f in (source.calibration, source.evaluation["A"].feeds,
                                          source.evaluation["B"].feeds))  # type: ignore[return-value]  # fmt: skip
    chunks = source.calibration
    return convert(chunks[:4]), convert(chunks[4:6]), convert(chunks[6:8])


def _outputs(session: ort.InferenceSession, feeds: Feeds) -> np.ndarray:
    """The first output over ``feeds``, one row per sample."""
    arrays = [np.asarray(session.run(None, feed)[0]) for feed in feeds]
    return np.concatenate([a.reshape(len(a) if a.ndim else 1, -1) for a in arrays]).astype(np.float64)


def _fidelity(fp32: ort.InferenceSession, quantized: ort.InferenceSession, feeds: Feeds) -> tuple[float, float]:
    """SQNR (dB) of the first output and the share (%) of decisions equal to FP32's."""
    ref, got = _outputs(fp32, feeds), _outputs(quantized, feeds)
    sqnr = 10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-30))
    same = ref.argmax(1) == got.argmax(1) if ref.shape[1] > 1 else (ref[:, 0] > 0.5) == (got[:, 0] > 0.5)
    return float(sqnr), 100.0 * float(np.mean(same))


def _speed(fp32: Path, int8: Path, feed: dict[str, np.ndarray]) -> str:
    """INT8 speed-up over FP32 on ONNX Runtime (2 threads) on ``feed``, median (25-75 %) of 5 interleaved rounds."""
    samples = len(next(iter(feed.values())))
    timed = compare_models({"fp32": fp32, "int8": int8}, "onnxruntime", batch=samples, threads=2, rounds=5, iters=10,
                           warmup=3, inputs=feed)  # fmt: skip
    return f"{timed.speedup('int8')} at batch {samples}"


def run(name: str, folder: Path) -> list[str]:
    package, file, source_name, convert = MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return [f"| {name} | — | not installed (pip install --no-deps {package}) | | | | |"]
    path = Path(next(iter(spec.submodule_search_locations))) / file
    calibration, set_a, set_b = _sets(zoo.load(source_name), convert)
    fp32 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = []
    for target in ("onnxruntime", "tensorrt"):
        out = folder / f"{name}_{target}.onnx"
        start = time.perf_counter()
        try:
            result = qdq.quantize_onnx(path, calibration, out, target=target, progress=False)
        except Exception as error:  # a crash is the row's result
            rows.append(f"| {name} | {target} | CRASH {type(error).__name__}: {str(error)[:200]} | | | | |")
            continue
        seconds = time.perf_counter() - start
        quantized = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        (sqnr_a, same_a), (sqnr_b, same_b) = (_fidelity(fp32, quantized, s) for s in (set_a, set_b))
        check = ("PASS" if check_tensorrt(out).ok else "FAIL") if target == "tensorrt" else "—"
        int8 = sum(result.int8_ops.values())
        speed = _speed(path, out, calibration[0]) if target == "onnxruntime" else "—"
        rows.append(f"| {name} | {target} | ok, {result.method}, {int8} int8 ops, {seconds:.1f} s | "
                    f"{sqnr_a:.1f} / {sqnr_b:.1f} | {same_a:.1f} / {same_b:.1f} | {check} | {speed} |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| file | target | result | SQNR dB A / B | decisions = FP32's % A / B | qdq check | INT8 vs FP32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="qdq-zoo-extra-") as folder:
        for name in args.models.split(","):
            for row in run(name, Path(folder)):
                print(row, flush=True)


if __name__ == "__main__":
    main()
