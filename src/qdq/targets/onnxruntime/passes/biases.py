"""Pass 5, biases: a Conv / Gemm bias becomes int32 with scale ``s_x * s_w`` (per output channel) behind a DQ,
as ORT's ``QLinearConv`` requires; the bias moves by at most ``s_x * s_w / 2``. At 8 bits that is far below an
output step; with 4-bit weights and activations it reaches a few % of one. A Conv ORT cannot fuse (its output
has no Q, e.g. behind a sub-8-bit clamp) runs in float: its bias moves to an ``Add`` after it so that ORT's own
passes do not round it to int32 either.

A bias that would not fit int32 at ``s_x * s_w`` (a channel whose weights are all near zero, so its per-channel
step is tiny: depthwise convs after BatchNorm folding) widens that channel's weight step until it fits, as ORT's
own quantizer does: the step becomes ``|bias| / (s_x * BIAS_CODE_LIMIT)`` and the channel's int8 codes are
re-rounded on it, so the conv keeps its int8 kernel. ``BIAS_CODE_LIMIT`` is half of int32's range: the
accumulator adds the products of the codes to the bias and must not overflow either. The channel's weights then
move by at most one new step, which is below ``|bias| / s_x`` over 2**30 of its output: the bias dominates it."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const_input, hand_over, make_node, name_of, source
from qdq.targets.onnxruntime.passes._graph import INT32_LIMIT, dq_params, quantize_weight, weight_dq

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["BIAS_CODE_LIMIT", "WIDENED_METADATA_KEY", "bias_after_float_convs", "quantize_biases"]

#: the largest int32 bias code a widened weight step aims for (half of int32's range: room for the accumulation)
BIAS_CODE_LIMIT = 2**30
#: model metadata key of the widened weight steps (JSON: node name -> the largest factor one of its steps grew by)
WIDENED_METADATA_KEY = "qdq.widened_weights"


def _input_step(node: ir.Node) -> np.ndarray | None:
    """The per-tensor step ``s_x`` of ``node``'s dequantized input (read directly or through a Reshape: pass 8's
    Gemm of an N-D input, which ORT fuses all the same), else None."""
    producer = source(node.inputs[0], through={"Reshape"})
    x = dq_params(producer.outputs[0]) if producer is not None else None
    return None if x is None or x[0].ndim != 0 else x[0]


def _bias_scale(node: ir.Node) -> np.ndarray | None:
    """``s_x * s_w`` per output channel, when input and weight are dequantized and the weight axis is 0."""
    x = _input_step(node)
    w = dq_params(node.inputs[1])
    if x is None or w is None:
        return None
    if node.op_type == "Gemm" and (attr(node, "transB", 0) != 1 or attr(node, "transA", 0) != 0):
        return None
    if w[0].ndim == 1 and w[1] != 0:
        return None
    return (x.astype(np.float32) * w[0].astype(np.float32)).astype(np.float32)


def bias_after_float_convs(graph: ir.Graph, float_convs: list[ir.Node]) -> int:
    """Each of ``float_convs`` (Convs ORT cannot fuse: they run in float) gets its bias as an ``Add`` after
    it. Left on the Conv, ORT's WeightBiasQuantization pass would round it to int32 at ``s_x * s_w`` (the Conv
    reads ``DQ(x)``), a loss with no int8 kernel to pay for it; ORT does not fold the Add back (the weight is
    a DQ output, not a constant)."""
    count = 0
    for conv in float_convs:
        bias, weight = const_input(conv, 2), weight_dq(conv)
        if bias is None or bias.ndim != 1 or weight is None:
            continue
        rank = weight[1].ndim
        shaped = add_const(
            graph, name_of(conv.inputs[2], "bias") + "_broadcast", bias.reshape([1, -1] + [1] * (rank - 2))
        )
        out = conv.outputs[0]
        name = f"{conv.name or 'conv'}/bias_Add"
        add = make_node(graph, "Add", [None, shaped], f"{out.name}_without_bias", name=name)
        hand_over(out, add)  # the Add writes what the Conv wrote, name and all
        conv.resize_inputs(2)
        graph.insert_after(conv, add)
        count += 1
    return count


def quantize_biases(graph: ir.Graph, float_convs: list[ir.Node], widened: dict[str, float] | None = None) -> int:
    """int32 biases for the Convs ORT fuses and for Gemms; ``float_convs`` keep their exact float bias. A weight
    step too small for its bias is widened first (see the module doc); ``widened`` (when given) receives node name
    -> the largest factor one of its steps grew by."""
    count = 0
    skip = set(float_convs)
    for node in list(graph):
        if node.op_type not in ("Conv", "Gemm") or node in skip:
            continue
        bias = const_input(node, 2)
        if bias is None or bias.ndim != 1 or _bias_scale(node) is None:
            continue
        factor = _fit_weight_steps(graph, node, bias.astype(np.float32))
        if factor > 1.0 and widened is not None:
            widened[str(node.name)] = factor
        scale = _bias_scale(node)
        if scale is None:
            continue
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.rint(bias.astype(np.float32) / safe)
        if np.any(np.abs(q) > INT32_LIMIT) or np.any(scale <= 0):
            warnings.warn(f"{node.name}: bias does not fit int32 at scale s_x*s_w; left float.", stacklevel=2)
            continue
        stem = name_of(node.inputs[2], "bias")
        q_bias = add_const(graph, f"{stem}_int32", q.astype(np.int32))
        step = add_const(graph, f"{stem}_scale", scale)
        zero = add_const(graph, f"{stem}_zero", np.zeros(bias.shape, np.int32))
        name = f"{node.name}/bias_DequantizeLinear"
        dq = make_node(graph, "DequantizeLinear", [q_bias, step, zero], f"{stem}_dequantized", name=name, axis=0)
        graph.insert_before(node, dq)
        node.replace_input_with(2, dq.outputs[0])
        count += 1
    return count


def _fit_weight_steps(graph: ir.Graph, node: ir.Node, bias: np.ndarray) -> float:
    """Widen the weight steps of ``node`` whose bias codes at ``s_x * s_w`` would pass :data:`BIAS_CODE_LIMIT` (the
    step becomes ``|bias| / (s_x * BIAS_CODE_LIMIT)``, the int8 codes re-rounded on it); the largest factor a step
    grew by (1.0: none). A weight whose DQ other ops read too is left as it is."""
    found, s_x = weight_dq(node), _input_step(node)
    if found is None or s_x is None or float(s_x) <= 0:
        return 1.0
    dq, codes = found
    step = const_input(dq, 1)
    if step is None or codes.dtype != np.int8:
        return 1.0
    step = step.astype(np.float32)
    needed = (np.abs(bias) / (np.float32(s_x) * np.float32(BIAS_CODE_LIMIT))).astype(np.float32)
    needed = needed if step.ndim == 1 else np.max(needed, initial=0.0)  # a per-tensor step fits its largest bias
    if not np.any(needed > step):
        return 1.0
    wider = np.maximum(step, needed).astype(np.float32)
    axis = attr(dq, "axis", 1)
    values = codes.astype(np.float32) * (step.reshape(_channel_shape(codes.ndim, axis, step)))
    widened = quantize_weight(values, wider, np.dtype(np.int8), axis)
    dq.replace_input_with(0, add_const(graph, name_of(dq.inputs[0], "weight") + "_widened", widened))
    dq.replace_input_with(1, add_const(graph, name_of(dq.inputs[1], "scale") + "_widened", wider))
    return float(np.max(wider / np.where(step > 0, step, wider)))


def _channel_shape(rank: int, axis: int, step: np.ndarray) -> list[int]:
    """The shape that broadcasts a per-channel ``step`` along ``axis`` of a rank-``rank`` weight (a scalar: [])."""
    if step.ndim == 0:
        return []
    shape = [1] * rank
    shape[axis % rank] = -1
    return shape
