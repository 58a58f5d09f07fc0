"""``int8_concat``: a concatenation whose output is quantized runs as ONNX Runtime's ``QLinearConcat``, which
needs every input dequantized (of any scales) and the output quantized: each input is quantized.

A concatenation nothing reads quantized (a model output mixing ranges, a detector's boxes and scores) is left
float: quantizing it would buy no int8 kernel and put one scale on values of different ranges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["INT8_CONCAT"]


def _decide(view: GraphView) -> None:
    for concat in view.ops_of("Concat"):
        if len(concat.data_inputs) < 2 or not view.readers_quantize(concat.outputs[0]):
            continue
        for index, _ in concat.data_inputs:
            view.quantize_input(concat, index, "QLinearConcat needs every input quantized", stem="concat_quantizer")


INT8_CONCAT = PlacementRule(
    "int8_concat",
    _decide,
    "A concatenation whose output is quantized gets every input quantized (QLinearConcat, any scales).",
)
