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

from typing import Any

from qdq.graphs.onnx import GraphIndex, sort_nodes

__all__ = ["shapes_of_int8"]


def _int8_twin(g: GraphIndex, tensor: str) -> str | None:
    """A tensor of ``tensor``'s shape holding its int8 encoding, or None."""
    producer = g.producer.get(tensor)
    if producer is not None and producer.op_type == "DequantizeLinear":
        return str(producer.input[0])
    quantize = next((n for n in g.consumers.get(tensor, []) if n.op_type == "QuantizeLinear"), None)
    return None if quantize is None else str(quantize.output[0])


def shapes_of_int8(g: GraphIndex) -> int:
    """Point every ``Shape`` of a quantized float tensor at its int8 encoding; returns how many were moved."""
    moved: list[Any] = []
    for node in g.graph.node:
        twin = _int8_twin(g, node.input[0]) if node.op_type == "Shape" else None
        if twin is not None:
            g.set_input(node, 0, twin)
            moved.append(node)
    if not moved:
        return 0
    sort_nodes(g.model)  # a Shape that read the float tensor may come before the tensor's QuantizeLinear
    idle = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and not g.consumers.get(n.output[0])
            and n.output[0] not in g.outputs]  # fmt: skip
    g.remove(idle)
    return len(moved)
