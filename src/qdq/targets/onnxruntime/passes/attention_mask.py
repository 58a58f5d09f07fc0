"""Attention masks: ``Where(keep, scores, -inf)`` before a Softmax becomes ``scores + Where(keep, 0, -inf)``.

A boolean attention mask is ``[batch, 1, seq, seq]`` (or smaller) while the scores are ``[batch, heads, seq, seq]``:
ONNX Runtime's ``Where`` broadcasts three inputs elementwise with a generic kernel (several times the time of a
``Mul`` over the scores: benchmarks/RESULTS.md, code_figures), where the rewrite runs ``Where`` on the mask's size
and a vectorized broadcasting ``Add`` on the scores. Exact for finite scores: ``x + 0 == x`` and ``x + (-inf) ==
-inf``. Either argument order of ``Where`` (``masked_fill`` exports ``Where(mask, -inf, scores)``) is handled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, const, make_node, only_readers, remove

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["masks_to_adds"]


def masks_to_adds(graph: ir.Graph) -> int:
    """Rewrite each ``Where`` of a ``-inf`` constant and scores read only by a ``Softmax`` (module doc)."""
    done = []
    for where in list(graph):
        if where.op_type != "Where" or not only_readers(where.outputs[0], ("Softmax",)):
            continue
        fills = [i for i in (1, 2) if _is_minus_inf(where.inputs[i])]
        if len(fills) != 1:
            continue
        name, scores, inputs = where.name or "", where.inputs[3 - fills[0]], list(where.inputs)
        inputs[3 - fills[0]] = add_const(graph, name + "_zero", np.zeros((), np.float32))
        stem = where.outputs[0].name or "where"
        mask = make_node(graph, "Where", inputs, stem + "_mask_bias", name=name + "/mask_bias")
        add = make_node(graph, "Add", [scores, mask.outputs[0]], stem, name=name + "/mask_Add")
        graph.insert_before(where, [mask, add])
        where.outputs[0].replace_all_uses_with(add.outputs[0])
        done.append(where)
    remove(graph, done)
    return len(done)


def _is_minus_inf(value: ir.Value | None) -> bool:
    array = const(value)
    if array is None or array.size != 1 or array.dtype != np.float32:
        return False
    return float(array.reshape(-1)[0]) == -np.inf
