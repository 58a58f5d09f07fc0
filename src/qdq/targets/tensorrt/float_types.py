"""The low-precision export of a Q/DQ graph for TensorRT 11: INT8 where quantized, FP16/BF16 elsewhere.

TensorRT 11 builds every network strongly typed: INT8 exists only as Q/DQ nodes and FP16/BF16 only as the
types written in the ONNX file. :func:`convert_float_precision` turns a float32 Q/DQ graph (the
``"tensorrt"`` target's export) into one whose float part computes in ``float16`` or ``bfloat16``; the
``"tensorrt"`` target's export does the same when asked (``target_options={"float": "float16"}``,
:mod:`qdq.targets.tensorrt.rewrite`). In order:

1. the opset is raised to 19 (FP16 Q/DQ scales) or 22 (BF16 Conv/Gemm/MatMul) when lower;
2. every quantization step becomes a number of the low type, and quantized weights become int8 codes
   computed with those steps (:mod:`.float_scales`);
3. which nodes must stay FP32 is decided (:mod:`.float_ranges`): the op types of
   :data:`~qdq.targets.tensorrt.check.FP32_OPS`, and nodes whose values overflow or underflow the low type on
   the calibration data (when given);
4. every other node computes in the low type, each DequantizeLinear outputs the type its readers compute in,
   so no Cast stands between a DQ and its int8 consumer; the graph's inputs and outputs stay float32 (Casts at
   the edges) unless ``keep_io_types=False`` (:mod:`.float_rewrite`).

The file records what was done (model metadata): ``qdq.float`` (the type), ``qdq.float.fp32_nodes`` (JSON
``{node: why it stays FP32}``, which the TensorRT checker accepts as FP32 on purpose) and ``qdq.float.report``
(JSON counts); :func:`read_float_record` reads them back. ``float32`` returns the graph unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdq.errors import QdqConfigError, QdqExportError
from qdq.graphs.onnx import atomic_save, set_metadata
from qdq.graphs.onnx_types import LOW_PRECISION, default_opset, parse_float_type
from qdq.markdown import markdown_table
from qdq.targets.tensorrt.check import FP32_OPS
from qdq.targets.tensorrt.engine_rules.facts import FP32_NODES_KEY
from qdq.targets.tensorrt.float_ranges import Batch, keep_fp32_reasons, measure_ranges
from qdq.targets.tensorrt.float_rewrite import TypeRewrite
from qdq.targets.tensorrt.float_scales import fold_weights, round_graph_scales

__all__ = [
    "FLOAT_KEY",
    "FP32_NODES_KEY",
    "REPORT_KEY",
    "FloatConversion",
    "convert_float_precision",
    "convert_in_place",
    "read_float_record",
]

_log = logging.getLogger(__name__)
_MIN_OPSET = {"float16": 19, "bfloat16": 22}  # fp16/bf16 Q/DQ scales: 19; bf16 Conv/Gemm/MatMul: 22
#: Model metadata key holding the float type the graph computes in.
FLOAT_KEY = "qdq.float"
#: Model metadata key holding the conversion's counts (JSON, :meth:`FloatConversion.record`).
REPORT_KEY = "qdq.float.report"


@dataclass
class FloatConversion:
    """What :func:`convert_float_precision` did.

    Attributes:
        model: the converted ``onnx.ModelProto``.
        float_type: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        fp32_nodes: node name -> why it stays FP32.
        converted: nodes that compute in the low type; ``casts``: Cast nodes added.
        scale_changes: quantizer -> largest relative change of its step from rounding it to the low type (0
            for a model whose quantizers already have low-precision steps).
        fp32_sites: quantizers whose step has no low-precision value (their readers stay FP32).
        folded_weights: weights stored as int8 codes; ``measured``: whether calibration data was used.
    """

    model: Any
    float_type: str
    fp32_nodes: dict[str, str] = field(default_factory=dict)
    converted: int = 0
    casts: int = 0
    scale_changes: dict[str, float] = field(default_factory=dict)
    fp32_sites: list[str] = field(default_factory=list)
    folded_weights: int = 0
    measured: bool = False

    @property
    def largest_step_change(self) -> float:
        """The largest relative change of a step from rounding it to the low type."""
        return max(self.scale_changes.values(), default=0.0)

    def record(self) -> dict[str, Any]:
        """What the file records (``qdq.float.report``) and a job summary shows, JSON-ready."""
        return {
            "float_type": self.float_type,
            "converted_nodes": self.converted,
            "casts": self.casts,
            "fp32_nodes": dict(self.fp32_nodes),
            "fp32_quantizers": list(self.fp32_sites),
            "int8_weights": self.folded_weights,
            "ranges_measured": self.measured,
            "largest_step_change": self.largest_step_change,
        }

    def __str__(self) -> str:
        lines = [
            f"{self.float_type} export: {self.converted} nodes compute in {self.float_type}, {len(self.fp32_nodes)} "
            f"stay FP32, {self.casts} Casts added, {self.folded_weights} weights stored as int8; quantization "
            f"steps rounded to {self.float_type}: {len(self.scale_changes)} quantizers, largest relative change "
            f"{self.largest_step_change:.2e}" + ("" if self.measured else "; no calibration data: value ranges not "
                                                 "measured"),
        ]  # fmt: skip
        if self.fp32_nodes:
            rows = [[name, reason] for name, reason in self.fp32_nodes.items()]
            lines += ["", markdown_table(["node kept in FP32", "why"], rows)]
        return "\n".join(lines)


def _load(model_or_path: Any) -> Any:
    import onnx

    if isinstance(model_or_path, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model_or_path)
        return copy
    path = Path(model_or_path)
    if not path.is_file():
        raise QdqConfigError(f"{str(path)!r} is not a file.")
    return onnx.load(str(path))


def convert_float_precision(
    model_or_path: Any,
    float_type: str = "float16",
    *,
    calibration_data: Iterable[Batch] | None = None,
    keep_io_types: bool = True,
    data_max: float = 512.0,
    fp32_ops: Iterable[str] = FP32_OPS,
    fp32_nodes: Iterable[str] = (),
    path: str | Path | None = None,
) -> FloatConversion:
    """Convert a float32 (Q/DQ) ONNX graph to compute in ``float_type`` outside its quantized ops.

    Args:
        model_or_path: the graph (``onnx.ModelProto``, not modified, or a path), e.g. a ``"tensorrt"`` export.
        float_type: ``"float16"`` / ``"fp16"``, ``"bfloat16"`` / ``"bf16"``, or ``"float32"`` (unchanged).
        calibration_data: input batches to measure value ranges on (:data:`~.float_ranges.Batch`: arrays or
            tensors, tuples of them for several inputs, or dicts input name -> array); None skips the
            overflow/underflow rules.
        keep_io_types: keep the graph's float inputs and outputs float32 (Casts at the edges).
        data_max: largest absolute value a node's inputs and outputs may reach to compute in the low type.
        fp32_ops: op types that always compute in FP32; ``fp32_nodes``: node names kept in FP32.
        path: write the converted graph there (atomically) when given.

    Returns:
        A :class:`FloatConversion` (``.model`` is the converted graph; ``str()`` lists what stays FP32).

    Raises:
        QdqConfigError: an unknown float type or unusable calibration data.
        QdqExportError: the opset cannot be raised to the one the type needs, or the result fails
            ``onnx.checker``.
    """
    import onnx

    model = _load(model_or_path)
    result = convert_in_place(model, float_type, calibration_data=calibration_data, keep_io_types=keep_io_types,
                              data_max=data_max, fp32_ops=fp32_ops, fp32_nodes=fp32_nodes)  # fmt: skip
    if result.float_type != "float32":
        try:
            onnx.checker.check_model(model, full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            raise QdqExportError(f"the {result.float_type} graph fails onnx.checker: {err}") from err
        _log.info("%s", result)
    if path is not None:
        atomic_save(model, Path(path))
    return result


def convert_in_place(
    model: Any,
    float_type: str,
    *,
    calibration_data: Iterable[Batch] | None = None,
    keep_io_types: bool = True,
    data_max: float = 512.0,
    fp32_ops: Iterable[str] = FP32_OPS,
    fp32_nodes: Iterable[str] = (),
) -> FloatConversion:
    """:func:`convert_float_precision` on ``model`` (an ``onnx.ModelProto``) itself, without the final
    ``onnx.checker`` run (the caller runs it: the export's :func:`~qdq.export.onnx_export.finish_onnx`)."""
    kind = parse_float_type(float_type)
    result = FloatConversion(model=model, float_type=kind)
    if kind == "float32":
        return result
    low = LOW_PRECISION[kind]
    _raise_opset(model, _MIN_OPSET[kind])
    result.scale_changes, result.fp32_sites = round_graph_scales(model, kind)
    result.folded_weights = fold_weights(model)
    ranges = measure_ranges(model, calibration_data) if calibration_data is not None else None
    result.measured = ranges is not None
    reasons = keep_fp32_reasons(model, low, ranges=ranges, data_max=data_max, fp32_ops=fp32_ops,
                                fp32_nodes=fp32_nodes)  # fmt: skip
    rewrite = TypeRewrite(model, low, reasons, set(result.fp32_sites))
    rewrite.run(keep_io_types)
    result.fp32_nodes = dict(rewrite.reasons)
    result.converted, result.casts = rewrite.converted, rewrite.casts
    set_metadata(model, FLOAT_KEY, kind)
    set_metadata(model, FP32_NODES_KEY, json.dumps(result.fp32_nodes, sort_keys=True))
    set_metadata(model, REPORT_KEY, json.dumps(result.record(), sort_keys=True))
    return result


def read_float_record(model_or_path: Any) -> dict[str, Any] | None:
    """What a low-precision export recorded in the file (:meth:`FloatConversion.record`), or None for a file
    that computes in float32 (or was not written by qdq)."""
    import onnx

    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(
        str(model_or_path), load_external_data=False)  # fmt: skip
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(FLOAT_KEY, "float32") == "float32":
        return None
    try:
        return dict(json.loads(meta.get(REPORT_KEY, "{}")), float_type=meta[FLOAT_KEY])
    except json.JSONDecodeError:
        return {"float_type": meta[FLOAT_KEY]}


def _raise_opset(model: Any, minimum: int) -> None:
    from onnx import version_converter

    if default_opset(model) >= minimum:
        return
    try:
        model.CopyFrom(version_converter.convert_version(model, minimum))
    except Exception as err:
        raise QdqExportError(
            f"the graph has opset {default_opset(model)}; low-precision Q/DQ scales need opset >= {minimum} and "
            f"onnx's version converter failed ({type(err).__name__}: {err}). Export with opset={minimum}."
        ) from err
