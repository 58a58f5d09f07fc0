"""Helpers the ONNX Runtime passes share (on onnx_ir): a weight's DequantizeLinear, Q/DQ parameters, Q/DQ pairs,
a value's recorded dimensions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import attr, const, const_input, readers

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = [
    "INT32_LIMIT",
    "dims",
    "dq_params",
    "keeps_zero",
    "qdq_pairs",
    "quantize_weight",
    "rank",
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


def weight_dq(conv: ir.Node) -> tuple[ir.Node, np.ndarray] | None:
    """The DequantizeLinear of ``conv``'s weight (input 1), read by ``conv`` alone, and the constant it reads; None
    when the weight is not such a DQ of a constant."""
    w = conv.inputs[1] if len(conv.inputs) > 1 else None
    dq = w.producer() if w is not None else None
    if dq is None or dq.op_type != "DequantizeLinear" or w is None or w.is_graph_output() or readers(w) != [conv]:
        return None
    weight = const(dq.inputs[0])
    return None if weight is None else (dq, weight)


def dq_params(value: ir.Value | None) -> tuple[np.ndarray, int] | None:
    """The step and axis of the DequantizeLinear writing ``value``; None when no DQ with a constant step does."""
    dq = value.producer() if value is not None else None
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale = const_input(dq, 1)
    return None if scale is None else (scale, attr(dq, "axis", 1))


def same_params(a: ir.Node, b: ir.Node) -> bool:
    """Whether Q/DQ nodes ``a`` and ``b`` have equal constant scales, zero points (dtypes too) and axes."""
    per_tensor = False
    for i in (1, 2):
        x, y = const_input(a, i), const_input(b, i)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
        per_tensor = x.ndim == 0  # the zero point's (i = 2) when the loop ends
    return per_tensor or attr(a, "axis", 1) == attr(b, "axis", 1)


def qdq_pairs(graph: ir.Graph) -> Iterator[tuple[ir.Node, list[ir.Node]]]:
    """Each QuantizeLinear of ``graph`` read only by DequantizeLinears, with those DQs."""
    for q in list(graph):
        if q.op_type == "QuantizeLinear":
            found = readers(q.outputs[0])
            dqs = [u for u in found if u.op_type == "DequantizeLinear"]
            if dqs and len(dqs) == len(found):
                yield q, dqs


def dims(value: ir.Value | None) -> list[int | None] | None:
    """The dimensions recorded for ``value`` (None where one is symbolic or unknown); None when its shape is not
    recorded."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def rank(value: ir.Value | None) -> int | None:
    """The rank recorded for ``value``; None when not recorded."""
    shape = dims(value)
    return None if shape is None else len(shape)


def keeps_zero(node: ir.Node) -> bool:
    """A Relu, or a Clip whose constant bounds hold 0: the op maps 0 to 0."""
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip":
        return False
    for index, name, ok in ((1, "min", lambda v: v <= 0), (2, "max", lambda v: v >= 0)):
        given = len(node.inputs) > index and node.inputs[index] is not None
        value = const_input(node, index) if given else attr(node, name)
        if given and value is None:
            return False  # a bound computed at run time
        if value is not None and not ok(float(np.asarray(value).reshape(-1)[0])):
            return False
    return True
