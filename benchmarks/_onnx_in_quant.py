"""The quantizers of ``onnx_in.py``, each run in its own process: ``python _onnx_in_quant.py JOB.json``.

One process per quantization, so that nothing leaks from one quantizer into the next: NVIDIA ModelOpt patches
``onnxruntime.quantization`` for the whole process, ORT's histogram calibrators keep every activation until the
process ends, and the peak resident memory measured (``VmHWM`` of ``/proc/self/status``) is this quantizer's.

The job file (written by ``onnx_in.py`` or ``zoo.py``) names the variant (one of :data:`VARIANTS` by name, or any
variant given as ``quantizer`` and ``options`` beside its name), the model file, the calibration data (an ``.npz``
of batches: key ``"{batch:04d}/{input name}"``) and where to write the int8 file and the result. The result is a
JSON object: ``ok``, ``seconds`` (wall time of the quantizer call, loading and saving included), ``rss_start_mib``
(resident memory after imports and data, before the call), ``rss_peak_mib`` (the process's peak), ``error`` (the
first line of what it raised), ``warnings`` (the distinct warnings the call gave, first lines) and ``notes``.
After quantizing, the worker loads the file in an ONNX Runtime session, so that a file ORT cannot load (or crashes
on) fails here and not in the parent.

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
import warnings
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


def quantize_qdq_torch(model: Path, batches: list[Batch], out: Path, options: Mapping[str, Any]) -> None:
    """qdq's PyTorch door: ``options["builder"]`` (``"module:function"``, imported from the benchmarks folder) builds
    the float model, then ``qdq.quantize_model`` for ``options["target"]``, ``qdq.calibrate`` on the batches (their
    one input as a tensor) with ``options["method"]`` where given, else qdq's default, and ``qdq.export_onnx``
    (int8 weights for ``onnxruntime``, as :func:`quantize_qdq`). ``model`` (the FP32 ONNX file) is not read."""
    import torch

    import qdq

    module, _, name = options["builder"].partition(":")
    float_model = getattr(importlib.import_module(module), name)()
    quantized = qdq.quantize_model(float_model, qdq.QuantConfig(target=options["target"]))
    data = [torch.from_numpy(np.ascontiguousarray(next(iter(batch.values())))) for batch in batches]
    calibrate_options = {"method": options["method"]} if "method" in options else {}
    qdq.calibrate(quantized, data, progress=False, **calibrate_options)
    target_options = {"weights": "int8"} if options["target"] == "onnxruntime" else {}
    qdq.export_onnx(quantized, data[0], str(out), target_options=target_options)


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
    ModelOpt's default "fp16"; ``simplify``: run onnxslim first).

    Each input is concatenated along its batch axis: the first axis as long as the first input's batch (a
    recurrent state ``[layers, N, hidden]`` has it second); scalars are passed once, without a shape. ModelOpt
    splits every input along its first axis, so where an input's batch axis is another, the whole set is one
    calibration batch."""
    from modelopt.onnx.quantization import quantize

    names = list(batches[0])
    rows = batches[0][names[0]].shape[0]
    axes = {n: next((i for i, d in enumerate(batches[0][n].shape) if d == rows), 0) for n in names}
    data = {n: np.concatenate([b[n] for b in batches], axis=axes[n]) if batches[0][n].ndim else batches[0][n]
            for n in names}  # fmt: skip
    shaped = data if any(axes[n] and batches[0][n].ndim for n in names) else batches[0]
    shapes = ",".join(f"{n}:{'x'.join(str(d) for d in shaped[n].shape)}" for n in names if shaped[n].ndim)
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
    "qdq-torch": quantize_qdq_torch,
}
IMPORTS = {"ort": "onnxruntime.quantization", "modelopt": "modelopt.onnx.quantization", "qdq": "qdq",
           "qdq-torch": "qdq"}  # fmt: skip
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


def _peak_rss_mib() -> float:
    """This process's peak resident memory: ``VmHWM``, the high-water mark of its own address space. Not
    ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries the parent's peak across fork and exec into it, so a worker
    started by a 2 GB parent reported at least 2 GB whatever it used."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _check_loads(path: Path, notes: list[str]) -> None:
    """The file loads in ONNX Runtime as the benchmark loads it (qdq.runtime's session, as written; a plain
    session where this interpreter has no qdq). A file computing in float16 that ORT's optimizer refuses is
    loaded again unoptimized, as ``zoo.py`` runs such files (``_zoo_models.open_runtime``), with a note."""
    try:
        from qdq.runtime.ort import inference_session, session_options
    except ImportError:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        return
    try:
        inference_session(path, uint8_weights=False)
    except Exception as err:
        from _zoo_models import computes_float16

        if not computes_float16(path):
            raise
        inference_session(path, session_options(optimization_level="disable"), uint8_weights=False)
        lines = str(err).strip().splitlines()
        notes.append(f"loads only unoptimized (float16; optimized: {lines[0] if lines else type(err).__name__})")


def _first_lines(caught: list[warnings.WarningMessage], most: int = 8) -> list[str]:
    """The distinct warnings of a quantizer call: category and first line, at most ``most``."""
    lines: list[str] = []
    for warning in caught:
        text = str(warning.message).strip().splitlines()
        line = f"{warning.category.__name__}: {text[0] if text else ''}"[:300]
        if line not in lines:
            lines.append(line)
    return lines[:most]


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """Quantize as ``job`` says; the result object of the module doc."""
    if "quantizer" in job:
        variant = Variant(job["variant"], job["quantizer"], job.get("options", {}))
    else:
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quantizer(Path(job["model"]), batches, Path(job["output"]), variant.options)
        result["seconds"] = time.perf_counter() - start
        result["warnings"] = _first_lines(caught)
        result["rss_peak_mib"] = _peak_rss_mib()
        _check_loads(Path(job["output"]), result["notes"])
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
