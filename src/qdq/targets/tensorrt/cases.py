"""Rules of NVIDIA's TF2 toolkit cases (``BNQDQCase``, ``MaxPoolQDQCase``, ``EfficientNetQDQCase``), written once
against the graph view: not in the ``"tensorrt"`` target's default rules, they are what those Keras cases
(:mod:`qdq.keras.cases`) decide, and any front end can run them by name (``apply_placement(rules=[...])``).

* ``norm_inputs``: the input of every BatchNormalization that does not follow a conv (ResNet-v2's
  pre-activation BN, which TensorRT cannot fold);
* ``maxpool_inputs``: the input of every MaxPool (horizontal fusion of the branches of an Inception block);
* ``product_inputs``: both inputs of every product of two tensors (squeeze-excitation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["MAXPOOL_INPUTS", "NORM_INPUTS", "PRODUCT_INPUTS"]


def _norm_inputs(view: GraphView) -> None:
    for norm in view.ops_of(*ops.NORMS):
        producer = norm.inputs[0].producer
        if producer is None or producer.type not in ("Conv", "ConvTranspose"):
            view.quantize_input(norm, 0, "a BatchNorm TensorRT cannot fold into a conv")


def _maxpool_inputs(view: GraphView) -> None:
    for pool in view.ops_of("MaxPool"):
        view.quantize_input(pool, 0, "MaxPool input (horizontal fusion)")


def _product_inputs(view: GraphView) -> None:
    for mul in view.ops_of("Mul"):
        if len(mul.data_inputs) == 2:
            for index, _ in mul.data_inputs:
                view.quantize_input(mul, index, "both inputs of a product (squeeze-excitation)")


NORM_INPUTS = PlacementRule("norm_inputs", _norm_inputs, "The input of a BatchNorm that does not follow a conv.")
MAXPOOL_INPUTS = PlacementRule("maxpool_inputs", _maxpool_inputs, "The input of every MaxPool.")
PRODUCT_INPUTS = PlacementRule("product_inputs", _product_inputs, "Both inputs of every product of two tensors.")
