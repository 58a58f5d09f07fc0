"""TensorRT 11's strong typing: every tensor's type comes from the graph, with no implicit promotion.

Migration guide 10.x -> 11.x, "Strongly Typed Networks Are Now Required" (TensorRT infers each tensor's type
from the network inputs and the operators' types):

* ``type-consistent`` — the inputs and outputs a node binds to one type parameter have one type, a type the
  operator allows in the model's opset, and ONNX type inference accepts the graph.
* ``q-input-type`` — a QuantizeLinear's input has its scale's type (operator "Quantize": input and scale are
  both T1).
* ``dq-output-type`` — a DequantizeLinear outputs its scale's type (operator "Dequantize": output T3 is the
  scale's type), so a DQ feeding an FP16 op has an FP16 scale.
* ``fp32-island`` — in a graph that computes in FP16/BF16, no node computes in FP32 unless allowed: its op
  type is in the allow-list (``fp32_ops``) or the low-precision export recorded it (model metadata
  ``qdq.float.fp32_nodes``: node -> reason). ModelOpt AutoCast keeps such nodes in FP32 explicitly; anything
  else FP32 is a node the conversion missed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import attr
from qdq.graphs.onnx_types import FLOAT_TYPES, LOW_PRECISION, float_slots, type_name
from qdq.targets.tensorrt.engine_rules.facts import DQ, GraphFacts, Q, Rule, Violation

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["RULES", "compute_precisions", "fp32_allowed"]

_NOT_COMPUTE = frozenset({Q, DQ, "Cast", "CastLike", "Constant", "Identity", "Shape", "Size"})


def _type_consistent(f: GraphFacts) -> Iterator[Violation]:
    found = False
    for node in f.nodes:
        slots = float_slots(node, f.opset)
        if slots.param is None:
            continue
        bound = [node.inputs[i] for i in slots.inputs] + [node.outputs[i] for i in slots.outputs]
        types = {value.name: f.type_of(value) for value in bound if value is not None}
        known = {t for t in types.values() if t is not None}
        if len(known) > 1:
            found = True
            listed = ", ".join(f"{n!r}: {type_name(t)}" for n, t in types.items() if t is not None)
            yield Violation(
                "type-consistent",
                f.name(node),
                f"{slots.param} is bound to several types ({listed}); "
                "a strongly typed network needs one (convert or Cast one of them)",
            )
        for t in known - set(slots.allowed):
            found = True
            yield Violation(
                "type-consistent",
                f.name(node),
                f"{type_name(t)} is not allowed for {node.op_type}'s {slots.param} in opset {f.opset}",
            )
    if not found and f.types.inference_error is not None:
        yield Violation("type-consistent", "(graph)", f"ONNX type inference fails: {f.types.inference_error}")


def _q_input_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != Q or len(node.inputs) < 2:
            continue
        x, scale = f.type_of(node.inputs[0]), f.type_of(node.inputs[1])
        if x is not None and scale is not None and x != scale:
            yield Violation(
                "q-input-type",
                f.name(node),
                f"input is {type_name(x)} but the scale is {type_name(scale)}; give the scale the input's type",
            )


def _dq_output_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != DQ or len(node.inputs) < 2:
            continue
        scale = f.type_of(node.inputs[1])
        out = attr(node, "output_dtype", 0) or f.type_of(node.outputs[0])
        if scale is not None and out is not None and out != scale:
            yield Violation(
                "dq-output-type",
                f.name(node),
                f"outputs {type_name(out)} but the scale is {type_name(scale)}; TensorRT's DQ outputs the scale's type",
            )


def _fp32_island(f: GraphFacts) -> Iterator[Violation]:
    precisions = compute_precisions(f)
    low = {t for t in precisions.values() if t in LOW_PRECISION.values()}
    if not low:
        return
    for node in f.nodes:
        if precisions.get(id(node)) == 1 and not fp32_allowed(f, node):
            yield Violation(
                "fp32-island",
                f.name(node),
                f"computes in float32 in a {type_name(min(low))} graph; "
                "convert it, or keep it in FP32 on purpose (allow-list)",
            )


def compute_precisions(f: GraphFacts) -> dict[int, int]:
    """``id(node)`` -> the float type a compute node computes in (its first float output's type)."""
    found: dict[int, int] = {}
    for node in f.nodes:
        if node.op_type in _NOT_COMPUTE or node.domain not in ("", "ai.onnx"):
            continue
        types = [f.type_of(value) for value in node.outputs]
        float_out = next((t for t in types if t in FLOAT_TYPES), None)
        if float_out is not None:
            found[id(node)] = float_out
    return found


def fp32_allowed(f: GraphFacts, node: ir.Node) -> bool:
    """Is ``node`` allowed to compute in FP32 in a low-precision graph (allow-listed op or recorded node)?"""
    return node.op_type in f.fp32_ops or node.name in f.fp32_nodes


RULES = (
    Rule(
        "type-consistent",
        "one type per node type parameter, allowed in the opset",
        "TensorRT 11 migration: strongly typed networks",
        _type_consistent,
    ),
    Rule(
        "q-input-type",
        "a Q's input has its scale's type",
        "TensorRT operator: Quantize (input and scale are T1)",
        _q_input_type,
    ),
    Rule(
        "dq-output-type",
        "a DQ outputs its scale's type",
        "TensorRT operator: Dequantize (output is the scale's type)",
        _dq_output_type,
    ),
    Rule(
        "fp32-island",
        "no FP32 compute in an FP16/BF16 graph outside the allow-list",
        "TensorRT 11 migration; ModelOpt AutoCast",
        _fp32_island,
    ),
)
