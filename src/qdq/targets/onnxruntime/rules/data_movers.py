"""``data_movers``: ops that only move or select int8 values (MaxPool, Resize, Slice, Pad...) keep one range.

ONNX Runtime runs such an op on int8 data only when the DequantizeLinear before it and the QuantizeLinear after
it have the same scale and zero point (``fusion.int8_data_movers``): then it drops both. Two quantizers with
ranges calibrated apart (the tensor before a MaxPool and the one after differ, so every method but max gives
them different ranges) leave ``DQ -> MaxPool -> Q`` in float, with layout reorders around it. So an int8 data
mover whose input is quantized gets one range for its input and every quantized read of its output (reads by
ops ONNX Runtime runs in int8 are quantized first): the statistics of both sides make the one range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Op

__all__ = ["DATA_MOVERS", "int8_reader"]


def int8_reader(view: GraphView, op: Op) -> bool:
    """Is ``op`` one the target runs in int8 once this input is quantized (a weighted op, another data mover)?
    Ops of several inputs (adds, products, concatenations) are not: their own rules decide all inputs at once."""
    fusion = view.target.fusion
    return op.type in ops.WEIGHTED or (fusion is not None and op.type in fusion.int8_data_movers)


def _decide(view: GraphView) -> None:
    movers = view.target.fusion.int8_data_movers if view.target.fusion is not None else frozenset()
    for op in view.ops_of(*movers):
        if not op.data_inputs or not view.reads_quantized(op, op.data_inputs[0][0]) or len(op.outputs) != 1:
            continue
        sides = [view.quantizer_at(op, op.data_inputs[0][0])]
        for reader, index in op.outputs[0].readers:
            if view.reads_quantized(reader, index) or int8_reader(view, reader):
                sides.append(view.quantize_input(reader, index, f"{op.type} runs on int8 data"))
        found = [q for q in sides if q is not None]
        if len({id(q) for q in found}) > 1:
            view.share_range(found, f"{op.name} ({op.type}) runs on int8 data")


DATA_MOVERS = PlacementRule(
    "data_movers",
    _decide,
    "An int8 data mover (MaxPool, Resize, Slice...) of a quantized tensor: its input and its quantized reads "
    "share one range, so ONNX Runtime runs it on int8 data.",
)
