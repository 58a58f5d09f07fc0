"""Attention masks: ``Where(keep, scores, -inf)`` before a Softmax becomes ``scores + Where(keep, 0, -inf)``.

A boolean attention mask is ``[batch, 1, seq, seq]`` (or smaller) while the scores are ``[batch, heads, seq, seq]``:
ONNX Runtime's ``Where`` broadcasts three inputs elementwise with a generic kernel (several times the time of a
``Mul`` over the scores: benchmarks/RESULTS.md, code_figures), where the rewrite runs ``Where`` on the mask's size
and a vectorized broadcasting ``Add`` on the scores. Exact for finite scores: ``x + 0 == x`` and ``x + (-inf) ==
-inf``. Either argument order of ``Where`` (``masked_fill`` exports ``Where(mask, -inf, scores)``) is handled.
"""

from __future__ import annotations

import numpy as np

from qdq.graphs.onnx import GraphIndex

__all__ = ["masks_to_adds"]


def masks_to_adds(g: GraphIndex) -> int:
    """Rewrite each ``Where`` of a ``-inf`` constant and scores read only by a ``Softmax`` (module doc)."""
    from onnx import helper

    done = []
    for where in list(g.graph.node):
        if where.op_type != "Where" or not g.only_readers(where.output[0], ("Softmax",)):
            continue
        fills = [i for i in (1, 2) if _is_minus_inf(g, where.input[i])]
        if len(fills) != 1:
            continue
        fill = fills[0]
        scores = where.input[3 - fill]
        zero = g.add_const(where.name + "_zero", np.zeros((), np.float32))
        bias = g.unique(where.output[0] + "_mask_bias")
        inputs = [where.input[0], where.input[fill], zero] if fill == 1 else [where.input[0], zero, where.input[2]]
        mask = helper.make_node("Where", inputs, [bias], name=where.name + "/mask_bias")
        add = helper.make_node("Add", [scores, bias], [where.output[0]], name=where.name + "/mask_Add")
        g.insert(where, mask)
        g.insert(where, add)
        done.append(where)
    g.remove(done)
    return len(done)


def _is_minus_inf(g: GraphIndex, name: str) -> bool:
    value = g.array(name)
    if value is None or value.size != 1 or value.dtype != np.float32:
        return False
    return float(value.reshape(-1)[0]) == -np.inf
