"""Pass 7, global average pooling: ``ReduceMean`` over every spatial axis with ``keepdims`` (how the dynamo
exporter writes ``adaptive_avg_pool2d(x, 1)``) becomes ``GlobalAveragePool``, the same mean, which ORT runs as
``QLinearGlobalAveragePool`` between a DQ and a Q (it has no int8 ReduceMean). Exact up to the float summation
order. A ``Flatten`` after it (the TorchScript exporter's) becomes the equal ``Reshape``, which ORT moves the
next Q across.

Pass 15b, pools ORT's kernel refuses: ``QLinearGlobalAveragePool`` computes with the factor
``s_x / (s_y * N)`` (``N`` positions averaged) and fails at run time ("parameter out of computation range") unless
``2^-32 <= s_x / (s_y * N) < 256``; out of it, one of the two ranges is dead (a tensor of zeros has step 1). Such a
pool keeps a float output: the Q/DQ after it go (ORT then runs it float, and what reads it reads the float mean)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.targets.onnxruntime.passes._graph import dims, ranks

__all__ = ["flatten_pools", "float_pools_out_of_range", "global_pools"]


def _reduce_axes(g: GraphIndex, node: Any) -> list[int] | None:
    """The constant axes of a ReduceMean (input from opset 18, attribute before); None when unknown."""
    axes = g.const_input(node, 1) if len(node.input) > 1 else attribute(node, "axes")
    return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]


def _is_spatial_mean(g: GraphIndex, node: Any, ranks: dict[str, int]) -> bool:
    """A ReduceMean over every spatial axis (2 to rank - 1) that keeps the reduced axes."""
    rank = ranks.get(node.input[0]) if node.op_type == "ReduceMean" else None
    axes = _reduce_axes(g, node) if rank is not None and rank >= 3 else None
    if rank is None or axes is None or attribute(node, "keepdims", 1) != 1:
        return False
    return sorted(a % rank for a in axes) == list(range(2, rank))


def global_pools(g: GraphIndex) -> int:
    """``ReduceMean(x, spatial axes, keepdims=1)`` becomes ``GlobalAveragePool(x)``."""
    known = ranks(g)
    count = 0
    for node in g.graph.node:
        if not _is_spatial_mean(g, node, known):
            continue
        node.op_type = "GlobalAveragePool"
        g.set_input(node, 1, None)
        del node.attribute[:]
        count += 1
    return count


def flatten_pools(g: GraphIndex) -> int:
    """``Flatten(axis=1)`` of a ``GlobalAveragePool`` becomes ``Reshape(x, [0, -1])``, which ORT moves its
    Q/DQ across (it does not look through Flatten, and the pool would stay float)."""
    count = 0
    for node in g.graph.node:
        source = g.producer.get(node.input[0]) if node.op_type == "Flatten" else None
        if source is None or source.op_type != "GlobalAveragePool" or attribute(node, "axis", 1) != 1:
            continue
        node.op_type = "Reshape"
        del node.attribute[:]
        g.set_input(node, len(node.input), g.add_const(node.name or "flatten", np.array([0, -1], np.int64)))
        count += 1
    return count


_FACTOR_RANGE = (2.0**-32, 256.0)  # MLAS's bounds on s_x / (s_y * N)
_MAX_POSITIONS = 2**24  # MLAS's bound on N


def _positions(shape: list[int | None] | None) -> int | None:
    """How many spatial positions a tensor of ``shape`` (N, C, spatial...) holds; None where one is unknown."""
    if shape is None or len(shape) < 3 or any(d is None for d in shape[2:]):
        return None
    return math.prod(int(d) for d in shape[2:] if d is not None)


def _in_range(ratio: float, positions: int | None) -> bool:
    """Does ORT's kernel take ``s_x / s_y = ratio`` for ``positions`` (None: any count below MLAS's bound)?"""
    low, high = _FACTOR_RANGE
    if positions is None:
        return low * _MAX_POSITIONS <= ratio < high
    return low <= ratio / positions < high


def float_pools_out_of_range(g: GraphIndex) -> int:
    """The Q/DQ pairs after each ``DQ -> GlobalAveragePool -> Q`` whose scales ORT's kernel refuses go (module doc)."""
    shapes, outputs = dims(g), {o.name for o in g.graph.output}
    count = 0
    for pool in [n for n in g.graph.node if n.op_type == "GlobalAveragePool"]:
        pairs = _pairs_after(g, pool)
        if pairs is None or _runs_in_int8(g, pool, [q for q, _ in pairs], _positions(shapes.get(pool.input[0]))):
            continue
        for q, dqs in pairs:
            for dq in dqs:
                if dq.output[0] in outputs:  # a graph output keeps its name: the mean, through an Identity
                    dq.op_type = "Identity"
                    g.set_input(dq, 1, None)
                    g.set_input(dq, 0, pool.output[0])
                else:
                    g.rewire(dq.output[0], pool.output[0])
                    g.remove([dq])
            g.remove([q])
        count += 1
    return count


def _pairs_after(g: GraphIndex, pool: Any) -> list[tuple[Any, list[Any]]] | None:
    """The ``(Q, its DQs)`` that alone read ``pool``'s output, where a DQ feeds the pool; else None."""
    dq = g.producer.get(pool.input[0])
    quantizers = list(g.consumers.get(pool.output[0], []))
    if dq is None or dq.op_type != "DequantizeLinear" or not quantizers:
        return None
    pairs = [(q, list(g.consumers.get(q.output[0], []))) for q in quantizers]
    if any(q.op_type != "QuantizeLinear" or any(r.op_type != "DequantizeLinear" for r in rs) for q, rs in pairs):
        return None  # another reader (not written by qdq's export): left as it is
    return pairs


def _runs_in_int8(g: GraphIndex, pool: Any, quantizers: list[Any], positions: int | None) -> bool:
    """Does ORT's kernel take the pool's scales (or are they not constants, so not ours to judge)?"""
    s_x = g.const_input(g.producer[pool.input[0]], 1)
    scales = [g.const_input(q, 1) for q in quantizers]
    if s_x is None or any(s is None for s in scales):
        return True
    return all(_in_range(float(s_x) / float(s_y), positions) for s_y in scales if s_y is not None)
