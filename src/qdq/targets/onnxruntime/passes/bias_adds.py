"""Pass 2b, bias adds: an ``Add`` of one constant per output channel right after a Conv (a bias tf2onnx wrote
apart) becomes the Conv's bias; ORT fuses only a Conv whose bias is an input."""

from __future__ import annotations

import numpy as np

from qdq.graphs.onnx import GraphIndex
from qdq.targets.onnxruntime.passes._graph import weight_dq

__all__ = ["fold_bias_adds"]


def _channel_constant(value: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per channel (axis 1 of a rank-``rank`` tensor), when it broadcasts that way."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if shape[0] != 1 or any(n != 1 for n in shape[2:]) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,))


def fold_bias_adds(g: GraphIndex) -> int:
    """``Conv -> Add(constant, one value per output channel)`` becomes the Conv's bias (tf2onnx writes the
    bias of a Conv on 1x1 feature maps as such an Add); ORT fuses only a Conv whose bias is an input."""
    done = []
    for conv in list(g.graph.node):
        add = g.single_reader(conv.output[0]) if conv.op_type == "Conv" else None
        found = weight_dq(g, conv) if add is not None and add.op_type == "Add" else None
        if add is None or found is None:
            continue
        others = [name for name in add.input if name != conv.output[0]]
        value = g.array(others[0]) if len(others) == 1 else None
        bias = g.const_input(conv, 2) if len(conv.input) > 2 and conv.input[2] else None
        if value is None or (len(conv.input) > 2 and conv.input[2] and bias is None):
            continue
        weight = found[1]
        per_channel = _channel_constant(value, weight.ndim, weight.shape[0])
        if per_channel is None:
            continue
        total = per_channel.astype(np.float32) + (0 if bias is None else bias.astype(np.float32))
        name = g.add_const(conv.name + "_bias_folded", total.astype(np.float32))
        g.set_input(conv, 2, name)  # appended to a conv without bias
        g.set_output(conv, 0, add.output[0])
        done.append(add)
    g.remove(done)
    return len(done)
