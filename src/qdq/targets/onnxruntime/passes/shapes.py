"""Pass 16, shapes: a ``Shape`` reads the int8 side of a quantized tensor.

Exporters compute sizes from a tensor's shape (``Shape -> Gather -> ...``: the bounds of a chunk, the target size
of an upsampling). A ``Shape`` of a float tensor that is also quantized holds the float tensor alive for one more
reader: ONNX Runtime then fuses ``DQ -> Mul -> Q`` into ``QLinearMul`` only when the Q is the product's sole reader,
so the product stays float; a ``Shape`` of a ``DequantizeLinear``'s output runs the whole dequantization for a
shape. Quantizing and dequantizing keep a tensor's shape, so the ``Shape`` can read the int8 tensor instead: the
``DequantizeLinear``'s input, or the output of a ``QuantizeLinear`` of the float tensor. Exact; a
``DequantizeLinear`` left without readers goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import readers, remove

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["shapes_of_int8"]


def _int8_twin(graph: ir.Graph, value: ir.Value) -> ir.Value | None:
    """A value of ``graph`` of ``value``'s shape holding its int8 encoding, or None."""
    producer = value.producer()
    if producer is not None and producer.op_type == "DequantizeLinear":
        return producer.inputs[0]
    quantize = next((n for n in readers(value) if n.op_type == "QuantizeLinear" and n.graph is graph), None)
    return None if quantize is None else quantize.outputs[0]


def shapes_of_int8(graph: ir.Graph) -> int:
    """Point every ``Shape`` of a quantized float tensor at its int8 encoding; returns how many were moved."""
    moved = 0
    for node in graph:
        twin = _int8_twin(graph, node.inputs[0]) if node.op_type == "Shape" and node.inputs[0] is not None else None
        if twin is not None:
            node.replace_input_with(0, twin)
            moved += 1
    if not moved:
        return 0
    graph.sort()  # a Shape that read the float tensor may come before the tensor's QuantizeLinear
    idle = [n for n in graph if n.op_type == "DequantizeLinear" and not n.outputs[0].uses()
            and not n.outputs[0].is_graph_output()]  # fmt: skip
    remove(graph, idle)
    return moved
