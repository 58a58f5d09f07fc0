"""Pass 1, weights: ``Q(W) -> DQ`` with zero point 0 becomes an int8 initializer ``-> DQ`` (the integers ORT would
compute; exact)."""

from __future__ import annotations

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.targets.onnxruntime.passes._graph import quantize_weight

__all__ = ["fold_weight_quantizers"]


def fold_weight_quantizers(g: GraphIndex) -> int:
    """``Q(initializer) -> DQ`` with zero point 0 becomes ``int8 initializer -> DQ``."""
    done = []
    for q in list(g.graph.node):
        if q.op_type != "QuantizeLinear":
            continue
        w, scale, zp = g.array(q.input[0]), g.array(q.input[1]), g.const_input(q, 2)
        if w is None or scale is None or zp is None or np.any(zp != 0) or q.output[0] in g.outputs:
            continue
        name = g.add_const(q.input[0] + "_quantized", quantize_weight(w, scale, zp.dtype, attribute(q, "axis", 1)))
        g.rewire(q.output[0], name)
        done.append(q)
    g.remove(done)
    return len(done)
