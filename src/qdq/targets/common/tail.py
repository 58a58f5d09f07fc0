"""``output_tail``: the ops after a model's last weighted ops stay float.

A model's output tail (:meth:`qdq.graphs.view.GraphView.in_output_tail`) is what it computes after its last
weighted ops on the way to its outputs: a detector's box decoding and score sigmoids, the concatenation of pixel
coordinates with 0-1 scores, a segmentation net's mask sigmoids, a recurrent model's state output. No int8 kernel
follows it, so a quantizer there buys no int8 work downstream, and it rounds what the model returns to 8 bits
(one scale over a concatenation of pixels and scores rounds the scores away; a state output carries its rounding
into the next step). The rule runs last: every quantizer the other rules placed on a tail op's inputs or outputs
goes. What the runtime computes inside a weighted op's kernel is not the tail: its BatchNorm and an activation the
target folds into it (ONNX Runtime's ReLU and ReLU6: the output quantizer after them makes the ``QLinearConv``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Op

__all__ = ["OUTPUT_TAIL"]

_WHY = "output tail: nothing after it runs in int8"


def _decide(view: GraphView) -> None:
    for op in [op for op in view.ops if view.in_output_tail(op) and not _in_weighted_kernel(view, op)]:
        for value in op.outputs:
            if view.output_quantizer(value) is not None:
                view.keep_value_float(value, _WHY)
        if any(_own_site(view, op, i) for i in range(len(op.inputs))):
            view.keep_float(op, _WHY)


def _in_weighted_kernel(view: GraphView, op: Op) -> bool:
    """Is ``op`` a BatchNorm, an identity or an activation the target folds, between a weighted op and its output
    quantizer (each value on the way read once)?"""
    folded = view.target.fusion.folded_activations if view.target.fusion is not None else frozenset()
    fusable = ops.NORMS | ops.IDENTITIES | folded
    while op.type in fusable and op.data_inputs:
        value = op.data_inputs[0][1]
        if value.producer is None or view.single_reader(value) is not op:
            return False
        op = value.producer
    return op.type in ops.WEIGHTED


def _own_site(view: GraphView, op: Op, index: int) -> bool:
    """Whether ``op`` reads input ``index`` through a quantizer of its own (not the value's, for every reader)."""
    return view.quantizer_at(op, index) is not None and view.output_quantizer(op.inputs[index]) is None


OUTPUT_TAIL = PlacementRule(
    "output_tail",
    _decide,
    "The ops after the model's last weighted ops (reaching its outputs) stay float: no int8 kernel follows them.",
)
