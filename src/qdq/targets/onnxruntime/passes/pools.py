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
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const_input, readers, remove, source
from qdq.targets.onnxruntime.passes._graph import dims, rank

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["flatten_pools", "float_pools_out_of_range", "global_pools"]


def _reduce_axes(node: ir.Node) -> list[int] | None:
    """The constant axes of a ReduceMean (input from opset 18, attribute before); None when unknown."""
    axes = const_input(node, 1) if len(node.inputs) > 1 else attr(node, "axes")
    return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]


def _is_spatial_mean(node: ir.Node) -> bool:
    """A ReduceMean over every spatial axis (2 to rank - 1) that keeps the reduced axes."""
    known = rank(node.inputs[0]) if node.op_type == "ReduceMean" else None
    axes = _reduce_axes(node) if known is not None and known >= 3 else None
    if known is None or axes is None or attr(node, "keepdims", 1) != 1:
        return False
    return sorted(a % known for a in axes) == list(range(2, known))


def global_pools(graph: ir.Graph) -> int:
    """``ReduceMean(x, spatial axes, keepdims=1)`` becomes ``GlobalAveragePool(x)``."""
    count = 0
    for node in graph:
        if not _is_spatial_mean(node):
            continue
        node.op_type = "GlobalAveragePool"
        node.resize_inputs(1)
        node.attributes.clear()
        count += 1
    return count


def flatten_pools(graph: ir.Graph) -> int:
    """``Flatten(axis=1)`` of a ``GlobalAveragePool`` becomes ``Reshape(x, [0, -1])``, which ORT moves its
    Q/DQ across (it does not look through Flatten, and the pool would stay float)."""
    count = 0
    for node in graph:
        pool = source(node.inputs[0]) if node.op_type == "Flatten" else None
        if pool is None or pool.op_type != "GlobalAveragePool" or attr(node, "axis", 1) != 1:
            continue
        node.op_type = "Reshape"
        node.attributes.clear()
        node.resize_inputs(2)
        node.replace_input_with(1, add_const(graph, node.name or "flatten", np.array([0, -1], np.int64)))
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


def float_pools_out_of_range(graph: ir.Graph) -> int:
    """The Q/DQ pairs after each ``DQ -> GlobalAveragePool -> Q`` whose scales ORT's kernel refuses go (module doc)."""
    count = 0
    for pool in [n for n in graph if n.op_type == "GlobalAveragePool"]:
        pairs = _pairs_after(pool)
        if pairs is None or _runs_in_int8(pool, [q for q, _ in pairs], _positions(dims(pool.inputs[0]))):
            continue
        mean = pool.outputs[0]
        for q, dqs in pairs:
            for dq in dqs:
                if dq.outputs[0].is_graph_output():  # a graph output keeps its name: the mean, through an Identity
                    dq.op_type = "Identity"
                    dq.resize_inputs(1)
                    dq.replace_input_with(0, mean)
                else:
                    dq.outputs[0].replace_all_uses_with(mean)
                    remove(graph, [dq])
            remove(graph, [q])
        count += 1
    return count


def _pairs_after(pool: ir.Node) -> list[tuple[ir.Node, list[ir.Node]]] | None:
    """The ``(Q, its DQs)`` that alone read ``pool``'s output, where a DQ feeds the pool; else None."""
    dq = source(pool.inputs[0])
    quantizers = readers(pool.outputs[0])
    if dq is None or dq.op_type != "DequantizeLinear" or not quantizers:
        return None
    pairs = [(q, readers(q.outputs[0])) for q in quantizers]
    if any(q.op_type != "QuantizeLinear" or any(r.op_type != "DequantizeLinear" for r in rs) for q, rs in pairs):
        return None  # another reader (not written by qdq's export): left as it is
    return pairs


def _runs_in_int8(pool: ir.Node, quantizers: list[ir.Node], positions: int | None) -> bool:
    """Does ORT's kernel take the pool's scales (or are they not constants, so not ours to judge)?"""
    dq = source(pool.inputs[0])
    s_x = const_input(dq, 1) if dq is not None else None
    scales = [const_input(q, 1) for q in quantizers]
    if s_x is None or any(s is None for s in scales):
        return True
    return all(_in_range(float(s_x) / float(s_y), positions) for s_y in scales if s_y is not None)
