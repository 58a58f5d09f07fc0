"""Pass 4, uint8 activations: signed activations, int8 with zero point 0, become uint8 with zero point 128 and
the same scale: the same grid, bit-identical dequantized values. (ORT's x86 kernels take uint8 activations; its
own s8->u8 rewrite covers only some pairs and leaves Convs unfused.) Unsigned activations (uint8, zero point 0,
from the ``unsigned_activations`` rule) are kept: ORT then drops the ReLU / ReLU6 before them."""

from __future__ import annotations

import numpy as np

from qdq.graphs.onnx import GraphIndex
from qdq.targets.onnxruntime.passes._graph import qdq_pairs

__all__ = ["activations_to_uint8"]


def activations_to_uint8(g: GraphIndex) -> int:
    """int8 zero point 0 -> uint8 zero point 128 (same scale): the same dequantized values."""
    count = 0
    for q, dqs in list(qdq_pairs(g)):
        zp = g.array(q.input[2])
        if zp is None or zp.dtype != np.int8 or np.any(zp != 0) or q.output[0] in g.outputs:
            continue
        name = g.add_const((q.input[2] or "zero_point") + "_u8", np.full(zp.shape, 128, np.uint8))
        for node in (q, *dqs):
            g.set_input(node, 2, name)
        count += 1
    return count
