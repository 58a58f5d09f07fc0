"""Pass 3, zero masks after a Conv.

A quantizer with ``amax <= 2**-24`` gives zeros; its export multiplies the input by a 0/1 mask before the Q
(:mod:`qdq.export.mode`). A constant mask Mul right after a Conv (possibly through a Relu, or a Clip whose range
holds 0) is folded into the Conv: the masked output channels get zero int8 weights and a zero bias, which gives
the same zeros, and the Conv keeps its ``-> Q`` form (``QLinearConv``). When every channel is masked the
activation only sees zeros and goes too (ORT could not drop a Clip(0, 6) before a Q of step 1). A mask Mul
whose input is zero anyway (after such Convs, through ops that keep zeros) is removed. Exact for finite inputs,
as the mask itself."""

from __future__ import annotations

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex
from qdq.targets.onnxruntime.passes._graph import keeps_zero, same_params, weight_dq

__all__ = ["drop_masks_of_zeros", "fold_zero_masks"]


def _mask_after(g: GraphIndex, conv: Any) -> tuple[Any, Any | None] | None:
    """``(Mul, activation or None)`` right after ``conv``, through at most one zero-keeping activation."""
    activation = g.single_reader(conv.output[0])
    if activation is not None and keeps_zero(g, activation):
        mul = g.single_reader(activation.output[0])
    else:
        activation, mul = None, activation
    if mul is None or mul.op_type != "Mul" or len(mul.input) != 2 or mul.output[0] in g.outputs:
        return None
    return mul, activation


def _channel_mask(g: GraphIndex, mul: Any, tensor: str, weight: np.ndarray) -> np.ndarray | None:
    """The 0/1 mask ``mul`` applies to each output channel of a Conv with ``weight``, or None."""
    others = [name for name in mul.input if name != tensor]
    mask = g.array(others[0]) if len(others) == 1 else None
    if mask is None or mask.ndim > weight.ndim or not np.all((mask == 0) | (mask == 1)):
        return None
    shape = (1,) * (weight.ndim - mask.ndim) + mask.shape
    if any(n != 1 for i, n in enumerate(shape) if i != 1) or shape[1] not in (1, weight.shape[0]):
        return None
    return np.broadcast_to(mask.reshape(-1), (weight.shape[0],)).astype(bool)


def _masked(weight: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``weight`` with the output channels (axis 0) where ``keep`` is False set to 0."""
    return np.where(keep.reshape((-1,) + (1,) * (weight.ndim - 1)), weight, 0).astype(weight.dtype)


def _fold_mask(g: GraphIndex, conv: Any, mul: Any, activation: Any | None) -> list[Any]:
    """Zero the int8 weights and bias of the channels ``mul`` masks; return the nodes made useless.

    The Mul's readers then read the activation's output, or the Conv's when every channel is masked (the
    activation then only sees zeros, which it keeps: it goes too, and ORT sees ``Conv -> Q``).
    """
    found = weight_dq(g, conv)
    zero_point = g.const_input(found[0], 2) if found is not None else None
    if found is None or zero_point is None or np.any(zero_point != 0):
        return []
    dq, weight = found
    tensor = (activation or conv).output[0]
    keep = _channel_mask(g, mul, tensor, weight)
    bias = g.const_input(conv, 2)
    if keep is None or (len(conv.input) > 2 and conv.input[2] and bias is None):
        return []
    g.set_input(dq, 0, g.add_const(dq.input[0] + "_masked", _masked(weight, keep)))
    if bias is not None:
        g.set_input(conv, 2, g.add_const(conv.input[2] + "_masked", np.where(keep, bias, 0).astype(bias.dtype)))
    if activation is not None and not keep.any():
        g.rewire(mul.output[0], conv.output[0])
        return [mul, activation]
    g.rewire(mul.output[0], tensor)
    return [mul]


def fold_zero_masks(g: GraphIndex) -> int:
    """Fold the constant 0/1 mask Muls that follow Convs into the Convs' weights and biases."""
    done = []
    for conv in list(g.graph.node):
        found = _mask_after(g, conv) if conv.op_type == "Conv" else None
        if found is not None:
            done += _fold_mask(g, conv, *found)
    g.remove(done)
    return sum(node.op_type == "Mul" for node in done)


_ZERO_KEEPING = frozenset(
    {"Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax", "Reshape",
     "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Resize"}
)  # fmt: skip


def _is_zero_const(g: GraphIndex, name: str) -> bool:
    value = g.array(name) if name else None
    return value is not None and not np.any(value)


def _zero_output(g: GraphIndex, node: Any, zeros: set[str]) -> bool:
    """Is ``node``'s output zero for every finite input, given the tensors known to be zero?"""
    op, inputs = node.op_type, [name for name in node.input if name]
    if op in _ZERO_KEEPING or (op == "Clip" and keeps_zero(g, node)):
        return inputs[0] in zeros
    if op == "Mul":
        return any(name in zeros or _is_zero_const(g, name) for name in inputs)
    if op in ("Add", "Sub", "Concat"):
        return all(name in zeros for name in inputs)
    if op == "DequantizeLinear":
        q = g.producer.get(inputs[0])
        return q is not None and q.op_type == "QuantizeLinear" and q.input[0] in zeros and same_params(g, q, node)
    if op == "Conv":
        no_bias = len(inputs) < 3 or _is_zero_const(g, inputs[2])
        return (inputs[0] in zeros or _is_zero_weight(g, inputs[1])) and no_bias
    return False


def _is_zero_weight(g: GraphIndex, name: str) -> bool:
    """A zero constant, or the DequantizeLinear of zero integers with zero points 0."""
    dq = g.producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return _is_zero_const(g, name)
    return _is_zero_const(g, dq.input[0]) and (len(dq.input) < 3 or _is_zero_const(g, dq.input[2]))


def _zero_tensors(g: GraphIndex) -> set[str]:
    """Tensors that are zero whatever the (finite) input: after all-zero Convs, in topological order."""
    zeros: set[str] = set()
    for node in g.graph.node:
        if len(node.output) == 1 and _zero_output(g, node, zeros):
            zeros.add(node.output[0])
    return zeros


def _is_mask(g: GraphIndex, name: str) -> bool:
    """A constant of zeros and ones."""
    value = g.array(name)
    return value is not None and bool(np.all((value == 0) | (value == 1)))


def drop_masks_of_zeros(g: GraphIndex) -> int:
    """Remove the constant 0/1 mask Muls (read only by QuantizeLinear) whose other input is zero anyway."""
    zeros = _zero_tensors(g)
    done = []
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2 or mul.output[0] in g.outputs:
            continue
        readers = g.consumers.get(mul.output[0], [])
        if not readers or any(r.op_type != "QuantizeLinear" for r in readers):
            continue
        for data, mask in (mul.input, reversed(mul.input)):
            if data in zeros and _is_mask(g, mask):
                g.rewire(mul.output[0], data)
                done.append(mul)
                break
    g.remove(done)
    return len(done)
