"""qdq: INT8 quantization for PyTorch, exported as Q/DQ ONNX and deployed on TensorRT, ONNX Runtime, OpenVINO.

Importing ``qdq`` does no work: names below resolve lazily on first access.

Entry points:
    model = quantize_model(model, QuantConfig(...))  quantized modules (and Q/DQ placement for a target);
                                                     always use the returned model
    quantize_onnx(model.onnx, batches, out.onnx)     an FP32 ONNX file quantized for a target
    tune(model.onnx, batches, eval_batches, out.onnx, budget=Budget.agreement(99))
                                                     the fastest measured configuration meeting a budget
    calibrate, ptq, qat, verify, export_onnx         calibration, post-training and quantization-aware training,
                                                     an engine checked against its model, Q/DQ export
    QuantDescriptor, TensorQuantizer                 how one tensor is quantized / the module that does it
    tensor_quant, nn (as quant_nn), quant_modules,   the seed toolkit's module paths (``tensor_quant.tensor_quant``,
    calib, utils, optim                              ``tensor_quant.fake_tensor_quant``: the numerics)

The rest lives one level down, in the module that owns it: ``qdq.placement.apply_placement``,
``qdq.replace.register_quant_module``, ``qdq.tensor_quant.quant_step``, ...; reading one of the names that used
to be exported here says where it went.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

__version__ = "0.1.0"

_LAZY = {
    "QuantDescriptor": "qdq.descriptor",
    "TensorQuantizer": "qdq.quantizer",
    "QuantConfig": "qdq.quantize",
    "quantize_model": "qdq.quantize",
    "export_onnx": "qdq.export.onnx_export",
    "quantize_onnx": "qdq.onnx_in.quantize",
    "tune": "qdq.tuning",
    "Budget": "qdq.tuning",
    "calibrate": "qdq.workflow.calibration",
    "collect_stats": "qdq.workflow.calibration",
    "load_amax": "qdq.workflow.calibration",
    "calibration_report": "qdq.workflow.diagnostics",
    "ptq": "qdq.workflow.post_training",
    "qat": "qdq.workflow.fine_tuning",
    "sensitivity": "qdq.workflow.sensitivity_analysis",
    "keep_float": "qdq.workflow.sensitivity_analysis",
    "verify": "qdq.workflow.verification",
    "smooth_inputs": "qdq.workflow.smoothing",
    "QdqError": "qdq.errors",
    "QdqConfigError": "qdq.errors",
    "QdqTypeError": "qdq.errors",
    "QdqCalibrationError": "qdq.errors",
    "QdqCalibrationWarning": "qdq.errors",
    "QdqExportError": "qdq.errors",
    "QdqBackendUnavailable": "qdq.errors",
    "QdqDistributedError": "qdq.errors",
}
_RENAMED = {"compute_amax": "load_amax (it loads ranges into a model; a calibrator's compute_amax() returns one)",
            "tensor_quant_fn": "tensor_quant.tensor_quant (the function, at the seed toolkit's path)"}
#: names that were exported here and live one level down: reading ``qdq.<name>`` says where
_MOVED = {
    **dict.fromkeys(("ScaledQuantDescriptor", "fake_tensor_quant", "quant_step"), "qdq.tensor_quant"),
    **dict.fromkeys(("register_quant_module", "unregister_quant_module"), "qdq.replace"),
    "apply_placement": "qdq.placement",
}
#: the submodules listed as public names: the seed toolkit's module paths and the packages a user reaches into
_PUBLIC_SUBMODULES = {"nn", "calib", "quant_modules", "tensor_quant", "utils", "optim", "errors", "workflow", "export",
                      "runtime", "targets"}  # fmt: skip
#: every submodule readable as an attribute of ``qdq`` without importing it first
_SUBMODULES = _PUBLIC_SUBMODULES | {"descriptor", "quantizer", "replace", "placement", "app", "registry", "graphs",
                                    "quantize", "onnx_in", "tuning"}  # fmt: skip

__all__ = sorted([*_LAZY, *_PUBLIC_SUBMODULES, "__version__"])


__getattr__, __dir__ = lazy_names(__name__, _LAZY, submodules=_SUBMODULES, renamed=_RENAMED, moved=_MOVED)
