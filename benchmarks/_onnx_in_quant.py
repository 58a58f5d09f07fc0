"""The quantizers of ``onnx_in.py``, each run in its own process: ``python _onnx_in_quant.py JOB.json``.

One process per quantization, so that nothing leaks from one quantizer into the next: NVIDIA ModelOpt patches
``onnxruntime.quantization`` for the whole process, ORT's histogram calibrators keep every activation until the
process ends, and the peak resident memory measured (``getrusage(RUSAGE_SELF).ru_maxrss``) is this quantizer's.

The job file (written by ``onnx_in.py``) names the variant, the model file, the calibration data (an ``.npz`` of
batches: key ``"{batch:04d}/{input name}"``) and where to write the int8 file and the result. The result is a
JSON object: ``ok``, ``seconds`` (wall time of the quantizer call, loading and saving included), ``rss_start_mib``
(resident memory after imports and data, before the call), ``rss_peak_mib`` (the process's peak), ``error``
(the first line of what it raised) and ``notes``. After quantizing, the worker loads the file in an ONNX Runtime
session, so that a file ORT cannot load (or crashes on) fails here and not in the parent.

This module imports only the standard library and numpy at the top: it also runs under ModelOpt's interpreter
(``--modelopt-python``), which may be another virtual environment.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Variant:
    """One way to make an int8 file: ``quantizer`` ("" for the FP32 original, "ort", "modelopt", "qdq") and its
    ``options`` (see the quantizer functions below)."""

    name: str
    quantizer: str
    options: Mapping[str, Any] = field(default_factory=dict)


QDQ_METHODS = ("max", "entropy", "mse", "percentile", "auto")
VARIANTS: tuple[Variant, ...] = (
    Variant("fp32", ""),
    *(Variant(f"ort-{kind}-{calib}", "ort", {"activations": kind, "calibrator": calib})
      for kind in ("u8s8", "s8s8") for calib in ("minmax", "entropy", "percentile")),
    Variant("ort-u8s8-minmax-folded", "ort", {"activations": "u8s8", "calibrator": "minmax", "fold_constants": True}),
    Variant("modelopt-max", "modelopt", {"high_precision_dtype": "fp16"}),
    Variant("modelopt-max-fp32", "modelopt", {"high_precision_dtype": "fp32"}),
    Variant("modelopt-max-fp32-simplify", "modelopt", {"high_precision_dtype": "fp32", "simplify": True}),
    *(Variant(f"qdq-ort-{method}", "qdq", {"target": "onnxruntime", "method": method}) for method in QDQ_METHODS),
    Variant("qdq-ort-percentile-no-bc", "qdq", {"target": "onnxruntime", "method": "percentile",
                                                "bias_correction": False}),
    Variant("qdq-trt-fp16", "qdq", {"target": "tensorrt", "method": "max", "float": "fp16"}),
    Variant("qdq-trt-fp32", "qdq", {"target": "tensorrt", "method": "max"}),
)  # fmt: skip
"""Every variant ``onnx_in.py`` knows, in table order."""


# -- the quantizers ----------------------------------------------------------------------------------------------


def quantize_qdq(model: Path, batches: list[Batch], out: Path, options: Mapping[str, Any]) -> None:
    """qdq's ONNX front end. **The one place that knows its signature**: adapt here when it changes.

    ``options``: ``target`` ("onnxruntime" or "tensorrt"), ``method`` (a calibration method name),
    ``bias_correction`` and, for the TensorRT 11 files, ``float`` ("fp16"): passed on as keyword arguments.
    """
    import qdq

    chosen = dict(options)
    target_options = {"float": chosen.pop("float")} if "float" in chosen else {}
    if chosen.get("target") == "onnxruntime":
        target_options["weights"] = "int8"  # as ORT's U8S8 file: int8 weights as written, whatever this CPU
    qdq.quantize_onnx(str(model), batches, str(out), target_options=target_options, progress=False, **chosen)


def quantize_ort(model: Path, batches: list[Batch], out: Path, options: Mapping[str, Any]) -> None:
    """ONNX Runtime's ``quantize_static``: QDQ format, per-channel int8 weights, ``options["activations"]``
    "u8s8" (uint8 activations, what its docstring advises on x86) or "s8s8" (int8, its advice for ARM and
    TensorRT), calibrated with ``options["calibrator"]`` ("minmax", "entropy", "percentile"), its defaults
    otherwise. ``model`` is already prepared (opset >= 13; ``quant_pre_process`` when it works). With
    ``options["fold_constants"]`` the weights held in ``Constant`` nodes are first moved to initializers (what
    onnxsim or onnxslim would do): ORT's quantizer otherwise calibrates them as activations (per tensor)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(batches)

        def get_next(self) -> Batch | None:
            return next(self._batches, None)

    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}  # fmt: skip
    activation = QuantType.QUInt8 if options["activations"] == "u8s8" else QuantType.QInt8
    if options.get("fold_constants"):
        model = _constants_to_initializers(model, out.with_name("folded.onnx"))
    quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=activation, weight_type=QuantType.QInt8,
                    calibrate_method=methods[options["calibrator"]])  # fmt: skip


def quantize_modelopt(model: Path, batches: list[Batch], out: Path, options: Mapping[str, Any]) -> None:
    """NVIDIA ModelOpt's ``modelopt.onnx.quantization.quantize``: int8, max calibration on the CPU, the batches
    concatenated (``calibration_shapes`` = the first batch's shapes, so it calibrates batch by batch as the
    others do); ``options`` are passed on (``high_precision_dtype``: what the float remainder is cast to,
    ModelOpt's default "fp16"; ``simplify``: run onnxslim first)."""
    from modelopt.onnx.quantization import quantize

    names = list(batches[0])
    data = {n: np.concatenate([b[n] for b in batches]) for n in names}
    shapes = ",".join(f"{n}:{'x'.join(str(d) for d in batches[0][n].shape)}" for n in names)
    quantize(str(model), quantize_mode="int8", calibration_method="max", calibration_data=data,
             calibration_shapes=shapes, calibration_eps=["cpu"], output_path=str(out), log_level="WARNING",
             **dict(options))  # fmt: skip


def _constants_to_initializers(model: Path, out: Path) -> Path:
    """``model`` with each ``Constant`` node holding a tensor (``value``) replaced by an initializer."""
    import onnx

    proto = onnx.load(str(model))
    kept = []
    for node in proto.graph.node:
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            proto.graph.initializer.append(tensor)
        else:
            kept.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    onnx.save(proto, str(out))
    return out


QUANTIZERS: dict[str, Callable[[Path, list[Batch], Path, Mapping[str, Any]], None]] = {
    "ort": quantize_ort,
    "modelopt": quantize_modelopt,
    "qdq": quantize_qdq,
}
IMPORTS = {"ort": "onnxruntime.quantization", "modelopt": "modelopt.onnx.quantization", "qdq": "qdq"}
"""What each quantizer imports: imported before ``rss_start_mib`` is read, so the growth is the call's."""


# -- the worker --------------------------------------------------------------------------------------------------


def save_batches(batches: list[Batch], path: Path) -> None:
    """Write calibration batches as one ``.npz`` (key ``"{index:04d}/{input}"``)."""
    np.savez(path, **{f"{i:04d}/{name}": array for i, batch in enumerate(batches) for name, array in batch.items()})


def load_batches(path: Path) -> list[Batch]:
    """The batches :func:`save_batches` wrote, in order."""
    batches: dict[int, Batch] = {}
    with np.load(path) as data:
        for key in sorted(data.files):
            index, name = key.split("/", 1)
            batches.setdefault(int(index), {})[name] = data[key]
    return [batches[i] for i in sorted(batches)]


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _check_loads(path: Path) -> None:
    """The file loads in ONNX Runtime as the benchmark loads it (qdq.runtime's session, as written; a plain
    session where this interpreter has no qdq)."""
    try:
        from qdq.runtime.ort import inference_session
    except ImportError:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        return
    inference_session(path, uint8_weights=False)


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """Quantize as ``job`` says; the result object of the module doc."""
    variant = next(v for v in VARIANTS if v.name == job["variant"])
    result: dict[str, Any] = {"ok": False, "seconds": None, "rss_start_mib": None, "rss_peak_mib": None,
                              "error": None, "notes": []}  # fmt: skip
    try:
        batches = load_batches(Path(job["calibration"]))
        quantizer = QUANTIZERS[variant.quantizer]
        importlib.import_module(IMPORTS[variant.quantizer])
        import onnxruntime  # noqa: F401  (every worker loads its result in ORT: not part of the growth)

        result["rss_start_mib"] = _rss_mib()
        start = time.perf_counter()
        quantizer(Path(job["model"]), batches, Path(job["output"]), variant.options)
        result["seconds"] = time.perf_counter() - start
        result["rss_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        _check_loads(Path(job["output"]))
        result["ok"] = True
    except Exception as err:  # a quantizer's failure is a result, not a crash of the benchmark
        lines = str(err).strip().splitlines()
        result["error"] = f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
        result["notes"].append(traceback.format_exc(limit=3)[-2000:])
    return result


def main(argv: list[str]) -> None:
    job = json.loads(Path(argv[0]).read_text())
    result = run_job(job)
    Path(job["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
