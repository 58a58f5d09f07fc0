"""The ONNX Runtime backend (registered as ``"onnxruntime"``, alias ``"ort"``): CPU sessions, the fusion report,
and the int8 coverage read from ORT's optimized graph.

* :mod:`.session`: :class:`OrtRuntime` (a CPU ``InferenceSession``), :func:`fusion_report` (the optimized graph
  ORT saved, read by :mod:`.fusion`), :func:`session_options`, :func:`inference_session`;
* :mod:`.fusion`: :class:`FusionReport`: which weighted ops ORT runs in int8 kernels, which stay in float kernels
  and why, and why each leftover Q/DQ node stayed (read with the fusion facts of the target made for ORT);
* :data:`BACKEND`: the :class:`~qdq.runtime.Backend` the registry resolves ``"onnxruntime"`` to.

``onnxruntime`` is imported when a session is first built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qdq.runtime.backend import Backend
from qdq.runtime.coverage import Coverage
from qdq.runtime.ort.fusion import FusionReport, UnfusedQdq, analyse_fusion, ort_fusion_facts
from qdq.runtime.ort.session import OPTIMIZATION_LEVELS, OrtRuntime, fusion_report, inference_session, session_options
from qdq.runtime_registry import ORT_RUNTIME

__all__ = [
    "BACKEND",
    "OPTIMIZATION_LEVELS",
    "FusionReport",
    "OrtBackend",
    "OrtRuntime",
    "UnfusedQdq",
    "analyse_fusion",
    "fusion_report",
    "inference_session",
    "ort_fusion_facts",
    "session_options",
]


class OrtBackend(Backend):
    """ONNX Runtime's CPU provider: its coverage and report are the fusion report of the optimized graph."""

    def __init__(self) -> None:
        super().__init__(
            ORT_RUNTIME.name, OrtRuntime, package="onnxruntime", install="pip install onnxruntime",
            description="ONNX Runtime, CPU execution provider (QLinearConv, QGemm, ... int8 kernels)",
            block_weight_bits=(8, 4),
        )  # fmt: skip

    def int8_coverage(  # type: ignore[override]  # its runtime's load options by name; the base takes any
        self,
        onnx_path: str | Path,
        *,
        threads: int | None = None,
        optimization_level: str = "all",
        uint8_weights: bool | None = None,
    ) -> Coverage:
        """ORT's int8 coverage of ``onnx_path`` (options as :meth:`OrtRuntime.load`): :meth:`FusionReport.coverage`."""
        return fusion_report(
            onnx_path, threads=threads, optimization_level=optimization_level, uint8_weights=uint8_weights
        ).coverage()

    def report(
        self, onnx_path: str | Path, *, threads: int | None = None, batch: int | None = None, **options: Any
    ) -> FusionReport:
        """The fusion report of ``onnx_path`` (``batch`` is ignored: a session takes any batch)."""
        return fusion_report(onnx_path, threads=threads, **options)


#: the backend of the ``"onnxruntime"`` runtime
BACKEND = OrtBackend()
