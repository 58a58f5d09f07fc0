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

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute
from qdq.targets.onnxruntime.passes._graph import same_params

__all__ = ["pads_on_int8"]


def pads_on_int8(g: GraphIndex) -> int:
    """Move every ``DQ -> Pad -> Q`` of one grid onto the integers (module doc); returns how many Pads moved."""
    moved: list[tuple[Any, Any, Any]] = []
    for pad in list(g.graph.node):
        found = _pad_between(g, pad) if pad.op_type == "Pad" else None
        value = _integer_value(g, pad, found[0]) if found is not None else None
        if found is None or value is None:
            continue
        dq, q = found
        if len(pad.input) > 2 and pad.input[2]:
            g.set_input(pad, 2, value)
        g.set_input(pad, 0, dq.input[0])
        g.rewire(q.output[0], pad.output[0])
        moved.append((pad, dq, q))
    pads = {id(pad) for pad, _, _ in moved}
    idle = [dq for _, dq, _ in moved if dq.output[0] not in g.outputs
            and all(id(reader) in pads for reader in g.consumers.get(dq.output[0], []))]  # fmt: skip
    g.remove([q for _, _, q in moved] + list({id(dq): dq for dq in idle}.values()))
    return len(moved)


def _pad_between(g: GraphIndex, pad: Any) -> tuple[Any, Any] | None:
    """The per-tensor DQ that ``pad`` reads and the one Q that alone reads ``pad``'s output, on one grid; or None."""
    dq = g.producer.get(pad.input[0])
    q = g.single_reader(pad.output[0])
    if dq is None or dq.op_type != "DequantizeLinear" or q is None or q.op_type != "QuantizeLinear":
        return None
    scale = g.array(dq.input[1])
    if scale is None or scale.ndim != 0 or q.output[0] in g.outputs or not same_params(g, dq, q):
        return None
    return dq, q


def _integer_value(g: GraphIndex, pad: Any, dq: Any) -> str | None:
    """The name of the pad value on the integer side: the zero point for ``reflect`` / ``edge`` / ``wrap`` (any
    value of the integer type) and for constant padding by 0; the level of another constant on the grid; None for a
    value off the grid or computed, or an unknown mode."""
    mode = attribute(pad, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("constant", "reflect", "edge", "wrap"):
        return None
    given = g.array(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros((), np.float32)
    if mode != "constant":
        return str(dq.input[2])
    scale, zero = g.array(dq.input[1]), g.array(dq.input[2])
    if given is None or given.size != 1 or scale is None or zero is None:
        return None
    steps = float(given.reshape(())) / float(scale)
    level = round(steps) + int(zero)
    info = np.iinfo(zero.dtype)
    if steps != round(steps) or not info.min <= level <= info.max:
        return None
    if level == int(zero):
        return str(dq.input[2])
    return g.add_const(f"{pad.output[0]}_value", np.asarray(level, zero.dtype))
