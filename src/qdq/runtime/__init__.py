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

What a user calls is here; what belongs to one runtime lives in its package, one level down:
``qdq.runtime.ort`` (``OrtRuntime``, ``fusion_report``, ``FusionReport``...), ``qdq.runtime.openvino``
(``OpenVinoRuntime``, ``precision_report``, ``supported_precisions``...), ``qdq.runtime.tensorrt``
(``TensorRtRuntime``, ``build_engine``, the calibration cache functions); reading one of those names here says
where it went.

Importing this package imports none of the runtimes' packages: ``onnxruntime``, ``openvino`` and ``tensorrt``
are imported when a model is first loaded on them.
"""

from qdq.lazy import lazy_names
from qdq.runtime.backend import (
    Backend,
    backends,
    get_backend,
    load_runtime,
    register_runtime,
    runtime_names,
    unregister_runtime,
)
from qdq.runtime.base import BenchmarkResult, Runtime
from qdq.runtime.benchmark import Comparison, SpeedUp, benchmark, benchmark_model, compare_models, results_table
from qdq.runtime.coverage import Coverage, FloatLayer
from qdq.runtime.model_info import ModelInfo, TensorSpec, random_inputs, read_model_info

__all__ = [
    "Backend",
    "BenchmarkResult",
    "Comparison",
    "Coverage",
    "FloatLayer",
    "ModelInfo",
    "Runtime",
    "SpeedUp",
    "TensorSpec",
    "backends",
    "benchmark",
    "benchmark_model",
    "compare_models",
    "get_backend",
    "load_runtime",
    "random_inputs",
    "read_model_info",
    "register_runtime",
    "results_table",
    "runtime_names",
    "unregister_runtime",
]

#: names that were exported here and live one level down: reading ``qdq.runtime.<name>`` says where
_ORT = ("OrtRuntime", "FusionReport", "UnfusedQdq", "analyse_fusion", "fusion_report")
_OPENVINO = ("OpenVinoRuntime", "LayerPrecision", "PrecisionReport", "precision_report", "supported_precisions")
_TENSORRT = ("TensorRtRuntime", "build_engine", "calibration_scales", "read_calibration_cache", "strip_qdq",
             "write_calibration_cache")  # fmt: skip
_MOVED = {
    **dict.fromkeys(_ORT, "qdq.runtime.ort"),
    **dict.fromkeys(_OPENVINO, "qdq.runtime.openvino"),
    **dict.fromkeys(_TENSORRT, "qdq.runtime.tensorrt"),
    **dict.fromkeys(("Inputs", "import_backend"), "qdq.runtime.base"),
    "get_runtime_class": "qdq.runtime.backend",
}

__getattr__, _lazy_dir = lazy_names(__name__, {}, moved=_MOVED)


def __dir__() -> list[str]:
    return sorted({*globals(), *_lazy_dir()})
