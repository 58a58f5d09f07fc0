"""Pass 3, zero masks after a Conv.

A quantizer with ``amax <= 2**-24`` gives zeros; its export multiplies the input by a 0/1 mask before the Q
(:mod:`qdq.export.mode`). A constant mask Mul right after a Conv (possibly through a Relu, or a Clip whose range
holds 0) is folded into the Conv: the masked output channels get zero int8 weights and a zero bias, which gives
the same zeros, and the Conv keeps its ``-> Q`` form (``QLinearConv``). When every channel is masked the
activation only sees zeros and goes too (ORT could not drop a Clip(0, 6) before a Q of step 1). A mask Mul
whose input is zero anyway (after such Convs, through ops that keep zeros) is removed. Exact for finite inputs,
as the mask itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, const, const_input, name_of, only_readers, remove, single_reader
from qdq.targets.onnxruntime.passes._graph import keeps_zero, same_params, weight_dq

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["drop_masks_of_zeros", "fold_zero_masks"]


def _mask_after(conv: ir.Node) -> tuple[ir.Node, ir.Node | None] | None:
    """``(Mul, activation or None)`` right after ``conv``, through at most one zero-keeping activation."""
    activation = single_reader(conv.outputs[0])
    if activation is not None and keeps_zero(activation):
        mul = single_reader(activation.outputs[0])
    else:
        activation, mul = None, activation
    if mul is None or mul.op_type != "Mul" or len(mul.inputs) != 2 or mul.outputs[0].is_graph_output():
        return None
    return mul, activation


def _channel_mask(mul: ir.Node, value: ir.Value, weight: np.ndarray) -> np.ndarray | None:
    """The 0/1 mask ``mul`` applies to each output channel of a Conv with ``weight``, or None."""
    others = [v for v in mul.inputs if v is not value]
    mask = const(others[0]) if len(others) == 1 else None
    if mask is None or mask.ndim > weight.ndim or not np.all((mask == 0) | (mask == 1)):
        return None
    shape = (1,) * (weight.ndim - mask.ndim) + mask.shape
    if any(n != 1 for i, n in enumerate(shape) if i != 1) or shape[1] not in (1, weight.shape[0]):
        return None
    return np.broadcast_to(mask.reshape(-1), (weight.shape[0],)).astype(bool)


def _masked(weight: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``weight`` with the output channels (axis 0) where ``keep`` is False set to 0."""
    return np.where(keep.reshape((-1,) + (1,) * (weight.ndim - 1)), weight, 0).astype(weight.dtype)


def _fold_mask(graph: ir.Graph, conv: ir.Node, mul: ir.Node, activation: ir.Node | None) -> list[ir.Node]:
    """Zero the int8 weights and bias of the channels ``mul`` masks; return the nodes made useless.

    The Mul's readers then read the activation's output, or the Conv's when every channel is masked (the
    activation then only sees zeros, which it keeps: it goes too, and ORT sees ``Conv -> Q``).
    """
    found = weight_dq(conv)
    zero_point = const_input(found[0], 2) if found is not None else None
    if found is None or zero_point is None or np.any(zero_point != 0):
        return []
    dq, weight = found
    value = (activation or conv).outputs[0]
    keep = _channel_mask(mul, value, weight)
    bias = const_input(conv, 2)
    if keep is None or (len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None):
        return []
    dq.replace_input_with(0, add_const(graph, name_of(dq.inputs[0], "weight") + "_masked", _masked(weight, keep)))
    if bias is not None:
        masked = add_const(
            graph, name_of(conv.inputs[2], "bias") + "_masked", np.where(keep, bias, 0).astype(bias.dtype)
        )
        conv.replace_input_with(2, masked)
    if activation is not None and not keep.any():
        mul.outputs[0].replace_all_uses_with(conv.outputs[0])
        return [mul, activation]
    mul.outputs[0].replace_all_uses_with(value)
    return [mul]


def fold_zero_masks(graph: ir.Graph) -> int:
    """Fold the constant 0/1 mask Muls that follow Convs into the Convs' weights and biases."""
    done = []
    for conv in list(graph):
        found = _mask_after(conv) if conv.op_type == "Conv" else None
        if found is not None:
            done += _fold_mask(graph, conv, *found)
    remove(graph, done)
    return sum(node.op_type == "Mul" for node in done)


_ZERO_KEEPING = frozenset(
    {"Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax", "Reshape",
     "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Resize"}
)  # fmt: skip


def _is_zero_const(value: ir.Value | None) -> bool:
    array = const(value)
    return array is not None and not np.any(array)


def _zero_output(node: ir.Node, zeros: set[ir.Value]) -> bool:
    """Is ``node``'s output zero for every finite input, given the values known to be zero?"""
    op, inputs = node.op_type, [v for v in node.inputs if v is not None]
    if op in _ZERO_KEEPING or (op == "Clip" and keeps_zero(node)):
        return inputs[0] in zeros
    if op == "Mul":
        return any(v in zeros or _is_zero_const(v) for v in inputs)
    if op in ("Add", "Sub", "Concat"):
        return all(v in zeros for v in inputs)
    if op == "DequantizeLinear":
        q = inputs[0].producer()
        return q is not None and q.op_type == "QuantizeLinear" and q.inputs[0] in zeros and same_params(q, node)
    if op == "Conv":
        no_bias = len(inputs) < 3 or _is_zero_const(inputs[2])
        return (inputs[0] in zeros or _is_zero_weight(inputs[1])) and no_bias
    return False


def _is_zero_weight(value: ir.Value) -> bool:
    """A zero constant, or the DequantizeLinear of zero integers with zero points 0."""
    dq = value.producer()
    if dq is None or dq.op_type != "DequantizeLinear":
        return _is_zero_const(value)
    return _is_zero_const(dq.inputs[0]) and (len(dq.inputs) < 3 or _is_zero_const(dq.inputs[2]))


def _zero_values(graph: ir.Graph) -> set[ir.Value]:
    """Values that are zero whatever the (finite) input: after all-zero Convs, in topological order."""
    zeros: set[ir.Value] = set()
    for node in graph:
        if len(node.outputs) == 1 and _zero_output(node, zeros):
            zeros.add(node.outputs[0])
    return zeros


def _is_mask(value: ir.Value | None) -> bool:
    """A constant of zeros and ones."""
    array = const(value)
    return array is not None and bool(np.all((array == 0) | (array == 1)))


def drop_masks_of_zeros(graph: ir.Graph) -> int:
    """Remove the constant 0/1 mask Muls (read only by QuantizeLinear) whose other input is zero anyway."""
    zeros = _zero_values(graph)
    done = []
    for mul in list(graph):
        if mul.op_type != "Mul" or len(mul.inputs) != 2 or not only_readers(mul.outputs[0], ("QuantizeLinear",)):
            continue
        for data, mask in (mul.inputs, mul.inputs[::-1]):
            if data in zeros and _is_mask(mask):
                mul.outputs[0].replace_all_uses_with(data)
                done.append(mul)
                break
    remove(graph, done)
    return len(done)
