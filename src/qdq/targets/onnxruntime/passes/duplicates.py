"""Pass 6, duplicates: several equal Q/DQ pairs on one tensor become one, and ``DQ -> Q`` with equal parameters
(a re-quantization that changes nothing) is removed. Both are exact."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from qdq.graphs.onnx import GraphIndex
from qdq.graphs.onnx_tags import add_quantizer_names, quantizer_names
from qdq.targets.onnxruntime.passes._graph import qdq_pairs, same_params

__all__ = ["merge_duplicate_pairs", "remove_requantization"]


def merge_duplicate_pairs(g: GraphIndex) -> int:
    """Equal Q/DQ pairs reading the same tensor: keep the first."""
    by_input: dict[str, list[tuple[Any, list[Any]]]] = defaultdict(list)
    for q, dqs in qdq_pairs(g):
        if len(dqs) == 1:
            by_input[q.input[0]].append((q, dqs))
    doomed: list[Any] = []
    for pairs in by_input.values():
        keep_q, keep_dqs = pairs[0]
        for q, dqs in pairs[1:]:
            if same_params(g, keep_q, q) and dqs[0].output[0] not in g.outputs:
                g.rewire(dqs[0].output[0], keep_dqs[0].output[0])
                for kept in (keep_q, keep_dqs[0]):
                    add_quantizer_names(kept, quantizer_names(q))
                doomed += [q, dqs[0]]
    g.remove(doomed)
    return len(doomed) // 2


def remove_requantization(g: GraphIndex) -> int:
    """``DQ -> Q`` with equal parameters returns the DQ's input: drop the Q (and the DQ if unused)."""
    doomed: list[Any] = []
    for q in list(g.graph.node):
        dq = g.producer.get(q.input[0]) if q.op_type == "QuantizeLinear" else None
        if dq is None or dq.op_type != "DequantizeLinear" or q.output[0] in g.outputs:
            continue
        if not same_params(g, dq, q):
            continue
        g.rewire(q.output[0], dq.input[0])
        doomed.append(q)
        if len(g.consumers.get(dq.output[0], [])) == 1 and dq.output[0] not in g.outputs:
            doomed.append(dq)
    g.remove(doomed)
    return len(doomed)
