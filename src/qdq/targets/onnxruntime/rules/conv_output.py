"""``conv_output``: the output of every quantized conv is quantized, since ``DQ -> Conv -> Q`` is what ONNX
Runtime runs as ``QLinearConv`` (without the Q the Conv runs in float between conversions).

The quantizer goes after the conv's BatchNorm and after an activation ONNX Runtime folds into its int8 conv
(``fusion.folded_activations``: Relu, Clip for ReLU6), else right after the BatchNorm (a SiLU, a Sigmoid, an
add or a pool follows); it is left out when every reader of that tensor already quantizes it. On Keras a conv's
own activation that is not folded is split into its own layer, so that the quantizer can go between the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Value

__all__ = ["CONV_OUTPUT", "conv_tail", "folded_tail"]


def conv_tail(view: GraphView, value: Value) -> Value:
    """Follow a conv's output through its BatchNorm and one activation the target folds (each read once)."""
    reader = view.single_reader(value)
    if reader is not None and reader.type in ops.NORMS:
        value = reader.outputs[0]
    return folded_tail(view, value)


def folded_tail(view: GraphView, value: Value) -> Value:
    """``value``, or the output of the one activation the target folds into the int8 op before it (read once;
    identities on the way, such as timm's dropout between a BatchNorm and its activation, are passed)."""
    folded = view.target.fusion.folded_activations if view.target.fusion is not None else frozenset()
    after = _past_identities(view, value)
    reader = view.single_reader(after)
    return reader.outputs[0] if reader is not None and reader.type in folded else value


def _past_identities(view: GraphView, value: Value) -> Value:
    """``value`` past the identities that read it (each read once)."""
    reader = view.single_reader(value)
    while reader is not None and reader.type in ops.IDENTITIES and reader.outputs:
        value = reader.outputs[0]
        reader = view.single_reader(value)
    return value


def _decide(view: GraphView) -> None:
    for conv in view.ops_of("Conv"):
        if not view.is_quantized(conv):
            continue
        tail = conv_tail(view, conv.outputs[0])
        if not view.readers_quantize(tail):
            view.quantize_output(tail, "DQ -> Conv -> Q is QLinearConv")


CONV_OUTPUT = PlacementRule(
    "conv_output",
    _decide,
    "The output of each quantized conv, after its BatchNorm and a folded ReLU/ReLU6, is quantized "
    "(DQ -> Conv -> Q is QLinearConv), unless every reader already quantizes it.",
)
