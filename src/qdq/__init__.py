"""qdq: INT8 quantization for PyTorch, exported as Q/DQ ONNX and deployed on TensorRT, ONNX Runtime, OpenVINO.

Importing ``qdq`` does no work: names below resolve lazily on first access.

Entry points:
    model = quantize_model(model, QuantConfig(...))  quantized modules (and Q/DQ placement for a target);
                                                     always use the returned model
    quantize_onnx(model.onnx, batches, out.onnx)     an FP32 ONNX file quantized for a target
    tune(model.onnx, batches, eval_batches, out.onnx, budget=Budget.agreement(99))
                                                     the fastest measured configuration meeting a budget
    QuantDescriptor, TensorQuantizer                 how one tensor is quantized / the module that does it
    tensor_quant, fake_tensor_quant                  the numerics (module ``qdq.tensor_quant``)
    nn (as quant_nn), quant_modules, calib           the seed toolkit's module paths
"""

from __future__ import annotations

from qdq.lazy import lazy_names

__version__ = "0.1.0"

_LAZY = {
    "QuantDescriptor": "qdq.descriptor",
    "ScaledQuantDescriptor": "qdq.descriptor",
    "TensorQuantizer": "qdq.quantizer",
    "QuantConfig": "qdq.quantize",
    "quantize_model": "qdq.quantize",
    "register_quant_module": "qdq.replace",
    "unregister_quant_module": "qdq.replace",
    "fake_tensor_quant": "qdq.tensor_quant",
    "tensor_quant_fn": "qdq.tensor_quant",
    "quant_step": "qdq.tensor_quant",
    "export_onnx": "qdq.export.onnx_export",
    "quantize_onnx": "qdq.onnx_in.quantize",
    "tune": "qdq.tuning",
    "Budget": "qdq.tuning",
    "apply_placement": "qdq.placement",
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
_RENAMED = {"compute_amax": "load_amax (it loads ranges into a model; a calibrator's compute_amax() returns one)"}
_SUBMODULES = {"nn", "calib", "quant_modules", "tensor_quant", "descriptor", "quantizer", "replace", "runtime",
               "export", "placement", "workflow", "app", "utils", "optim", "errors", "registry", "targets", "graphs",
               "quantize", "onnx_in", "tuning"}  # fmt: skip

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


__getattr__, __dir__ = lazy_names(
    __name__, _LAZY, submodules=_SUBMODULES, aliases={"tensor_quant_fn": "tensor_quant"}, renamed=_RENAMED
)
