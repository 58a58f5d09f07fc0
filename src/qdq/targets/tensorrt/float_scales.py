"""Quantization steps and weights of a Q/DQ graph made ready for a low-precision (FP16/BF16) float part.

A DequantizeLinear that outputs FP16 has an FP16 scale (TensorRT: a DQ outputs its scale's type), so every
step becomes a number of the low type: :func:`round_graph_scales` rounds each float32 step to the nearest one
(relative change up to 2**-11 for a normal FP16 step, more for a step below 6.1e-5, subnormal in FP16; BF16:
up to 2**-8). A PyTorch model whose quantizers have the same ``step_type`` (``QuantConfig(target="tensorrt",
target_options={"float": "float16"})``) has those steps already: the rounding changes nothing then.

:func:`fold_weights` stores each quantized weight as int8 codes (a DequantizeLinear of an int8 initializer,
which TensorRT takes as pre-quantized weights), computed with the rounded steps, so weights are never rounded
to FP16 before quantization; a weight Transpose after its DQ (dynamo's Linear) is folded into the codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const, const_input, name_of, only_readers, remove, single_reader, tidy
from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_tags import quantizer_names
from qdq.graphs.onnx_types import numpy_float_type, parse_float_type

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["fold_weights", "round_graph_scales", "round_scales"]


def round_scales(model: Any, float_type: str = "float16") -> Any:
    """A copy of ``model`` whose Q/DQ steps are rounded to the nearest ``float_type`` number (kept float32).

    The float32 graph then quantizes exactly like its low-precision conversion (and like a PyTorch model whose
    quantizers have that ``step_type``): compared with the conversion, what differs is low-precision arithmetic
    alone. Steps that round to 0 or infinity stay as they were.
    """
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))
    round_graph_scales(copy, parse_float_type(float_type))
    return copy


def round_graph_scales(model: Any, float_type: str) -> tuple[dict[str, float], list[str]]:
    """Round every Q/DQ scale of ``model`` in place; ``({quantizer: relative change}, [unrepresentable])``.

    A quantizer one of whose steps rounds to 0 or infinity keeps all its steps (it is "unrepresentable": the
    conversion keeps its Q/DQ and their readers in FP32)."""
    return on_ir(model, lambda ir_model: _round_scales(ir_model.graph, numpy_float_type(float_type)))[0]


def _round_scales(graph: ir.Graph, kind: Any) -> tuple[dict[str, float], list[str]]:
    changes: dict[str, float] = {}
    unrepresentable: list[str] = []
    done: set[ir.Value] = set()
    for node in [n for n in graph if n.op_type in ("QuantizeLinear", "DequantizeLinear")]:
        value, scale = node.inputs[1], const_input(node, 1)
        owner = ",".join(quantizer_names(node)) or node.name or ""
        if value is None or scale is None or value in done:
            continue
        with np.errstate(over="ignore"):  # a step beyond the type's range is unrepresentable: said below
            rounded = scale.astype(np.float32).astype(kind).astype(np.float32)
        if not np.all(np.isfinite(rounded) & (rounded > 0)):
            unrepresentable.append(owner)
            continue
        done.add(value)
        change = float(np.max(np.abs(rounded.astype(np.float64) - scale) / scale))
        changes[owner] = max(change, changes.get(owner, 0.0))
        _set_const(value, rounded.reshape(scale.shape))
    return changes, unrepresentable


def _set_const(value: ir.Value, array: np.ndarray) -> None:
    """Store ``array`` as the constant ``value`` holds: an initializer's tensor or a ``Constant`` node's."""
    import onnx_ir as ir

    tensor = ir.tensor(array, name=value.name)
    if value.const_value is not None:
        value.const_value = tensor
    elif (constant := value.producer()) is not None:
        constant.attributes["value"] = ir.AttrTensor("value", tensor)


def fold_weights(model: Any) -> int:
    """Store each Q/DQ-quantized constant weight as int8 codes read by its DQ; fold a Transpose after it."""
    return on_ir(model, _fold_weights)[0]


def _fold_weights(model: ir.Model) -> int:
    graph = model.graph
    doomed: list[ir.Node] = []
    folded = 0
    for q in [n for n in graph if n.op_type == "QuantizeLinear"]:
        weight = const(q.inputs[0])
        dqs = only_readers(q.outputs[0], ["DequantizeLinear"]) if weight is not None else None
        if weight is None or dqs is None or any(dq.graph is not graph for dq in dqs):
            continue
        scale, zero = const_input(q, 1), const_input(q, 2)
        if scale is None or zero is None or zero.dtype != np.int8:
            continue
        codes = _codes(weight.astype(np.float32), scale.astype(np.float32), zero, attr(q, "axis", 1))
        stored = add_const(graph, f"{name_of(q.inputs[0])}_int8", codes)
        for dq in dqs:
            dq.replace_input_with(0, stored)
            _fold_transpose(graph, dq, codes, doomed)
        doomed.append(q)
        folded += 1
    remove(graph, doomed)
    tidy(model)
    return folded


def _codes(weight: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear of ``weight`` to int8 (division, round half to even, saturate)."""
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * weight.ndim
        shape[axis % weight.ndim] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    q = np.rint(np.divide(weight, scale, dtype=np.float32)) + zero.astype(np.float32)
    return np.clip(q, -128, 127).astype(np.int8)


def _fold_transpose(graph: ir.Graph, dq: ir.Node, codes: np.ndarray, doomed: list[ir.Node]) -> None:
    """DQ(int8) -> Transpose(perm) -> weighted ops becomes DQ(transposed int8), axis mapped through perm."""
    import onnx_ir as ir

    transpose = single_reader(dq.outputs[0])
    if transpose is None or transpose.op_type != "Transpose" or transpose.graph is not graph:
        return
    perm = attr(transpose, "perm")
    if perm is None or only_readers(transpose.outputs[0], ("MatMul", "Gemm")) is None:
        return
    transposed = np.ascontiguousarray(codes.transpose(perm))
    dq.replace_input_with(0, add_const(graph, f"{name_of(dq.inputs[0])}_t", transposed))
    dq.attributes["axis"] = ir.AttrInt64("axis", list(perm).index(attr(dq, "axis", 1) % codes.ndim))
    out, written = transpose.outputs[0], dq.outputs[0]
    out.replace_all_uses_with(written)
    written.name, written.type, written.shape = out.name, out.type, out.shape  # what the Transpose wrote
    doomed.append(transpose)
