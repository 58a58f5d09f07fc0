"""Pass 7, global average pooling: ``ReduceMean`` over every spatial axis with ``keepdims`` (how the dynamo
exporter writes ``adaptive_avg_pool2d(x, 1)``) becomes ``GlobalAveragePool``, the same mean, which ORT runs as
``QLinearGlobalAveragePool`` between a DQ and a Q (it has no int8 ReduceMean). Exact up to the float summation
order. A ``Flatten`` after it (the TorchScript exporter's) becomes the equal ``Reshape``, which ORT moves the
next Q across."""

from __future__ import annotations

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.targets.onnxruntime.passes._graph import ranks

__all__ = ["flatten_pools", "global_pools"]


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
