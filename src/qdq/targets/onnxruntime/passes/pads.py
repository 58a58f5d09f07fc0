"""Pass 17, pads: a ``Pad`` between a DequantizeLinear and a QuantizeLinear of one grid pads the int8 tensor.

``DQ -> Pad -> Q`` with the same scale and zero point on both sides (the ``data_movers`` rule gives a Pad one
range) is a Pad ONNX Runtime's CPU provider leaves in float: it drops neither conversion (its QDQ selectors have
no rule for ``Pad``; read from onnxruntime 1.32's optimized graphs), so the conv after it reads a float tensor
requantized. ORT's ``Pad`` kernel takes uint8 and int8 tensors, and padding commutes with quantization when the
pad value is on the grid: constant padding by ``v`` is padding the integers by ``round(v / s) + z`` (the zero
point for ``v = 0``: the same-padding of TensorFlow-style convs, the amounts computed from the input's shape or
constant), and ``reflect`` / ``edge`` copy integers. So the Pad reads the DQ's integer input and writes the Q's
output: ``Q -> Pad -> DQ -> Conv``, which ORT runs as an int8 Pad and ``QLinearConv``. Exact. A constant pad value
off the grid leaves the Pad as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const, remove, single_reader, source
from qdq.targets.onnxruntime.passes._graph import same_params

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["pads_on_int8"]


def pads_on_int8(graph: ir.Graph) -> int:
    """Move every ``DQ -> Pad -> Q`` of one grid onto the integers (module doc); returns how many Pads moved."""
    moved: list[tuple[ir.Node, ir.Node]] = []
    for pad in list(graph):
        found = _pad_between(pad) if pad.op_type == "Pad" else None
        value = _integer_value(graph, pad, found[0]) if found is not None else None
        if found is None or value is None:
            continue
        dq, q = found
        if len(pad.inputs) > 2 and pad.inputs[2] is not None:
            pad.replace_input_with(2, value)
        pad.replace_input_with(0, dq.inputs[0])
        pad.outputs[0].type = q.outputs[0].type
        q.outputs[0].replace_all_uses_with(pad.outputs[0])
        moved.append((dq, q))
    idle = [dq for dq, _ in moved if not dq.outputs[0].uses() and not dq.outputs[0].is_graph_output()]
    remove(graph, [q for _, q in moved] + idle)
    return len(moved)


def _pad_between(pad: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """The per-tensor DQ that ``pad`` reads and the one Q that alone reads ``pad``'s output, on one grid; or None."""
    dq = source(pad.inputs[0])
    q = single_reader(pad.outputs[0])
    if dq is None or dq.op_type != "DequantizeLinear" or q is None or q.op_type != "QuantizeLinear":
        return None
    scale = const(dq.inputs[1])
    if scale is None or scale.ndim != 0 or q.outputs[0].is_graph_output() or not same_params(dq, q):
        return None
    return dq, q


def _integer_value(graph: ir.Graph, pad: ir.Node, dq: ir.Node) -> ir.Value | None:
    """The pad value on the integer side: the zero point for ``reflect`` / ``edge`` / ``wrap`` (any value of the
    integer type) and for constant padding by 0; the level of another constant on the grid; None for a value off
    the grid or computed, or an unknown mode."""
    mode = attr(pad, "mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        return None
    padding = pad.inputs[2] if len(pad.inputs) > 2 else None
    given = np.zeros((), np.float32) if padding is None else const(padding)
    if mode != "constant":
        return dq.inputs[2]
    scale, zero = const(dq.inputs[1]), const(dq.inputs[2])
    if given is None or given.size != 1 or scale is None or zero is None:
        return None
    steps = float(given.reshape(())) / float(scale)
    level = round(steps) + int(zero)
    info = np.iinfo(zero.dtype)
    if steps != round(steps) or not info.min <= level <= info.max:
        return None
    if level == int(zero):
        return dq.inputs[2]
    return add_const(graph, f"{pad.outputs[0].name}_value", np.asarray(level, zero.dtype))
