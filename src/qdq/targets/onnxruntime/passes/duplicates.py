"""Pass 6, duplicates: several equal Q/DQ pairs on one tensor become one, and ``DQ -> Q`` with equal parameters
(a re-quantization that changes nothing) is removed. Both are exact."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import remove, single_reader, source
from qdq.graphs.onnx_tags import add_quantizer_names, quantizer_names
from qdq.targets.onnxruntime.passes._graph import qdq_pairs, same_params

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["merge_duplicate_pairs", "remove_requantization"]


def merge_duplicate_pairs(graph: ir.Graph) -> int:
    """Equal Q/DQ pairs reading the same tensor: keep the first."""
    by_input: dict[ir.Value | None, list[tuple[ir.Node, ir.Node]]] = defaultdict(list)
    for q, dqs in qdq_pairs(graph):
        if len(dqs) == 1:
            by_input[q.inputs[0]].append((q, dqs[0]))
    doomed: list[ir.Node] = []
    for (keep_q, keep_dq), *others in by_input.values():
        for q, dq in others:
            if same_params(keep_q, q) and not dq.outputs[0].is_graph_output():
                dq.outputs[0].replace_all_uses_with(keep_dq.outputs[0])
                for kept in (keep_q, keep_dq):
                    add_quantizer_names(kept, quantizer_names(q))
                doomed += [q, dq]
    remove(graph, doomed)
    return len(doomed) // 2


def remove_requantization(graph: ir.Graph) -> int:
    """``DQ -> Q`` with equal parameters returns the DQ's input: drop the Q (and the DQ if unused)."""
    doomed: list[ir.Node] = []
    for q in list(graph):
        dq = source(q.inputs[0]) if q.op_type == "QuantizeLinear" else None
        if dq is None or dq.op_type != "DequantizeLinear" or q.outputs[0].is_graph_output():
            continue
        x = dq.inputs[0]
        if x is None or not same_params(dq, q):
            continue
        q.outputs[0].replace_all_uses_with(x)
        doomed.append(q)
        if single_reader(dq.outputs[0]) is q:
            doomed.append(dq)
    remove(graph, doomed)
    return len(doomed)
