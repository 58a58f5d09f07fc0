"""``mul_inputs``: a product of two tensors runs as ONNX Runtime's ``QLinearMul`` (the squeeze-excitation
product of EfficientNet), which needs both operands quantized.

A product with one operand quantized and its output quantized by every reader gets its other operand
quantized, by the quantizer another reader already applies to that tensor when there is one (ONNX Runtime
fuses a tensor with one Q only), else by a new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Op, Quantizer, Value

__all__ = ["MUL_INPUTS", "sibling_quantizer"]


def sibling_quantizer(view: GraphView, value: Value, but: Op) -> Quantizer | None:
    """A per-tensor quantizer another reader of ``value`` (not ``but``) reads it through, if any."""
    for reader, index in value.readers:
        found = view.quantizer_at(reader, index) if reader is not but else None
        if found is not None and not found.per_channel:
            return found
    return None


def _decide(view: GraphView) -> None:
    for mul in view.ops_of("Mul"):
        inputs = mul.data_inputs
        if len(inputs) != 2 or not any(view.reads_quantized(mul, i) for i, _ in inputs):
            continue
        if not view.readers_quantize(mul.outputs[0]):
            continue
        for index, value in inputs:
            if not view.reads_quantized(mul, index):
                like = sibling_quantizer(view, value, mul)
                view.quantize_input(mul, index, "QLinearMul needs both operands quantized", like=like)


MUL_INPUTS = PlacementRule(
    "mul_inputs",
    _decide,
    "A product of two tensors with one operand quantized gets the other quantized (QLinearMul).",
)
