"""``concat``: a concatenation whose inputs share one int8 form, for TensorRT.

TensorRT keeps a concatenation in int8 only when its inputs share one scale: every data input is quantized
with one range (PyTorch: a :class:`~qdq.nn.QuantConcat`; Keras: a Concatenate wrapper with one range). Skipped
when every reader of the concatenation already quantizes it (their quantizer then gives the shared scale), and for
a model output: nothing after it runs in int8, and one scale over values of different ranges (a detector's pixel
boxes and 0-1 scores) would round the small ones away.
ONNX Runtime's rule (:mod:`qdq.targets.onnxruntime.rules.int8_concat`) differs: its ``QLinearConcat`` takes
inputs of any scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["CONCAT"]


def _decide(view: GraphView) -> None:
    for concat in view.ops_of("Concat"):
        output = concat.outputs[0]
        if output.graph_output or view.readers_quantize(output) or len(concat.data_inputs) < 2:
            continue
        shared = None
        for index, _ in concat.data_inputs:
            shared = view.quantize_input(concat, index, "one scale for a concatenation", like=shared, stem="concat")


CONCAT = PlacementRule(
    "concat",
    _decide,
    "A concatenation's inputs share one quantizer (one scale: TensorRT's int8 concatenation), unless every "
    "reader already quantizes its output or it is a model output.",
)
