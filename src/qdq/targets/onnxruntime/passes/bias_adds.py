"""Pass 2b, bias adds: an ``Add`` of one constant per output channel right after a Conv (a bias tf2onnx wrote
apart) becomes the Conv's bias; ORT fuses only a Conv whose bias is an input."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, const, const_input, remove, single_reader
from qdq.targets.onnxruntime.passes._graph import weight_dq

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["fold_bias_adds"]


def _channel_constant(value: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per channel (axis 1 of a rank-``rank`` tensor), when it broadcasts that way."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if shape[0] != 1 or any(n != 1 for n in shape[2:]) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,))


def fold_bias_adds(graph: ir.Graph) -> int:
    """``Conv -> Add(constant, one value per output channel)`` becomes the Conv's bias (tf2onnx writes the
    bias of a Conv on 1x1 feature maps as such an Add); ORT fuses only a Conv whose bias is an input."""
    done = []
    for conv in list(graph):
        add = single_reader(conv.outputs[0]) if conv.op_type == "Conv" else None
        found = weight_dq(conv) if add is not None and add.op_type == "Add" else None
        if add is None or found is None:
            continue
        others = [v for v in add.inputs if v is not conv.outputs[0]]
        value = const(others[0]) if len(others) == 1 else None
        has_bias = len(conv.inputs) > 2 and conv.inputs[2] is not None
        bias = const_input(conv, 2)
        if value is None or (has_bias and bias is None):
            continue
        weight = found[1]
        per_channel = _channel_constant(value, weight.ndim, weight.shape[0])
        if per_channel is None:
            continue
        total = per_channel.astype(np.float32) + (0 if bias is None else bias.astype(np.float32))
        conv.resize_inputs(3)  # a conv without bias gets one
        conv.replace_input_with(2, add_const(graph, f"{conv.name}_bias_folded", total.astype(np.float32)))
        out, folded = add.outputs[0], conv.outputs[0]
        folded.name, folded.type, folded.shape = out.name, out.type, out.shape
        out.replace_all_uses_with(folded, replace_graph_outputs=True)
        done.append(add)
    remove(graph, done)
    return len(done)
