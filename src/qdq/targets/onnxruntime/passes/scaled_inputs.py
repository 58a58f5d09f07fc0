"""Scaled inputs: ``Mul(x, c) -> QuantizeLinear(scale s)``, with ``c`` a constant power of two, becomes
``QuantizeLinear(x, scale s / c)``.

Exact: multiplying by a power of two only moves the exponent (no rounding, short of overflow or subnormals), so
``x * c / s`` and ``x / (s / c)`` are the same real number, rounded once, and ``s / c`` is exact too. The
``DequantizeLinear`` keeps ``s``: it still returns ``q * s``, the quantizer's output. This is where the
attention's softmax scale goes on the ``"onnxruntime"`` target (``AttentionFacts.scale_query``: the query is
scaled before its quantizer): the ``Mul`` over the query disappears, and no ``Mul`` is left over the
``[batch, heads, sequence, sequence]`` scores after ``Q·Kᵀ`` (ORT's ``MatMulIntegerToFloat`` cannot take it).

The Q records the factor (node metadata :data:`qdq.graphs.onnx_tags.INPUT_SCALE_KEY`), so that its input tensor,
``x``, is known to be the quantizer's input divided by ``c`` (:class:`qdq.graphs.onnx_tags.QdqSite`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, const, const_input, remove, single_reader, source
from qdq.graphs.onnx import set_metadata
from qdq.graphs.onnx_tags import INPUT_SCALE_KEY

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["fold_scaled_inputs", "power_of_two"]


def power_of_two(value: np.ndarray | None) -> float | None:
    """The value of a one-element positive float32 constant that is a power of two, else None."""
    if value is None or value.size != 1 or value.dtype != np.float32:
        return None
    c = float(value.reshape(-1)[0])
    if not math.isfinite(c) or c <= 0.0 or math.frexp(c)[0] != 0.5:
        return None
    return c


def _scaled_step(step: np.ndarray | None, c: float) -> np.ndarray | None:
    """A per-tensor step divided by ``c``, when that is exact and a normal float32; else None."""
    if step is None or step.size != 1 or step.dtype != np.float32:
        return None
    scaled = (step / np.float32(c)).astype(np.float32)
    ok = np.isfinite(scaled).all() and float(np.abs(scaled).min()) >= np.finfo(np.float32).tiny
    return scaled if ok and np.array_equal(scaled * np.float32(c), step) else None


def _multiplier(mul: ir.Node) -> tuple[ir.Value, float] | None:
    """``(x, c)`` of ``Mul(x, c)`` with ``c`` a power-of-two constant (either input order)."""
    for data, factor in ((0, 1), (1, 0)):
        x, c = mul.inputs[data], power_of_two(const_input(mul, factor))
        if x is not None and c is not None and const(x) is None:
            return x, c
    return None


def fold_scaled_inputs(graph: ir.Graph) -> int:
    """Fold each ``Mul`` by a power-of-two constant that only a per-tensor QuantizeLinear reads into that
    Q's scale (module doc); returns how many."""
    doomed = []
    for q in list(graph):
        mul = source(q.inputs[0]) if q.op_type == "QuantizeLinear" else None
        if mul is None or mul.op_type != "Mul" or single_reader(mul.outputs[0]) is not q:
            continue
        found, step = _multiplier(mul), q.inputs[1]
        scaled = _scaled_step(const(step), found[1]) if found is not None else None
        if found is None or step is None or scaled is None:
            continue
        x, c = found
        q.replace_input_with(1, add_const(graph, f"{step.name}_input_scaled", scaled))  # the step's shape
        q.replace_input_with(0, x)
        set_metadata(q, INPUT_SCALE_KEY, repr(c))
        doomed.append(mul)
    remove(graph, doomed)
    return len(doomed)
