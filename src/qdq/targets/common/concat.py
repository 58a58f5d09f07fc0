"""``concat``: a concatenation whose inputs share one int8 form, for TensorRT.

TensorRT keeps a concatenation in int8 only when its inputs share one scale: every data input is quantized
with one range (PyTorch: a :class:`~qdq.nn.QuantConcat`; Keras: a Concatenate wrapper with one range). Skipped
when every reader of the concatenation already quantizes it (their quantizer then gives the shared scale), and for
a model output: nothing after it runs in int8, and one scale over values of different ranges (a detector's pixel
boxes and 0-1 scores) would round the small ones away. Skipped too where no input is a feature map (no input comes
from a weighted op or a model input through activations, norms, sums of features and data movement): a two-stage
detector's regions of interest, box coordinates beside image indices, would lose a few pixels to a step of
``320 / 127`` and feed a float ``RoiAlign``. Concatenations are decided readers first, so that one concatenating
another's output shares its quantizer (two scales along the chain break TensorRT's fused scales).
ONNX Runtime's rule (:mod:`qdq.targets.onnxruntime.rules.int8_concat`) differs: its ``QLinearConcat`` takes
inputs of any scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs.ops import ACTIVATIONS, FEATURE_NORMS, IDENTITIES, LAYOUT, NORMS
from qdq.graphs.view import may_weigh
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Value

__all__ = ["CONCAT"]


#: ops a feature map passes through unchanged in kind: moved, pooled, resized, normalized, activated
_FEATURE_PATH = LAYOUT | NORMS | FEATURE_NORMS | ACTIVATIONS | IDENTITIES | frozenset(
    {"Concat", "Split", "Slice", "Gather", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize",
     "Pad", "DepthToSpace", "SpaceToDepth"})  # fmt: skip
#: elementwise ops that give a feature map where every data input is one (residual sums, gates)
_FEATURE_SUMS = frozenset({"Add", "Sub", "Mul"})


def _decide(view: GraphView) -> None:
    features: dict[str, bool] = {}
    for concat in reversed(view.ops_of("Concat")):  # readers first: a concatenation read by another shares its scale
        output = concat.outputs[0]
        if output.graph_output or view.readers_quantize(output) or len(concat.data_inputs) < 2:
            continue
        if not any(_feature_map(view, value, features) for _, value in concat.data_inputs):
            continue
        shared = None
        for index, _ in concat.data_inputs:
            shared = view.quantize_input(concat, index, "one scale for a concatenation", like=shared, stem="concat")


def _feature_map(view: GraphView, value: Value, memo: dict[str, bool]) -> bool:
    """Is ``value`` a feature map: a model input, the output of a weighted op (attention, a call holding weights) or
    a quantized value, reached through :data:`_FEATURE_PATH` ops and sums or products of feature maps? (Not: shapes,
    indices, coordinates computed against the input's size.)"""
    stack = [value]
    while stack:  # iterative, post-order: a deep network would overflow Python's recursion
        top = stack[-1]
        op = top.producer
        weighs = op is not None and may_weigh(op)
        if op is None or weighs or view.output_quantizer(top) is not None:
            memo[top.name] = op is not None or not top.constant
            stack.pop()
            continue
        through = op.type in _FEATURE_PATH or view.is_bias_add(op)
        sums = op.type in _FEATURE_SUMS and not view.is_bias_add(op)
        inputs = [v for _, v in op.data_inputs] if through or sums else []
        pending = [v for v in inputs if v.name not in memo]
        if pending:
            stack += pending
            continue
        stack.pop()
        found = [memo[v.name] for v in inputs]
        memo[top.name] = bool(found) and (all(found) if sums else any(found))
    return memo[value.name]


CONCAT = PlacementRule(
    "concat",
    _decide,
    "A concatenation's inputs share one quantizer (one scale: TensorRT's int8 concatenation), unless every "
    "reader already quantizes its output or it is a model output.",
)
