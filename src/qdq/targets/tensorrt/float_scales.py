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

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute, set_axis, tidy
from qdq.graphs.onnx_tags import quantizer_names
from qdq.graphs.onnx_types import numpy_float_type, parse_float_type

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
    from onnx import numpy_helper

    kind = numpy_float_type(float_type)
    index = GraphIndex(model)
    changes: dict[str, float] = {}
    unrepresentable: list[str] = []
    done: set[str] = set()
    for node in [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]:
        name = node.input[1]
        scale = index.array(name)
        owner = ",".join(quantizer_names(node)) or node.name
        if scale is None or name in done:
            continue
        with np.errstate(over="ignore"):  # a step beyond the type's range is unrepresentable: said below
            rounded = scale.astype(np.float32).astype(kind).astype(np.float32)
        if not np.all(np.isfinite(rounded) & (rounded > 0)):
            unrepresentable.append(owner)
            continue
        done.add(name)
        change = float(np.max(np.abs(rounded.astype(np.float64) - scale) / scale))
        changes[owner] = max(change, changes.get(owner, 0.0))
        index.constants[name].CopyFrom(numpy_helper.from_array(rounded.reshape(scale.shape), name))
    return changes, unrepresentable


def fold_weights(model: Any) -> int:
    """Store each Q/DQ-quantized constant weight as int8 codes read by its DQ; fold a Transpose after it."""
    from onnx import numpy_helper

    index = GraphIndex(model)
    doomed: list[Any] = []
    folded = 0
    for q in list(model.graph.node):
        weight = index.array(q.input[0]) if q.op_type == "QuantizeLinear" else None
        readers = index.consumers.get(q.output[0], []) if weight is not None else []
        if weight is None or not readers or any(r.op_type != "DequantizeLinear" for r in readers):
            continue
        scale, zero = index.const_input(q, 1), index.const_input(q, 2)
        if scale is None or zero is None or zero.dtype != np.int8:
            continue
        codes = _codes(weight.astype(np.float32), scale.astype(np.float32), zero, attribute(q, "axis", 1))
        name = index.unique(f"{q.input[0]}_int8")
        model.graph.initializer.append(numpy_helper.from_array(codes, name))
        for dq in readers:
            dq.input[0] = name
            _fold_transpose(index, dq, codes, doomed)
        doomed.append(q)
        folded += 1
    index.remove(doomed)
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


def _fold_transpose(index: GraphIndex, dq: Any, codes: np.ndarray, doomed: list[Any]) -> None:
    """DQ(int8) -> Transpose(perm) -> weighted ops becomes DQ(transposed int8), axis mapped through perm."""
    from onnx import numpy_helper

    readers = index.consumers.get(dq.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Transpose" or dq.output[0] in index.outputs:
        return
    transpose = readers[0]
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    after = index.consumers.get(transpose.output[0], [])
    if perm is None or not after or any(r.op_type not in ("MatMul", "Gemm") for r in after):
        return
    name = index.unique(f"{dq.input[0]}_t")
    index.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(codes.transpose(perm)), name))
    dq.input[0] = name
    set_axis(dq, perm.index(attribute(dq, "axis", 1) % codes.ndim))
    dq.output[0] = transpose.output[0]
    doomed.append(transpose)
