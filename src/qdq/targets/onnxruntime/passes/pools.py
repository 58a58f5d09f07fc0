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
from qdq.targets.onnxruntime.passes._graph import ranks

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


def _positions(g: GraphIndex, tensor: str) -> int | None:
    """How many spatial positions ``tensor`` (N, C, spatial...) holds, where the graph records every dimension."""
    for value in (*g.graph.input, *g.graph.value_info, *g.graph.output):
        if value.name == tensor and value.type.tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
            spatial = [int(d) for d in dims[2:] if d is not None]
            return math.prod(spatial) if len(dims) >= 3 and len(spatial) == len(dims) - 2 else None
    return None


def _in_range(ratio: float, positions: int | None) -> bool:
    """Does ORT's kernel take ``s_x / s_y = ratio`` for ``positions`` (None: any count below MLAS's bound)?"""
    low, high = _FACTOR_RANGE
    if positions is None:
        return low * _MAX_POSITIONS <= ratio < high
    return low <= ratio / positions < high


def float_pools_out_of_range(g: GraphIndex) -> int:
    """The Q/DQ pairs after each ``DQ -> GlobalAveragePool -> Q`` whose scales ORT's kernel refuses go (module doc)."""
    count = 0
    for pool in [n for n in g.graph.node if n.op_type == "GlobalAveragePool"]:
        dq = g.producer.get(pool.input[0])
        quantizers = list(g.consumers.get(pool.output[0], []))
        if dq is None or dq.op_type != "DequantizeLinear" or not quantizers:
            continue
        if any(q.op_type != "QuantizeLinear" for q in quantizers):
            continue
        s_x, positions = g.const_input(dq, 1), _positions(g, pool.input[0])
        scales = [g.const_input(q, 1) for q in quantizers]
        if s_x is None or any(s is None for s in scales):
            continue
        if all(_in_range(float(s_x) / float(s_y), positions) for s_y in scales if s_y is not None):
            continue
        for q in quantizers:
            readers = list(g.consumers.get(q.output[0], []))  # set_input edits the live list
            if any(r.op_type != "DequantizeLinear" for r in readers):
                break  # an int8 reader (not written by qdq's export): leave it as it is
            outputs = {o.name for o in g.graph.output}
            for dq_after in readers:
                if dq_after.output[0] in outputs:  # a graph output keeps its name: the mean, through an Identity
                    dq_after.op_type = "Identity"
                    g.set_input(dq_after, 1, None)
                    g.set_input(dq_after, 0, pool.output[0])
                else:
                    g.rewire(dq_after.output[0], pool.output[0])
            g.remove([q, *[r for r in readers if r.op_type == "DequantizeLinear"]])
        count += 1
    return count
