"""Run and time ONNX models on ONNX Runtime, OpenVINO and TensorRT behind one interface: one backend per runtime.

Example:
    >>> from qdq.runtime import get_backend, load_runtime, benchmark      # doctest: +SKIP
    >>> with load_runtime("model_int8.onnx", "onnxruntime", threads=2) as rt:
    ...     outputs = rt.run(x)
    ...     print(benchmark(rt, batch=8).median_ms)
    >>> print(get_backend("openvino").int8_coverage("model_int8.onnx").summary())

Each runtime is one :class:`Backend` (:mod:`qdq.runtime.backend`), registered by name in
:mod:`qdq.runtime_registry` and living in one package with everything qdq knows about it: :mod:`qdq.runtime.ort`
(sessions, the fusion report), :mod:`qdq.runtime.openvino` (compiled models, the runtime-precision report),
:mod:`qdq.runtime.tensorrt` (engines, the rule check before building, calibration caches). A backend opens a file
(:meth:`Backend.open`, :func:`load_runtime`), reports its int8 coverage (:meth:`Backend.int8_coverage`: a
:class:`Coverage`) and says whether it is installed (:meth:`Backend.available`). :func:`register_runtime` adds one.

The names below were importable from here before the backends got their packages and still are, from their new
homes (``qdq.runtime.ort.session``, ``qdq.runtime.ort.fusion``, ``qdq.runtime.openvino.compiled``,
``qdq.runtime.openvino.precision``, ``qdq.runtime.tensorrt.engine``); the TensorRT calibration cache functions
(from ``qdq.runtime.tensorrt.calib_cache``, formerly ``qdq.export.calib_cache``) resolve on first access.

Importing this package imports none of the runtimes' packages: ``onnxruntime``, ``openvino`` and ``tensorrt``
are imported when a model is first loaded on them.
"""

from qdq.lazy import lazy_names
from qdq.runtime.backend import (
    Backend,
    backends,
    get_backend,
    get_runtime_class,
    load_runtime,
    register_runtime,
    runtime_names,
    unregister_runtime,
)
from qdq.runtime.base import BenchmarkResult, Inputs, Runtime, import_backend
from qdq.runtime.benchmark import Comparison, SpeedUp, benchmark, benchmark_model, compare_models, results_table
from qdq.runtime.coverage import Coverage, FloatLayer
from qdq.runtime.model_info import ModelInfo, TensorSpec, random_inputs, read_model_info
from qdq.runtime.openvino import (
    LayerPrecision,
    OpenVinoRuntime,
    PrecisionReport,
    precision_report,
    supported_precisions,
)
from qdq.runtime.ort import FusionReport, OrtRuntime, UnfusedQdq, analyse_fusion, fusion_report
from qdq.runtime.tensorrt import TensorRtRuntime, build_engine

#: the TensorRT calibration cache functions (they import torch): resolved on first access
_CALIB_CACHE = ("calibration_scales", "read_calibration_cache", "strip_qdq", "write_calibration_cache")
_LAZY = dict.fromkeys(_CALIB_CACHE, "qdq.runtime.tensorrt.calib_cache")

__all__ = [
    "Backend",
    "BenchmarkResult",
    "Comparison",
    "Coverage",
    "FloatLayer",
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
    "backends",
    "benchmark",
    "benchmark_model",
    "build_engine",
    "calibration_scales",
    "compare_models",
    "fusion_report",
    "get_backend",
    "get_runtime_class",
    "import_backend",
    "load_runtime",
    "precision_report",
    "random_inputs",
    "read_calibration_cache",
    "read_model_info",
    "register_runtime",
    "results_table",
    "runtime_names",
    "strip_qdq",
    "supported_precisions",
    "unregister_runtime",
    "write_calibration_cache",
]

__getattr__, _lazy_dir = lazy_names(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_lazy_dir()})
