"""``elementwise_output``: an add or product of quantized tensors has its output quantized, since
``DQ -> Add -> Q`` is what ONNX Runtime runs as ``QLinearAdd`` (``QLinearMul`` for a product).

The quantizer goes after a ReLU / Clip ONNX Runtime folds (``fusion.folded_activations``) when one alone reads the
sum, as for a conv's output; it is left out when every reader of that tensor already quantizes it (a ResNet's next
block), and for a model output (nothing after it runs in int8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.onnxruntime.rules.conv_output import folded_tail
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["ELEMENTWISE_OUTPUT"]


def _decide(view: GraphView) -> None:
    for op in view.ops_of("Add", "Mul"):
        inputs = op.data_inputs
        if len(inputs) < 2 or not all(view.reads_quantized(op, i) for i, _ in inputs):
            continue
        tail = folded_tail(view, op.outputs[0])
        if not tail.graph_output and not view.readers_quantize(tail):
            view.quantize_output(tail, f"DQ -> {op.type} -> Q is QLinear{op.type}")


ELEMENTWISE_OUTPUT = PlacementRule(
    "elementwise_output",
    _decide,
    "The output of an add or product of quantized tensors, after a folded ReLU/ReLU6, is quantized (QLinearAdd, "
    "QLinearMul), unless every reader already quantizes it or it is a model output.",
)
