"""Pass 2, BatchNorm after a Conv is folded into it.

The per-output-channel BN factor ``k = gamma / sqrt(var + eps)`` multiplies the weight *scale* (the int8
weights are unchanged; negated where ``k < 0``), and the bias becomes ``(b - mean) * k + beta``: what TensorRT
does internally, exact up to float32 rounding of ``scale * k`` (one ulp), not bit for bit. Channels with
``k = 0`` get zero int8 weights instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const, const_input, name_of, remove, single_reader, take_place
from qdq.targets.onnxruntime.passes._graph import weight_dq

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["fold_batchnorms"]


def _bn_factor(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    arrays = [const(value) for value in bn.inputs[1:5]]
    constants = [a for a in arrays if a is not None]
    if len(constants) != len(arrays) or len(bn.outputs) != 1:
        return None
    gamma, beta, mean, var = (a.astype(np.float64) for a in constants)
    k = gamma / np.sqrt(var + float(attr(bn, "epsilon", 1e-5)))
    return k, beta - mean * k


def _fold_bn(graph: ir.Graph, conv: ir.Node, bn: ir.Node, dq: ir.Node, wq: np.ndarray) -> bool:
    import onnx_ir as ir

    factors = _bn_factor(bn)
    if factors is None:
        return False
    k, shift = factors
    scale, zp = const_input(dq, 1), const_input(dq, 2)
    if scale is None or zp is None:  # not constants: nothing to fold into
        return False
    channels = wq.shape[0]
    if k.size != channels or np.any(zp != 0):
        return False
    negative = k < 0
    if np.any(wq[negative] == np.iinfo(wq.dtype).min):
        return False  # -(-128) does not fit in int8
    new_wq = wq.copy()
    new_wq[negative] = -new_wq[negative]
    new_wq[k == 0] = 0  # a dead channel: zero weights at the old step (a zero step is no valid scale)
    old_scale = np.broadcast_to(scale.astype(np.float64), (channels,))
    new_scale = np.where(k == 0, old_scale, old_scale * np.abs(k)).astype(np.float32)
    has_bias = len(conv.inputs) > 2 and conv.inputs[2] is not None
    bias = const_input(conv, 2) if has_bias else np.zeros(channels, np.float32)
    if bias is None:
        return False
    new_bias = (bias.astype(np.float64) * k + shift).astype(np.float32)
    for index, array in enumerate((new_wq, new_scale, np.zeros(channels, zp.dtype))):
        dq.replace_input_with(index, add_const(graph, name_of(dq.inputs[index]) + "_bnfold", array))
    dq.attributes["axis"] = ir.AttrInt64("axis", 0)
    conv.resize_inputs(3)  # a conv without bias gets one
    conv.replace_input_with(2, add_const(graph, f"{conv.name}_bias_bnfold", new_bias))
    take_place(bn.outputs[0], conv.outputs[0])
    return True


def fold_batchnorms(graph: ir.Graph) -> int:
    """Fold ``Conv -> BatchNormalization`` when the Conv's weight is a dequantized int8 initializer."""
    done = []
    for conv in list(graph):
        if conv.op_type != "Conv":
            continue
        bn = single_reader(conv.outputs[0])
        weight = weight_dq(conv)
        if bn is None or bn.op_type != "BatchNormalization" or weight is None:
            continue
        if _fold_bn(graph, conv, bn, *weight):
            done.append(bn)
    remove(graph, done)
    return len(done)
