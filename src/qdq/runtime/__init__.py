"""Run and time ONNX models on ONNX Runtime, OpenVINO and TensorRT behind one interface.

Example:
    >>> from qdq.runtime import load_runtime, benchmark              # doctest: +SKIP
    >>> with load_runtime("model_int8.onnx", "onnxruntime", threads=2) as rt:
    ...     outputs = rt.run(x)
    ...     print(benchmark(rt, batch=8).median_ms)

Importing this package imports none of the backends: ``onnxruntime``, ``openvino`` and ``tensorrt``
are imported when a model is first loaded on them.
"""

from qdq.runtime.base import (
    BenchmarkResult,
    Inputs,
    Runtime,
    get_runtime_class,
    import_backend,
    load_runtime,
    register_runtime,
    runtime_names,
)
from qdq.runtime.benchmark import Comparison, SpeedUp, benchmark, benchmark_model, compare_models, results_table
from qdq.runtime.fusion import FusionReport, UnfusedQdq, analyse_fusion
from qdq.runtime.model_info import ModelInfo, TensorSpec, random_inputs, read_model_info
from qdq.runtime.openvino import OpenVinoRuntime, precision_report, supported_precisions
from qdq.runtime.ort import OrtRuntime, fusion_report
from qdq.runtime.ov_precision import LayerPrecision, PrecisionReport
from qdq.runtime.tensorrt import TensorRtRuntime, build_engine

__all__ = [
    "BenchmarkResult",
    "Comparison",
    "FusionReport",
    "Inputs",
    "LayerPrecision",
    "ModelInfo",
    "OpenVinoRuntime",
    "OrtRuntime",
    "PrecisionReport",
    "Runtime",
    "SpeedUp",
    "TensorRtRuntime",
    "TensorSpec",
    "UnfusedQdq",
    "analyse_fusion",
    "benchmark",
    "benchmark_model",
    "build_engine",
    "compare_models",
    "fusion_report",
    "get_runtime_class",
    "import_backend",
    "load_runtime",
    "precision_report",
    "random_inputs",
    "read_model_info",
    "register_runtime",
    "results_table",
    "runtime_names",
    "supported_precisions",
]
