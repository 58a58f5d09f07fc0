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
    from qdq.graphs.view import GraphView, Op, Quantizer

__all__ = ["DATA_MOVERS", "int8_reader"]


def int8_reader(view: GraphView, op: Op) -> bool:
    """Is ``op`` one the target runs in int8 once this input is quantized (a weighted op, another data mover)?
    Ops of several inputs (adds, products, concatenations) are not: their own rules decide all inputs at once."""
    fusion = view.target.fusion
    return op.type in ops.WEIGHTED or (fusion is not None and op.type in fusion.int8_data_movers)


def _int8_reads(view: GraphView, op: Op) -> list[tuple[Op, int]]:
    """Every read of ``op``'s outputs that is quantized or that the target runs in int8."""
    return [(reader, index) for output in op.outputs for reader, index in output.readers
            if view.reads_quantized(reader, index) or int8_reader(view, reader)]  # fmt: skip


def _input_side(view: GraphView, op: Op, reads: list[tuple[Op, int]]) -> list[Quantizer | None] | None:
    """The quantizers on the mover's input side, or None when the mover's input stays float: it is quantized
    already, or it is quantized here when an int8 op produces it and the mover's outputs are read in int8."""
    index, source = op.data_inputs[0]
    if view.reads_quantized(op, index):
        return [view.quantizer_at(op, index)]
    if not reads or source.producer is None or not view.is_quantized(source.producer):
        return None
    mover = view.quantize_input(op, index, f"{op.type} of an int8 op's output runs on int8 data")
    return [mover, *(view.quantizer_at(reader, i) for reader, i in source.readers)]


def _decide(view: GraphView) -> None:
    movers = view.target.fusion.int8_data_movers if view.target.fusion is not None else frozenset()
    for op in view.ops_of(*movers):
        reads = _int8_reads(view, op) if op.data_inputs else []
        sides = _input_side(view, op, reads) if op.data_inputs else None
        if sides is None:
            continue
        sides += [view.quantize_input(reader, index, f"{op.type} runs on int8 data") for reader, index in reads]
        found = [q for q in sides if q is not None]
        if len({id(q) for q in found}) > 1:
            view.share_range(found, f"{op.name} ({op.type}) runs on int8 data")


DATA_MOVERS = PlacementRule(
    "data_movers",
    _decide,
    "An int8 data mover (MaxPool, Resize, Slice...) of a quantized tensor: its input and its quantized reads "
    "share one range, so ONNX Runtime runs it on int8 data.",
)
