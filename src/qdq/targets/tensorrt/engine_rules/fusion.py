"""TensorRT's fusion rules: where Q/DQ must stand for an op to run in int8.

* ``weighted-op-inputs`` — a Conv/ConvTranspose/Gemm/MatMul with one dequantized input has both its data and
  weight inputs dequantized, each from a DequantizeLinear directly (or through a Transpose/Reshape, which
  TensorRT moves the DQ across), never through a Cast. Developer guide "Q/DQ Layer-Placement
  Recommendations" (quantize all inputs of weighted operations) and "Q/DQ Fusion".
* ``residual-add`` — an Add that follows a quantized weighted op (directly or through BatchNormalization, the op's
  output read by nothing else) and whose output is quantized again has a dequantized other ("residual") input:
  TensorRT fuses the Add into the op, and the residual input's precision decides the fused output's. Developer
  guide, placement recommendations (element-wise addition fusion). An Add of a constant is the op's bias (a linear
  exported as MatMul + Add), fused into it with nothing to quantize: no residual add.
* ``fused-scales`` — scales agree across ops TensorRT runs on int8 data: the inputs of a quantized Concat
  share one scale with the Q after it, and a DQ -> data-movement op (MaxPool, Reshape, Transpose...) -> Q
  group has one scale. Developer guide, "Q/DQ Propagation" (commuting layers); ModelOpt's ONNX
  quantization groups Concat scales (``concat_elimination``).
* ``integer-ops`` — no integer-arithmetic ONNX ops (QLinearConv, ConvInteger, QLinearMatMul, MatMulInteger,
  QGemm...): "TensorRT does not support" the QOperator format, only Q/DQ. Developer guide §"ONNX Support".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import name_of, readers_through, source
from qdq.targets.tensorrt.engine_rules.facts import (
    DQ,
    LAYOUT,
    WEIGHTED,
    GraphFacts,
    Q,
    Rule,
    Violation,
    brief,
    same_values,
)

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["RULES", "casts_after_dqs", "partly_quantized_ops", "residual_repairs", "unquantized_residual_adds"]

#: Ops that run on int8 data between a DQ and a Q with one scale (they commute with quantization).
_DATA_MOVERS = frozenset({"MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather",
                          "Identity", "Split", "Pad", "DepthToSpace", "SpaceToDepth", "Resize"})  # fmt: skip
_INTEGER_OPS = frozenset({"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm", "QLinearAdd",
                          "QLinearMul", "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax",
                          "QLinearGlobalAveragePool", "QLinearAveragePool", "DynamicQuantizeLinear",
                          "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention"})  # fmt: skip
#: Activations TensorRT fuses after an add, before its Q.
_ADD_ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu"})


def _weighted_op_inputs(f: GraphFacts) -> Iterator[Violation]:
    for node, index, dq, cast in casts_after_dqs(f):
        yield Violation(
            "weighted-op-inputs",
            f.name(node),
            f"input {index} reaches DQ {f.name(dq)} through {cast.op_type} {f.name(cast)}: TensorRT cannot fuse "
            "the DQ; give the DQ a scale of the op's type instead",
        )
    for node, float_input in partly_quantized_ops(f):
        yield Violation(
            "weighted-op-inputs",
            f.name(node),
            f"input {float_input} ({name_of(node.inputs[float_input], '')!r}) is "
            "float while the other is dequantized: TensorRT runs it in float; quantize both",
        )


def casts_after_dqs(f: GraphFacts) -> list[tuple[ir.Node, int, ir.Node, ir.Node]]:
    """``(op, input index, DQ, Cast)`` for each Conv/Gemm/MatMul input that reaches its DequantizeLinear through
    a Cast (what a float16 model's export writes: float32 Q/DQ, then a Cast to the model's type)."""
    found = []
    for node in f.nodes:
        if node.op_type not in WEIGHTED or len(node.inputs) < 2:
            continue
        for index in (0, 1):
            if f.quantized_source(node.inputs[index])[0] is not None:
                continue
            dq, passed = f.quantized_source(node.inputs[index], LAYOUT | {"Cast", "CastLike"})
            if dq is not None:
                found.append((node, index, dq, next(p for p in passed if p.op_type in ("Cast", "CastLike"))))
    return found


def partly_quantized_ops(f: GraphFacts) -> list[tuple[ir.Node, int]]:
    """``(node, index of its float input)`` of each Conv/Gemm/MatMul with one of its two inputs dequantized
    (directly, through layout ops or a Cast) and the other float: TensorRT runs such an op in float."""
    found = []
    for node in f.nodes:
        if node.op_type not in WEIGHTED or len(node.inputs) < 2:
            continue
        through = LAYOUT | {"Cast", "CastLike"}
        quantized = [f.quantized_source(node.inputs[i], through)[0] is not None for i in (0, 1)]
        if any(quantized) and not all(quantized):
            found.append((node, quantized.index(False)))
    return found


def unquantized_residual_adds(f: GraphFacts) -> list[tuple[ir.Node, ir.Node]]:
    """``(add, fused op)`` for each Add the ``residual-add`` rule rejects: it follows a quantized weighted op
    (``fused op``), feeds a Q, and neither of its inputs is dequantized."""
    found = []
    for node in f.nodes:
        if node.op_type != "Add" or len(node.inputs) != 2:
            continue
        if any(f.is_constant(value) for value in node.inputs):
            continue  # a bias written apart from its op (MatMul + Add): TensorRT fuses it into the op
        fused = [_quantized_weighted_producer(f, value) for value in node.inputs]
        if not any(fused) or not _quantized_downstream(f, node.outputs[0]):
            continue
        if any(f.quantized_source(value, frozenset())[0] is not None for value in node.inputs):
            continue
        found.append((node, next(p for p in fused if p is not None)))
    return found


def residual_repairs(f: GraphFacts) -> list[tuple[ir.Node, int, ir.Value]]:
    """``(add, input index, dequantized value)``: for each Add :func:`unquantized_residual_adds` finds, an input that
    is already quantized for another reader (a per-tensor ``Q -> DQ`` of that very value) and the DQ's output, the
    Add to read it instead. A front end that could not see the add (a layer class of the model's own) quantized the
    skip tensor for its other readers only; reading that quantizer is what TensorRT needs, at no new range."""
    repairs = []
    for add, _ in unquantized_residual_adds(f):
        for index, value in enumerate(add.inputs):
            if value is None:
                continue
            dq = next((dq for q in f.readers(value) if q.op_type == Q and not f.per_channel(f.scale(q))
                       for dq in f.readers(q.outputs[0]) if dq.op_type == DQ), None)  # fmt: skip
            if dq is not None:
                repairs.append((add, index, dq.outputs[0]))
                break
    return repairs


def _residual_add(f: GraphFacts) -> Iterator[Violation]:
    for node, op in unquantized_residual_adds(f):
        yield Violation(
            "residual-add",
            f.name(node),
            f"adds to quantized {op.op_type} {f.name(op)} and feeds a Q, "
            "but neither input is dequantized: TensorRT fuses the Add in float and the Q cannot fuse; "
            "quantize the residual (skip) input",
        )


def _fused_scales(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type == "Concat":
            yield from _concat_scales(f, node)
        elif node.op_type in _DATA_MOVERS and node.inputs:
            dq = source(node.inputs[0])
            if dq is None or dq.op_type != DQ:
                continue
            for q in f.readers(node.outputs[0]):
                if q.op_type == Q and not same_values(f.scale(q), f.scale(dq)):
                    yield Violation(
                        "fused-scales",
                        f.name(node),
                        f"DQ {f.name(dq)} and Q {f.name(q)} around this "
                        f"{node.op_type} have scales {brief(f.scale(dq))} and {brief(f.scale(q))}: "
                        "TensorRT runs it on int8 data only with one scale",
                    )


def _integer_ops(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type in _INTEGER_OPS:
            yield Violation(
                "integer-ops",
                f.name(node),
                f"{node.op_type} is an integer op TensorRT does not parse; export Q/DQ nodes around a float op instead",
            )


def _concat_scales(f: GraphFacts, node: ir.Node) -> Iterator[Violation]:
    dqs = [d for d in map(source, node.inputs) if d is not None and d.op_type == DQ]
    if not dqs or len(dqs) < len(node.inputs):
        return
    scales = [f.scale(d) for d in dqs]
    scales += [f.scale(q) for q in f.readers(node.outputs[0]) if q.op_type == Q]
    if any(not same_values(scales[0], s) for s in scales[1:]):
        listed = ", ".join(brief(s) for s in scales)
        yield Violation(
            "fused-scales",
            f.name(node),
            f"its quantized inputs and output have different scales "
            f"({listed}); TensorRT concatenates int8 data with one scale",
        )


def _quantized_weighted_producer(f: GraphFacts, value: ir.Value | None) -> ir.Node | None:
    """The quantized weighted op producing ``value`` (directly or through BatchNormalization), each value on the
    way read by one node (an op whose output other nodes read too cannot take the Add into its kernel), else None."""
    node = None
    while value is not None and f.read_once(value):
        node = value.producer()
        if node is None or node.op_type != "BatchNormalization":
            break
        value, node = node.inputs[0], None
    if node is None or node.op_type not in WEIGHTED or len(node.inputs) < 2:
        return None
    return node if all(f.quantized_source(node.inputs[i])[0] is not None for i in (0, 1)) else None


def _quantized_downstream(f: GraphFacts, value: ir.Value) -> bool:
    """Does ``value`` reach a QuantizeLinear through activations TensorRT fuses after an add?"""
    found = readers_through(value, _ADD_ACTIVATIONS, lambda v: list(f.readers(v)))
    return any(reader is not None and reader.op_type == Q for reader in found)


RULES = (
    Rule(
        "weighted-op-inputs",
        "a quantized Conv/Gemm/MatMul reads DQs directly (no Cast, no float input)",
        "TensorRT dev guide: Q/DQ placement, fusion",
        _weighted_op_inputs,
    ),
    Rule(
        "residual-add",
        "an Add fused into a quantized op has a dequantized residual input",
        "TensorRT dev guide: Q/DQ placement (add fusion)",
        _residual_add,
    ),
    Rule(
        "fused-scales",
        "one scale across Concat and int8 data-movement ops",
        "TensorRT dev guide: Q/DQ propagation",
        _fused_scales,
    ),
    Rule(
        "integer-ops",
        "no QOperator integer ops (QLinearConv, ConvInteger...)",
        "TensorRT dev guide: ONNX support",
        _integer_ops,
    ),
)
