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
from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, set_metadata
from qdq.graphs.onnx_tags import INPUT_SCALE_KEY

__all__ = ["fold_scaled_inputs", "power_of_two"]


def power_of_two(value: np.ndarray | None) -> float | None:
    """The value of a one-element positive float32 constant that is a power of two, else None."""
    if value is None or value.size != 1 or value.dtype != np.float32:
        return None
    c = float(value.reshape(-1)[0])
    if not math.isfinite(c) or c <= 0.0 or math.frexp(c)[0] != 0.5:
        return None
    return c


def _scaled_step(g: GraphIndex, q: Any, c: float) -> np.ndarray | None:
    """The Q's per-tensor step divided by ``c``, when that is exact and a normal float32; else None."""
    step = g.const_input(q, 1)
    if step is None or step.size != 1 or step.dtype != np.float32:
        return None
    scaled = (step / np.float32(c)).astype(np.float32)
    ok = np.isfinite(scaled).all() and float(np.abs(scaled).min()) >= np.finfo(np.float32).tiny
    return scaled if ok and np.array_equal(scaled * np.float32(c), step) else None


def _multiplier(g: GraphIndex, mul: Any) -> tuple[str, float] | None:
    """``(x, c)`` of ``Mul(x, c)`` with ``c`` a power-of-two constant (either input order)."""
    for data, factor in ((0, 1), (1, 0)):
        c = power_of_two(g.const_input(mul, factor))
        if c is not None and g.array(mul.input[data]) is None:
            return mul.input[data], c
    return None


def fold_scaled_inputs(g: GraphIndex) -> int:
    """Fold each ``Mul`` by a power-of-two constant that only a per-tensor QuantizeLinear reads into that
    Q's scale (module doc); returns how many."""
    doomed = []
    for q in list(g.graph.node):
        mul = g.producer.get(q.input[0]) if q.op_type == "QuantizeLinear" else None
        if mul is None or mul.op_type != "Mul" or not g.is_single_reader(q, mul.output[0]):
            continue
        found = _multiplier(g, mul)
        scaled = _scaled_step(g, q, found[1]) if found is not None else None
        if found is None or scaled is None:
            continue
        x, c = found
        g.set_input(q, 1, g.add_const(q.input[1] + "_input_scaled", scaled))  # the step's shape
        g.set_input(q, 0, x)
        set_metadata(q, INPUT_SCALE_KEY, repr(c))
        doomed.append(mul)
    g.remove(doomed)
    return len(doomed)
