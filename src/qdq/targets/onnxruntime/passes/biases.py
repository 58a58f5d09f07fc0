"""Pass 5, biases: a Conv / Gemm bias becomes int32 with scale ``s_x * s_w`` (per output channel) behind a DQ,
as ORT's ``QLinearConv`` requires; the bias moves by at most ``s_x * s_w / 2``. At 8 bits that is far below an
output step; with 4-bit weights and activations it reaches a few % of one. A Conv ORT cannot fuse (its output
has no Q, e.g. behind a sub-8-bit clamp) runs in float: its bias moves to an ``Add`` after it so that ORT's own
passes do not round it to int32 either."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.targets.onnxruntime.passes._graph import INT32_LIMIT, dq_params, weight_dq

__all__ = ["bias_after_float_convs", "quantize_biases"]


def _bias_scale(g: GraphIndex, node: Any) -> np.ndarray | None:
    """``s_x * s_w`` per output channel, when input and weight are dequantized and the weight axis is 0 (the
    input may be reshaped after its DQ: pass 8's Gemm of an N-D input, which ORT fuses all the same)."""
    source = g.source(node.input[0], through={"Reshape"})
    x = dq_params(g, source.output[0]) if source is not None else None
    w = dq_params(g, node.input[1])
    if x is None or w is None or x[0].ndim != 0:
        return None
    if node.op_type == "Gemm" and (attribute(node, "transB", 0) != 1 or attribute(node, "transA", 0) != 0):
        return None
    if w[0].ndim == 1 and w[1] != 0:
        return None
    return (x[0].astype(np.float32) * w[0].astype(np.float32)).astype(np.float32)


def bias_after_float_convs(g: GraphIndex, float_convs: list[Any]) -> int:
    """Each of ``float_convs`` (Convs ORT cannot fuse: they run in float) gets its bias as an ``Add`` after
    it. Left on the Conv, ORT's WeightBiasQuantization pass would round it to int32 at ``s_x * s_w`` (the Conv
    reads ``DQ(x)``), a loss with no int8 kernel to pay for it; ORT does not fold the Add back (the weight is
    a DQ output, not a constant)."""
    from onnx import helper

    count = 0
    for conv in float_convs:
        bias, weight = g.const_input(conv, 2), weight_dq(g, conv)
        if bias is None or bias.ndim != 1 or weight is None:
            continue
        rank = weight[1].ndim
        shaped = g.add_const(conv.input[2] + "_broadcast", bias.reshape([1, -1] + [1] * (rank - 2)))
        out = conv.output[0]
        conv.output[0] = g.unique(out + "_without_bias")
        del conv.input[2]
        add = helper.make_node("Add", [conv.output[0], shaped], [out], name=(conv.name or "conv") + "/bias_Add")
        g.insert(conv, add, after=True)
        count += 1
    g.refresh()
    return count


def quantize_biases(g: GraphIndex, float_convs: list[Any]) -> int:
    """int32 biases for the Convs ORT fuses and for Gemms; ``float_convs`` keep their exact float bias."""
    count = 0
    skip = {id(conv) for conv in float_convs}
    for node in list(g.graph.node):
        if node.op_type not in ("Conv", "Gemm") or id(node) in skip:
            continue
        bias = g.const_input(node, 2)
        scale = _bias_scale(g, node)
        if bias is None or scale is None or bias.ndim != 1:
            continue
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.rint(bias.astype(np.float32) / safe)
        if np.any(np.abs(q) > INT32_LIMIT) or np.any(scale <= 0):
            warnings.warn(f"{node.name}: bias does not fit int32 at scale s_x*s_w; left float.", stacklevel=2)
            continue
        q_name = g.add_const(node.input[2] + "_int32", q.astype(np.int32))
        s_name = g.add_const(node.input[2] + "_scale", scale)
        z_name = g.add_const(node.input[2] + "_zero", np.zeros(bias.shape, np.int32))
        out = g.unique(node.input[2] + "_dequantized")
        g.insert(node, _make_dq(q_name, s_name, z_name, out, node.name + "/bias_DequantizeLinear"))
        node.input[2] = out
        count += 1
    g.refresh()
    return count


def _make_dq(x: str, scale: str, zp: str, out: str, name: str) -> Any:
    from onnx import helper

    return helper.make_node("DequantizeLinear", [x, scale, zp], [out], name=name, axis=0)
