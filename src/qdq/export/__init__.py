"""ONNX export of quantized models (and, named here for existing code, TensorRT calibration caches).

* :func:`export_onnx` writes a Q/DQ ONNX graph for TensorRT (``target="tensorrt"``) or ONNX Runtime
  (``target="onnxruntime"``; any target registered in :mod:`qdq.targets`), by default for the target the
  model was placed for, with torch's dynamo exporter or the TorchScript one.
* :func:`export_float_onnx`: a float model as the FP32 file of the quantized files for a target (the one they
  are compared with and timed against; the one :func:`qdq.tune` places).
* :func:`rewrite_for_onnxruntime`: the ``"onnxruntime"`` target's rewrite of a Q/DQ graph
  (:mod:`qdq.targets.onnxruntime`).
* :func:`annotate_quantizers` tags the Q/DQ nodes of a graph traced inside :func:`export_mode` with their
  quantizers' names (:mod:`qdq.graphs.onnx_tags`).
* :func:`export_mode` is the context manager behind it (quantizers emit Q/DQ while exporting).
* :func:`write_calibration_cache` / :func:`read_calibration_cache` / :func:`calibration_scales`: TensorRT's text
  calibration cache, and :func:`strip_qdq`: the float graph of a Q/DQ graph, same tensor names (TensorRT implicit
  mode). They moved to the TensorRT backend (:mod:`qdq.runtime.tensorrt.calib_cache`, also named by
  :mod:`qdq.runtime.tensorrt`); the names stay here for existing code, resolved on first access (no module of
  this package imports :mod:`qdq.runtime`).
* :func:`qdq_sites` lists the quantizers of an exported graph.
* the ``"tensorrt"`` target's TensorRT 11 tools (:mod:`qdq.targets.tensorrt`), named here for convenience:
  :func:`check_tensorrt` (TensorRT's explicit-quantization and strong-typing rules on any ONNX graph);
  :func:`convert_float_precision` (INT8 Q/DQ with the float part in FP16/BF16, for any float32 Q/DQ file; a
  quantized model gets it from ``export_onnx(..., target_options={"float": "float16"})``);
  :func:`round_scales` (a float32 graph with low-precision steps) and :func:`compare_graphs` (a low-precision
  graph against its float32 reference, in ONNX Runtime).

Importing this package does not import ``onnx``; the functions do, when called.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

_LAZY = {
    "export_onnx": "qdq.export.onnx_export",
    "export_float_onnx": "qdq.export.onnx_export",
    "onnx_opset": "qdq.export.onnx_export",
    "export_mode": "qdq.export.mode",
    "quantizer_specs": "qdq.export.mode",
    "QdqSpec": "qdq.export.mode",
    "qdq_sites": "qdq.graphs.onnx_tags",
    "QdqSite": "qdq.graphs.onnx_tags",
    "annotate_quantizers": "qdq.graphs.onnx_tags",
    "write_calibration_cache": "qdq.runtime.tensorrt.calib_cache",
    "read_calibration_cache": "qdq.runtime.tensorrt.calib_cache",
    "calibration_scales": "qdq.runtime.tensorrt.calib_cache",
    "strip_qdq": "qdq.runtime.tensorrt.calib_cache",
    "rewrite_for_onnxruntime": "qdq.targets.onnxruntime.rewrite",
    "unfusable_convs": "qdq.targets.onnxruntime.passes.float_convs",
    "check_tensorrt": "qdq.targets.tensorrt.check",
    "convert_float_precision": "qdq.targets.tensorrt.float_types",
    "round_scales": "qdq.targets.tensorrt.float_scales",
    "compare_graphs": "qdq.targets.tensorrt.float_fidelity",
    "dynamo_translation_table": "qdq.export._ops",
    "register_torchscript_symbolic": "qdq.export._ops",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
