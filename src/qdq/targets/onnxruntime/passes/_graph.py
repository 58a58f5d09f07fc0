"""Helpers the ONNX Runtime passes share: a weight's DequantizeLinear, Q/DQ parameters, Q/DQ pairs, ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.graphs.onnx_types import recorded_dims

__all__ = [
    "INT32_LIMIT",
    "dq_params",
    "keeps_zero",
    "qdq_pairs",
    "quantize_weight",
    "ranks",
    "same_params",
    "weight_dq",
]

#: the largest int32 (a bias quantized to int32 must fit)
INT32_LIMIT = 2**31 - 1


def quantize_weight(w: np.ndarray, scale: np.ndarray, dtype: np.dtype, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear of a constant with zero point 0 (:func:`qdq.ops.round_to_grid`), as ``dtype``."""
    import torch

    from qdq.ops import round_to_grid

    step = torch.tensor(scale, dtype=torch.float32)
    if step.dim() == 1:
        shape = [1] * w.ndim
        shape[axis % w.ndim] = step.numel()
        step = step.reshape(shape)
    info = np.iinfo(dtype)
    q = round_to_grid(torch.tensor(w, dtype=torch.float32), step, int(info.min), int(info.max))
    return q.numpy().astype(dtype)


def weight_dq(g: GraphIndex, conv: Any) -> tuple[Any, np.ndarray] | None:
    """The DequantizeLinear of ``conv``'s weight (input 1), read by ``conv`` alone, and the constant it reads; None
    when the weight is not such a DQ of a constant."""
    dq = g.producer.get(conv.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or not g.is_single_reader(conv, dq.output[0]):
        return None
    weight = g.array(dq.input[0])
    return None if weight is None else (dq, weight)


def dq_params(g: GraphIndex, tensor: str) -> tuple[np.ndarray, int | None] | None:
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale = g.array(dq.input[1])
    return None if scale is None else (scale, attribute(dq, "axis", 1))


def same_params(g: GraphIndex, a: Any, b: Any) -> bool:
    per_tensor = False
    for i in (1, 2):
        x, y = g.array(a.input[i]), g.array(b.input[i])
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
        per_tensor = x.ndim == 0  # the zero point's (i = 2) when the loop ends
    return per_tensor or attribute(a, "axis", 1) == attribute(b, "axis", 1)


def qdq_pairs(g: GraphIndex) -> Iterator[tuple[Any, list[Any]]]:
    for q in g.graph.node:
        if q.op_type == "QuantizeLinear":
            dqs = [u for u in g.consumers.get(q.output[0], []) if u.op_type == "DequantizeLinear"]
            if dqs and len(dqs) == len(g.consumers.get(q.output[0], [])):
                yield q, dqs


def dims(g: GraphIndex) -> dict[str, list[int | None]]:
    """The dimensions of each tensor whose shape the graph records (inputs, outputs, value_info); None where a
    dimension is symbolic or unknown."""
    return recorded_dims((*g.graph.input, *g.graph.output, *g.graph.value_info))


def ranks(g: GraphIndex) -> dict[str, int]:
    """Rank of each tensor whose type the graph records (inputs, outputs, value_info)."""
    return {name: len(shape) for name, shape in dims(g).items()}


def keeps_zero(g: GraphIndex, node: Any) -> bool:
    """A Relu, or a Clip whose constant bounds hold 0: the op maps 0 to 0."""
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip":
        return False
    for index, attr, ok in ((1, "min", lambda v: v <= 0), (2, "max", lambda v: v >= 0)):
        name = node.input[index] if len(node.input) > index else ""
        value = g.const_input(node, index) if name else attribute(node, attr)
        if name and value is None:
            return False  # a bound computed at run time
        if value is not None and not ok(float(np.asarray(value).reshape(-1)[0])):
            return False
    return True
