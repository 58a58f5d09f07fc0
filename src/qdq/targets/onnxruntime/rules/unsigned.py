"""``unsigned_activations``: a quantizer whose input is non-negative by construction (after ReLU, ReLU6,
Sigmoid, Softmax, or pooling / reshaping / padding of such, or sums and products of such) becomes unsigned:
uint8 over the same range ``[0, amax]``, step ``amax / 255``, zero point 0.

With the zero point at its type's minimum ONNX Runtime drops a ReLU / Clip before the Q and fuses the conv
(notes: ort-int8-notes.md); the model trained and calibrated carries these quantizers, so it computes what
ONNX Runtime computes.

* PyTorch: a quantizer read at several places (QuantConcat's shared one) becomes unsigned only when every
  tensor it quantizes is non-negative; per-channel quantizers stay signed.
* Keras (stage 2, after every rule that adds quantized inputs): each quantized input position whose
  producer's output is non-negative is quantized unsigned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext
    from qdq.graphs.keras import KerasPlacement
    from qdq.quantizer import TensorQuantizer

__all__ = ["UNSIGNED_ACTIVATIONS"]


def _torch(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import is_nonnegative

    inputs: dict[TensorQuantizer, list[Any]] = {}
    for node in ctx.graph_module.graph.nodes:
        for arg, quantizer in ctx.input_quantizers(node):
            inputs.setdefault(quantizer, []).append(arg)
    for quantizer, args in inputs.items():
        if quantizer.unsigned or quantizer.axis is not None:
            continue
        if all(is_nonnegative(ctx, arg) for arg in args):
            quantizer.unsigned = True
            quantizer.narrow_range = False
            ctx.changes.append(f"unsigned quantizer on {', '.join(a.name for a in args)} (>= 0)")


def _keras(ctx: KerasPlacement) -> None:
    for layer in ctx.layers:
        plan = ctx.plan(layer)
        if plan is None:
            continue
        parents = ctx.producers(layer)
        unsigned = frozenset(i for i in plan.positions(len(parents)) if ctx.non_negative(parents[i]))
        ctx.set_unsigned(layer, unsigned)


UNSIGNED_ACTIVATIONS = PlacementRule(
    "unsigned_activations",
    torch=_torch,
    keras=_keras,
    description="Quantizers of tensors that are >= 0 by construction become unsigned (uint8, zero point 0).",
    keras_stage=2,
)
