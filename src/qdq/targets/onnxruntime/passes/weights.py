"""Pass 1, weights: ``Q(W) -> DQ`` with zero point 0 becomes an int8 initializer ``-> DQ`` (the integers ORT would
compute; exact)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const, const_input, name_of, remove
from qdq.targets.onnxruntime.passes._graph import quantize_weight

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["fold_weight_quantizers"]


def fold_weight_quantizers(graph: ir.Graph) -> int:
    """``Q(initializer) -> DQ`` with zero point 0 becomes ``int8 initializer -> DQ``."""
    done = []
    for q in list(graph):
        if q.op_type != "QuantizeLinear":
            continue
        w, scale, zp = const(q.inputs[0]), const_input(q, 1), const_input(q, 2)
        if w is None or scale is None or zp is None or np.any(zp != 0) or q.outputs[0].is_graph_output():
            continue
        stem = name_of(q.inputs[0], "weight") + "_quantized"
        q.outputs[0].replace_all_uses_with(
            add_const(graph, stem, quantize_weight(w, scale, zp.dtype, attr(q, "axis", 1)))
        )
        done.append(q)
    remove(graph, done)
    return len(done)
