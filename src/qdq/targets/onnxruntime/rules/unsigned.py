"""``unsigned_activations``: a quantizer whose inputs are non-negative by construction (after ReLU, ReLU6,
Sigmoid, Softmax, or pooling / reshaping / padding of such, or sums and products of such; a graph input the
front end knows from the calibration data is >= 0, such as images scaled to [0, 1]) becomes unsigned: uint8 over
the same range ``[0, amax]``, step ``amax / 255``, zero point 0.

With the zero point at its type's minimum ONNX Runtime drops a ReLU / Clip before the Q and fuses the conv
(notes: ort-int8-notes.md); the model trained and calibrated carries these quantizers, so it computes what
ONNX Runtime computes. A quantizer of several tensors (one range shared) becomes unsigned only when every one
of them is non-negative; per-channel quantizers stay signed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["UNSIGNED_ACTIVATIONS"]


def _decide(view: GraphView) -> None:
    for quantizer in view.quantizers():
        if quantizer.unsigned or quantizer.per_channel or not quantizer.sites:
            continue
        if all(not site.value.constant and view.non_negative(site.value) for site in quantizer.sites):
            view.set_unsigned(quantizer, ">= 0 by construction (or, for a graph input, in the calibration data)")


UNSIGNED_ACTIVATIONS = PlacementRule(
    "unsigned_activations",
    _decide,
    "Quantizers of tensors that are >= 0 by construction become unsigned (uint8, zero point 0).",
)
