"""TensorRT's rules for the Q/DQ nodes themselves: pairs, shared parameters, int8, symmetric, constant scales.

* ``qdq-pair`` — every QuantizeLinear is read by DequantizeLinear nodes only, and a DequantizeLinear reads a
  QuantizeLinear or a constant (pre-quantized weights). Developer guide, "Explicit Quantization" (Q/DQ pairs
  from fake quantization; "When using pre-quantized weights, an IDequantizeLayer is required between the
  weights and the linear operator").
* ``pair-params`` — a Q and the DQ reading it share scale, zero point and axis (a pair is one fake
  quantization; the guide's Q/DQ propagation and fusion assume the DQ undoes its Q).
* ``int8-type`` — the quantized type is one TensorRT supports: INT8 (or INT4, FP8 E4M3, FP4 E2M1); never UINT8,
  which a missing zero point means in ONNX. "Working with Quantized Types" (supported data types;
  symmetric scheme); operator reference "Quantize"/"Dequantize" (output T3: int8, float8, int4).
* ``zero-point`` — every zero point is 0. Operators "Quantize"/"Dequantize": "The zero_point must only
  contain zero-valued coefficients".
* ``scale`` — the scale is a build-time constant, positive and finite, a scalar (per tensor) or 1-D (per
  channel, one value per element of ``axis``), with a zero point of the same shape; per-channel needs opset
  13 (the ``axis`` attribute). Operators "Quantize"/"Dequantize"; developer guide §"ONNX Support".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import attr, name_of, source
from qdq.graphs.onnx_types import type_name
from qdq.targets.tensorrt.engine_rules.facts import DQ, GraphFacts, Q, Rule, Violation, brief, same_values

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["RULES", "uint8_nodes"]

_QUANT_TYPES = frozenset({3, 17, 22, 23})  # INT8, FLOAT8E4M3FN, INT4, FLOAT4E2M1 (onnx.TensorProto)
_UINT8 = 2


def _qdq_pairs(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type == Q:
            readers, output = f.readers(node.outputs[0]), f.is_output(node.outputs[0])
            if output:
                yield Violation("qdq-pair", f.name(node), "its quantized output is a graph output; follow it by a DQ")
            if not readers and not output:
                yield Violation("qdq-pair", f.name(node), "nothing reads it: a Q without its DQ")
            for reader in readers:
                if reader.op_type != DQ:
                    yield Violation(
                        "qdq-pair",
                        f.name(node),
                        f"its quantized output is read by {reader.op_type} {f.name(reader)}, not by a DequantizeLinear",
                    )
        elif node.op_type == DQ:
            producer = source(node.inputs[0])
            if producer is not None and producer.op_type not in (Q, "Constant"):
                yield Violation(
                    "qdq-pair",
                    f.name(node),
                    f"reads {producer.op_type} {f.name(producer)}: a DQ must "
                    "read a QuantizeLinear or a constant (pre-quantized weights)",
                )


def _pair_params(f: GraphFacts) -> Iterator[Violation]:
    for dq in f.nodes:
        q = f.q_of(dq) if dq.op_type == DQ else None
        if q is None:
            continue
        s_q, s_dq = f.scale(q), f.scale(dq)
        z_q, z_dq = f.zero_point(q), f.zero_point(dq)
        if s_q is not None and s_dq is not None and not same_values(s_q, s_dq):
            yield Violation(
                "pair-params",
                f.name(dq),
                f"its scale differs from its Q's ({f.name(q)}): {brief(s_dq)} vs {brief(s_q)}",
            )
        if not same_values(z_q, z_dq):
            yield Violation("pair-params", f.name(dq), f"its zero point differs from its Q's ({f.name(q)})")
        if f.per_channel(s_dq) and f.axis(q) != f.axis(dq):
            yield Violation("pair-params", f.name(dq), f"axis {f.axis(dq)} differs from its Q's axis {f.axis(q)}")


def _int8_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in (Q, DQ):
            continue
        quantized = _quantized_type(f, node)
        if quantized is None:
            continue
        if quantized == _UINT8 and len(node.inputs) < 3:
            yield Violation(
                "int8-type",
                f.name(node),
                "no zero point: ONNX then quantizes to UINT8, which TensorRT "
                "does not support; add an int8 zero point 0",
            )
        elif quantized not in _QUANT_TYPES:
            yield Violation(
                "int8-type",
                f.name(node),
                f"quantizes to {type_name(quantized)}; TensorRT supports INT8 (and INT4, FP8 E4M3, FP4 E2M1)",
            )


def uint8_nodes(f: GraphFacts) -> list[ir.Node]:
    """The Q/DQ nodes that quantize to UINT8 (which TensorRT does not support)."""
    return [n for n in f.nodes if n.op_type in (Q, DQ) and _quantized_type(f, n) == _UINT8]


def _zero_point(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        zero = f.zero_point(node) if node.op_type in (Q, DQ) else None
        if zero is not None and np.any(zero.astype(np.float64) != 0):
            yield Violation("zero-point", f.name(node), f"zero point {brief(zero)} is not 0; TensorRT is symmetric")


def _scale(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in (Q, DQ):
            continue
        yield from _scale_problems(f, node)


def _scale_problems(f: GraphFacts, node: ir.Node) -> Iterator[Violation]:
    name, scale, zero = f.name(node), f.scale(node), f.zero_point(node)
    if scale is None:
        scale_name = name_of(node.inputs[1], "")
        yield Violation("scale", name, f"scale {scale_name!r} is not a constant; TensorRT needs a build-time constant")
        return
    if len(node.inputs) > 2 and node.inputs[2] is not None and zero is None:
        yield Violation("scale", name, f"zero point {node.inputs[2].name!r} is not a constant")
    values = scale.astype(np.float64)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        yield Violation("scale", name, f"scale {brief(scale)} must be positive and finite")
    if scale.ndim > 1:
        yield Violation(
            "scale",
            name,
            f"scale has shape {list(scale.shape)}; TensorRT takes a scalar or a 1-D scale "
            "for INT8 (block scales are for INT4)",
        )
    if zero is not None and zero.shape != scale.shape:
        yield Violation(
            "scale", name, f"zero point shape {list(zero.shape)} differs from scale shape {list(scale.shape)}"
        )
    if f.per_channel(scale):
        if f.opset < 13:
            yield Violation("scale", name, f"per-channel scale needs opset >= 13 (the axis attribute); opset {f.opset}")
        dims = f.dims(node.inputs[0])
        axis = f.axis(node)
        if dims is not None and not 0 <= axis < len(dims):
            yield Violation("scale", name, f"axis {axis} is outside the input's rank {len(dims)}")
        elif dims is not None and dims[axis] is not None and dims[axis] != scale.size:
            yield Violation("scale", name, f"{scale.size} scales for {dims[axis]} channels on axis {axis}")


def _quantized_type(f: GraphFacts, node: ir.Node) -> int | None:
    """The integer (or FP8/FP4) type a Q produces or a DQ reads."""
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return f.type_of(node.inputs[2])
    if node.op_type == Q:
        return attr(node, "output_dtype", 0) or _UINT8
    return f.type_of(node.inputs[0])


RULES = (
    Rule(
        "qdq-pair",
        "each Q is read only by DQs; each DQ reads a Q or a constant",
        "TensorRT dev guide: Explicit Quantization",
        _qdq_pairs,
    ),
    Rule(
        "pair-params",
        "a Q and its DQ share scale, zero point and axis",
        "TensorRT dev guide: Q/DQ propagation and fusion",
        _pair_params,
    ),
    Rule(
        "int8-type",
        "the quantized type is INT8 (or INT4/FP8/FP4), never UINT8",
        "TensorRT: Working with Quantized Types",
        _int8_type,
    ),
    Rule(
        "zero-point",
        "every zero point is 0 (symmetric quantization)",
        "TensorRT operators: Quantize, Dequantize",
        _zero_point,
    ),
    Rule(
        "scale",
        "scales are constant, positive, finite; scalar or 1-D along axis",
        "TensorRT operators: Quantize, Dequantize",
        _scale,
    ),
)
