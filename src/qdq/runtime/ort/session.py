"""ONNX Runtime's CPU sessions (:class:`OrtRuntime`), and the fusion report of a Q/DQ graph (:func:`fusion_report`).

Sessions use ``intra_op_num_threads=threads``, one inter-op thread and sequential execution, so the
thread count is the only parallelism knob and benchmarks are comparable. ``onnxruntime`` is imported
only when a session is built.

Every session comes from the one factory, :func:`qdq.graphs.onnx_session.ort_session`: a Q/DQ file whose float
part is float16 or bfloat16 (a TensorRT 11 file) runs without graph optimizations, as TensorRT computes it, and the
runtime says so (:attr:`OrtRuntime.how`). A file whose float part computes in float16 (qdq's TensorRT 11 export
records ``qdq.float``) is also loaded without three of ORT's passes (``_FLOAT16_DISABLED``), for a level asked of a
float16 file without Q/DQ: the NCHWc layout pass (ONNX Runtime 1.32 crashes the process building it for some float16
graphs, a torchvision ViT, and its NCHWc kernels are float32 ones anyway), the QDQ fusions (their kernels reject
float16 scales) and WeightBiasQuantization (it re-quantizes a float16 Conv bias).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqConfigError
from qdq.graphs.onnx_session import (
    OPTIMIZATION_LEVELS,
    UNOPTIMIZED_NOTE,
    low_precision_qdq,
    ort_session,
    session_options,
)
from qdq.runtime._text import first_line
from qdq.runtime.base import Runtime, check_common_options, import_backend
from qdq.runtime.model_info import ModelInfo, load_onnx, read_model_info
from qdq.runtime.ort.fusion import FusionReport, analyse_fusion
from qdq.runtime.saturation import saturation_safe_model
from qdq.runtime.target_check import target_advice
from qdq.runtime_registry import ORT_RUNTIME

if TYPE_CHECKING:
    import onnxruntime

__all__ = ["OPTIMIZATION_LEVELS", "OrtRuntime", "fusion_report", "inference_session", "session_options"]

#: optimizer passes left out for a float16 file: ORT 1.32 segfaults in NchwcTransformer on a float16 ViT, its
#: QDQ fusions build kernels that reject float16 scales (a QLinearConcat over a YOLOv8 head: an invalid graph), and
#: WeightBiasQuantization rewrites a float16 Conv bias as int32 on a float16 scale product, which moves the conv's
#: output far off (benchmarks/RESULTS.md, code_figures); so a float16 file (made for TensorRT 11) runs its Q/DQ
#: nodes and biases as written
_FLOAT16_DISABLED = ("NchwcTransformer", "QDQSelectorActionTransformer", "WeightBiasQuantization")


def _ort() -> Any:
    return import_backend("onnxruntime", "pip install onnxruntime")


class OrtRuntime(Runtime):
    """A model in an ONNX Runtime ``InferenceSession`` on the CPU execution provider."""

    name = ORT_RUNTIME.name

    def __init__(
        self,
        info: ModelInfo,
        session: onnxruntime.InferenceSession,
        *,
        threads: int | None,
        batch: int | None,
        optimization_level: str,
    ) -> None:
        super().__init__(info, threads=threads, batch=batch)
        self.session: onnxruntime.InferenceSession | None = session
        self.optimization_level = optimization_level
        #: int8 weights the session runs as uint8 (``load``'s ``uint8_weights``)
        self.reencoded_weights = 0

    @classmethod
    def load(
        cls,
        onnx_path: str | Path,
        *,
        threads: int | None = None,
        batch: int | None = None,
        optimization_level: str = "all",
        uint8_weights: bool | None = None,
    ) -> OrtRuntime:
        """Create a CPU session for ``onnx_path``.

        Args:
            onnx_path: the ONNX file.
            threads: intra-op threads (None: ORT's default, one per physical core).
            batch: recorded only; ORT sessions accept any batch the graph allows.
            optimization_level: "disable", "basic", "extended", "layout" or "all" (default).
            uint8_weights: run int8 Conv/Gemm/MatMul weights as uint8 (zero point + 128: the same values,
                ORT's exact U8U8 kernels; the file is not changed). None (default): when this CPU's int8 dot
                products saturate (:func:`qdq.cpu.int8_dot_saturates`: x86 without VNNI), where the U8S8
                kernels would compute wrong results. ``reencoded_weights`` tells how many were re-encoded.
        """
        check_common_options(threads, batch)
        info = read_model_info(onnx_path)
        advice = _advice(info, threads, optimization_level, uint8_weights)
        options = session_options(threads=threads, optimization_level=optimization_level)
        source, reencoded = _session_source(info.path, uint8_weights)
        session = _create_session(info.path, options, source, _disabled_passes(info))
        low = low_precision_qdq(load_onnx(info.path, external_data=False))
        level = "disable" if low is not None else optimization_level
        runtime = cls(info, session, threads=threads, batch=batch, optimization_level=level)
        runtime.reencoded_weights = reencoded
        runtime.advice = advice
        runtime.how = UNOPTIMIZED_NOTE.format(type=low) if low is not None else None
        return runtime

    @property
    def precision(self) -> str:
        """``"int8"`` for a Q/DQ graph, else the float type of the graph (``"fp32"``...)."""
        return self.info.precision

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        assert self.session is not None  # callers check _ensure_open() first
        try:
            return list(self.session.run(None, feed))
        except _ort_errors() as err:
            message = " ".join(str(err).split())
            raise QdqConfigError(f"onnxruntime cannot run {self.path.name}: {message}") from None

    def _release(self) -> None:
        # Dropping the last reference destroys the session and its thread pool.
        self.session = None


def fusion_report(
    onnx_path: str | Path,
    *,
    threads: int | None = None,
    optimization_level: str = "all",
    uint8_weights: bool | None = None,
) -> FusionReport:
    """Build a session for ``onnx_path``, save ORT's optimized graph, and report what it fused.

    The optimized graph is written to a temporary directory (``optimized_model_filepath``) and
    deleted afterwards. See :mod:`qdq.runtime.ort.fusion` for how the report is read. ``uint8_weights`` as in
    :meth:`OrtRuntime.load`: the graph reported is the one a runtime would run.
    """
    check_common_options(threads, None)
    path = Path(onnx_path)
    reencoded, _ = saturation_safe_model(path, uint8_weights, ORT_RUNTIME)
    source = reencoded or load_onnx(path)
    with tempfile.TemporaryDirectory(prefix="qdq-ort-") as tmp:
        optimized_path = str(Path(tmp) / "optimized.onnx")
        options = session_options(
            threads=threads, optimization_level=optimization_level, optimized_model_path=optimized_path
        )
        source_bytes = None if reencoded is None else reencoded.SerializeToString()
        session = _create_session(path, options, source_bytes, _disabled_passes(read_model_info(path)))
        del session
        optimized = load_onnx(optimized_path, external_data=False)
    return analyse_fusion(source, optimized, model=path.name, optimization_level=optimization_level)


def inference_session(
    onnx_path: str | Path,
    options: onnxruntime.SessionOptions | None = None,
    *,
    uint8_weights: bool | None = None,
) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session for ``onnx_path`` (``options``: :func:`session_options` by default), with
    its int8 weights run as uint8 where this CPU needs it (``uint8_weights`` as in :meth:`OrtRuntime.load`)."""
    path = Path(onnx_path)
    source, _ = _session_source(path, uint8_weights)
    return _create_session(path, options or session_options(), source, _disabled_passes(read_model_info(path)))


#: ORT's float kernels of a Conv (``com.microsoft.nchwc:Conv`` counts as ``Conv``)
_FLOAT_CONVS = frozenset({"Conv", "FusedConv", "NhwcFusedConv"})


def _advice(info: ModelInfo, threads: int | None, optimization_level: str, uint8_weights: bool | None) -> str | None:
    """The file's target's caveat for ONNX Runtime, with how many of its Convs ORT's optimized graph leaves float."""
    advice = target_advice(info, ORT_RUNTIME)
    if advice is None:
        return None
    report = fusion_report(info.path, threads=threads, optimization_level=optimization_level,
                           uint8_weights=uint8_weights)  # fmt: skip
    floats = sum(layer.op_type in _FLOAT_CONVS for layer in report.float_layers)
    return f"{floats} of {report.source_ops.get('Conv', 0)} Convs run in float on ONNX Runtime. {advice}"


def _session_source(path: Path, uint8_weights: bool | None) -> tuple[str | bytes, int]:
    """What the session loads: the file, or its bytes with the saturating weights as uint8; and how many."""
    model, count = saturation_safe_model(path, uint8_weights, ORT_RUNTIME)
    return (str(path), 0) if model is None else (model.SerializeToString(), count)


def _disabled_passes(info: ModelInfo) -> tuple[str, ...]:
    """ORT optimizer passes to leave out for this file (see the module doc)."""
    return _FLOAT16_DISABLED if info.float_type == "float16" else ()


def _create_session(
    path: Path,
    options: onnxruntime.SessionOptions,
    source: str | bytes | None = None,
    disabled: tuple[str, ...] = (),
) -> onnxruntime.InferenceSession:
    _ort()
    try:
        return ort_session(source or path, options, disabled_optimizers=disabled)
    except _ort_errors() as err:
        raise QdqConfigError(f"onnxruntime cannot load {path}: {first_line(err)}") from None


def _ort_errors() -> tuple[type[Exception], ...]:
    errors = _ort().capi.onnxruntime_pybind11_state
    names = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoSuchFile", "NotImplemented")
    return tuple(getattr(errors, n) for n in names if hasattr(errors, n))
