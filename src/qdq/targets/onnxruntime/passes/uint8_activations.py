"""Pass 4, uint8 activations: signed activations, int8 with zero point 0, become uint8 with zero point 128 and
the same scale: the same grid, bit-identical dequantized values. (ORT's x86 kernels take uint8 activations; its
own s8->u8 rewrite covers only some pairs and leaves Convs unfused.) Unsigned activations (uint8, zero point 0,
from the ``unsigned_activations`` rule) are kept: ORT then drops the ReLU / ReLU6 before them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, const
from qdq.targets.onnxruntime.passes._graph import qdq_pairs

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["activations_to_uint8"]


def activations_to_uint8(graph: ir.Graph) -> int:
    """int8 zero point 0 -> uint8 zero point 128 (same scale): the same dequantized values."""
    import onnx_ir as ir

    count = 0
    for q, dqs in list(qdq_pairs(graph)):
        old = q.inputs[2] if len(q.inputs) > 2 else None
        zp = const(old)
        if old is None or zp is None or zp.dtype != np.int8 or np.any(zp != 0) or q.outputs[0].is_graph_output():
            continue
        zero_point = add_const(graph, (old.name or "zero_point") + "_u8", np.full(zp.shape, 128, np.uint8))
        for node in (q, *dqs):
            node.replace_input_with(2, zero_point)
        q.outputs[0].dtype = ir.DataType.UINT8
        count += 1
    return count
