"""ONNX export of quantized models, and TensorRT calibration caches.

* :func:`export_onnx` writes a Q/DQ ONNX graph for TensorRT (``target="tensorrt"``) or ONNX Runtime
  (``target="onnxruntime"``; any target registered in :mod:`qdq.targets`), by default for the target the
  model was placed for, with torch's dynamo exporter or the TorchScript one.
* :func:`rewrite_for_onnxruntime`: the ``"onnxruntime"`` target's rewrite of a Q/DQ graph
  (:mod:`qdq.targets.onnxruntime`).
* :func:`annotate_quantizers` tags the Q/DQ nodes of a graph traced inside :func:`export_mode` with their
  quantizers' names (the ONNX graph index every graph pass uses is :class:`qdq.graphs.onnx.GraphIndex`).
* :func:`export_mode` is the context manager behind it (quantizers emit Q/DQ while exporting).
* :func:`write_calibration_cache` / :func:`read_calibration_cache`: TensorRT's text calibration cache.
* :func:`strip_qdq`: the float graph of a Q/DQ graph, same tensor names (TensorRT implicit mode).
* :func:`qdq_sites` lists the quantizers of an exported graph.
* :func:`check_tensorrt`: TensorRT's explicit-quantization and strong-typing rules on any ONNX graph.
* :func:`convert_float_precision`: the TensorRT 11 export, INT8 Q/DQ with the float part in FP16/BF16;
  :func:`exact_amax` / :func:`round_scales` put PyTorch and a float32 graph on the same grid;
  :func:`compare_graphs` measures the low-precision graph against its float32 reference.

Importing this package does not import ``onnx``; the functions do, when called.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

_LAZY = {
    "export_onnx": "qdq.export.onnx_export",
    "onnx_opset": "qdq.export.onnx_export",
    "TARGETS": "qdq.export.onnx_export",
    "export_mode": "qdq.export.mode",
    "quantizer_specs": "qdq.export.mode",
    "QdqSpec": "qdq.export.mode",
    "qdq_sites": "qdq.graphs.onnx",
    "QdqSite": "qdq.graphs.onnx",
    "annotate_quantizers": "qdq.graphs.onnx",
    "write_calibration_cache": "qdq.export.calib_cache",
    "read_calibration_cache": "qdq.export.calib_cache",
    "calibration_scales": "qdq.export.calib_cache",
    "strip_qdq": "qdq.export.calib_cache",
    "rewrite_for_onnxruntime": "qdq.targets.onnxruntime.rewrite",
    "unfusable_convs": "qdq.targets.onnxruntime.passes.float_convs",
    "check_tensorrt": "qdq.export.trt_check",
    "convert_float_precision": "qdq.export.float_types",
    "exact_amax": "qdq.export.float_types",
    "round_scales": "qdq.export.float_types",
    "compare_graphs": "qdq.export.float_fidelity",
    "dynamo_translation_table": "qdq.export._ops",
    "register_torchscript_symbolic": "qdq.export._ops",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
