"""The TensorRT backend (registered as ``"tensorrt"``, alias ``"trt"``): strongly typed engines on a CUDA GPU, the
rule check they are built after, the int8 coverage the graph's Q/DQ decide, and TensorRT's calibration caches.

* :mod:`.engine`: :class:`TensorRtRuntime`, :func:`build_engine` (TensorRT >= 10, strongly typed), and
  :func:`check_rules` (TensorRT's rules, the ``rule_check`` of the target made for TensorRT, run before building);
* :mod:`.calib_cache`: TensorRT calibration caches for TensorRT <= 10's implicit quantization
  (:func:`write_calibration_cache`, :func:`read_calibration_cache`, :func:`calibration_scales`, :func:`strip_qdq`),
  moved here from ``qdq.export.calib_cache``; ``qdq.export`` still names the four functions. They import torch, so
  they are resolved on first access;
* :data:`BACKEND`: the :class:`~qdq.runtime.Backend` the registry resolves ``"tensorrt"`` to.

Under strong typing the graph decides every precision, so TensorRT's int8 coverage is read from the graph
(:meth:`TensorRtBackend.int8_coverage`: no GPU needed): a Conv / ConvTranspose / Gemm / MatMul whose two inputs are
dequantized runs in int8, any other in float. ``tensorrt`` and ``torch`` are imported when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qdq.lazy import lazy_names
from qdq.runtime.backend import Backend
from qdq.runtime.coverage import Coverage, FloatLayer
from qdq.runtime.tensorrt.engine import (
    TensorRtRuntime,
    build_engine,
    check_rules,
    network_flags,
    rule_check,
    tensorrt_version,
)
from qdq.runtime_registry import TENSORRT_RUNTIME

#: the calibration cache functions (they import torch): resolved on first access
_CALIB_CACHE = ("calibration_scales", "read_calibration_cache", "strip_qdq", "write_calibration_cache")
_LAZY = dict.fromkeys(_CALIB_CACHE, "qdq.runtime.tensorrt.calib_cache")

__all__ = [
    "BACKEND",
    "UNQUANTIZED_REASON",
    "TensorRtBackend",
    "TensorRtRuntime",
    "build_engine",
    "calibration_scales",
    "check_rules",
    "network_flags",
    "read_calibration_cache",
    "rule_check",
    "strip_qdq",
    "tensorrt_version",
    "write_calibration_cache",
]

#: why TensorRT runs a weighted op in float when the rule check names no broken rule for it
UNQUANTIZED_REASON = "neither input is dequantized: strong typing runs it in the graph's float type"


class TensorRtBackend(Backend):
    """TensorRT on a CUDA GPU: checked against its rules before building; coverage read from the graph."""

    def __init__(self) -> None:
        super().__init__(
            TENSORRT_RUNTIME.name, TensorRtRuntime, package="tensorrt",
            install="pip install tensorrt  (or: pip install 'qdq[tensorrt]')",
            description="TensorRT >= 10, strongly typed engines from Q/DQ graphs, on a CUDA GPU", compiles=True,
        )  # fmt: skip

    @property
    def rule_check(self) -> Callable[[Any], Any]:
        """TensorRT's explicit-quantization and strong-typing rules on any ONNX graph (:func:`rule_check`)."""
        return rule_check()

    def int8_coverage(self, onnx_path: str | Path, *, threads: int | None = None, **options: Any) -> Coverage:
        """TensorRT's int8 coverage of ``onnx_path``, read from the graph (no GPU, no TensorRT needed): its weighted
        ops with both inputs dequantized run in int8; each other one in float, with the rule it breaks (a weight
        or input left float, a Cast between a DQ and the op) or, for an op the graph leaves unquantized,
        :data:`UNQUANTIZED_REASON`. ``threads`` and ``options`` (load options) do not change it."""
        report = self.rule_check(onnx_path)
        broken = {v.node: v.message for v in report.violations if v.rule == "weighted-op-inputs"}
        floats = tuple(FloatLayer(name, op_type, broken.get(name, UNQUANTIZED_REASON))
                       for name, op_type in report.float_ops.items())  # fmt: skip
        return Coverage(runtime=self.name, model=report.source, int8=report.int8_ops, float_layers=floats)


#: the backend of the ``"tensorrt"`` runtime
BACKEND = TensorRtBackend()

__getattr__, _lazy_dir = lazy_names(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_lazy_dir()})
