"""Pass 2, BatchNorm after a Conv is folded into it.

The per-output-channel BN factor ``k = gamma / sqrt(var + eps)`` multiplies the weight *scale* (the int8
weights are unchanged; negated where ``k < 0``), and the bias becomes ``(b - mean) * k + beta``: what TensorRT
does internally, exact up to float32 rounding of ``scale * k`` (one ulp), not bit for bit. Channels with
``k = 0`` get zero int8 weights instead."""

from __future__ import annotations

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute, set_axis
from qdq.targets.onnxruntime.passes._graph import weight_dq

__all__ = ["fold_batchnorms"]


def _bn_factor(g: GraphIndex, bn: Any) -> tuple[np.ndarray, np.ndarray] | None:
    arrays = [g.array(name) for name in bn.input[1:5]]
    constants = [a for a in arrays if a is not None]
    if len(constants) != len(arrays) or len(bn.output) != 1:
        return None
    gamma, beta, mean, var = (a.astype(np.float64) for a in constants)
    k = gamma / np.sqrt(var + float(attribute(bn, "epsilon", 1e-5)))
    return k, beta - mean * k


def _fold_bn(g: GraphIndex, conv: Any, bn: Any, dq: Any, wq: np.ndarray) -> bool:
    factors = _bn_factor(g, bn)
    if factors is None:
        return False
    k, shift = factors
    scale, zp = g.array(dq.input[1]), g.array(dq.input[2])
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
    bias = g.array(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(channels, np.float32)
    if bias is None:
        return False
    new_bias = (bias.astype(np.float64) * k + shift).astype(np.float32)
    g.set_input(dq, 0, g.add_const(dq.input[0] + "_bnfold", new_wq))
    g.set_input(dq, 1, g.add_const(dq.input[1] + "_bnfold", new_scale))
    g.set_input(dq, 2, g.add_const(dq.input[2] + "_bnfold", np.zeros(channels, zp.dtype)))
    set_axis(dq, 0)
    g.set_input(conv, 2, g.add_const(conv.name + "_bias_bnfold", new_bias))  # appended to a conv without bias
    g.set_output(conv, 0, bn.output[0])
    return True


def fold_batchnorms(g: GraphIndex) -> int:
    """Fold ``Conv -> BatchNormalization`` when the Conv's weight is a dequantized int8 initializer."""
    done = []
    for conv in list(g.graph.node):
        if conv.op_type != "Conv":
            continue
        bn = g.single_reader(conv.output[0])
        weight = weight_dq(g, conv)
        if bn is None or bn.op_type != "BatchNormalization" or weight is None:
            continue
        if _fold_bn(g, conv, bn, *weight):
            done.append(bn)
    g.remove(done)
    return len(done)
