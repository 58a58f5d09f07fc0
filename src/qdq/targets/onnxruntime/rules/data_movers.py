"""``data_movers``: ops that only move or select int8 values (MaxPool, Resize, Slice, Pad...) keep one range.

ONNX Runtime runs such an op on int8 data only when the DequantizeLinear before it and the QuantizeLinear after
it have the same scale and zero point (``fusion.int8_data_movers``): then it drops both. Two quantizers with
ranges calibrated apart (the tensor before a MaxPool and the one after differ, so every method but max gives
them different ranges) leave ``DQ -> MaxPool -> Q`` in float, with layout reorders around it. So an int8 data
mover whose input is quantized gets one range for its input and every quantized read of its outputs (reads by
ops ONNX Runtime runs in int8 are quantized first): the statistics of both sides make the one range.

A mover whose input is not quantized but comes from an op ONNX Runtime runs in int8 (a SiLU's product, a conv, a
sum of quantized tensors), and whose outputs are read quantized, gets its input quantized too, in the same one
range as every other quantized read of that tensor: otherwise the product runs in float (``DQ -> Mul``), the
mover too, and each quantized read of its outputs re-quantizes (YOLOv8's C2f splits, SPPF max-pools and
upsamplings of SiLU outputs). One range for the tensor is also what lets the product fuse: ONNX Runtime fuses
``DQ -> Mul -> Q`` only when one QuantizeLinear reads the product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Op, Quantizer, Value

__all__ = ["DATA_MOVERS", "int8_reader"]


def int8_reader(view: GraphView, op: Op) -> bool:
    """Is ``op`` one the target runs in int8 once this input is quantized (a weighted op, another data mover)?
    Ops of several inputs (adds, products, concatenations) are not: their own rules decide all inputs at once."""
    fusion = view.target.fusion
    return op.type in ops.WEIGHTED or (fusion is not None and op.type in fusion.int8_data_movers)


def _int8_reads(view: GraphView, op: Op) -> list[Quantizer]:
    """The quantizers of every read of ``op``'s outputs that is quantized or that the target runs in int8 (those
    are quantized here)."""
    reads = []
    for output in op.outputs:
        for reader, index in output.readers:
            if view.reads_quantized(reader, index) or int8_reader(view, reader):
                reads.append(view.quantize_input(reader, index, f"{op.type} runs on int8 data"))
    return [q for q in reads if q is not None]


def _quantized_reads(view: GraphView, value: Value) -> list[Quantizer | None]:
    return [view.quantizer_at(reader, index) for reader, index in value.readers]


def _decide(view: GraphView) -> None:
    movers = view.target.fusion.int8_data_movers if view.target.fusion is not None else frozenset()
    for op in view.ops_of(*movers):
        if not op.data_inputs:
            continue
        index, source = op.data_inputs[0]
        reads = _int8_reads(view, op)
        if view.reads_quantized(op, index):
            sides = [view.quantizer_at(op, index), *reads]
        elif reads and source.producer is not None and view.is_quantized(source.producer):
            why = f"{op.type} of an int8 op's output runs on int8 data"
            sides = [view.quantize_input(op, index, why), *_quantized_reads(view, source), *reads]
        else:
            continue
        found = [q for q in sides if q is not None]
        if len({id(q) for q in found}) > 1:
            view.share_range(found, f"{op.name} ({op.type}) runs on int8 data")


DATA_MOVERS = PlacementRule(
    "data_movers",
    _decide,
    "An int8 data mover (MaxPool, Resize, Slice...) of a quantized tensor: its input and its quantized reads "
    "share one range, so ONNX Runtime runs it on int8 data.",
)
