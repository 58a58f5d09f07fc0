"""The ``"tensorrt"`` target: TensorRT's explicit quantization (Q/DQ), on GPU.

TensorRT fuses a ``DequantizeLinear`` into the op after it and a ``QuantizeLinear`` into the op before it, and
quantizes nothing the graph does not (notes: anchors §4). So Q/DQ go on the inputs and weights of weighted
ops (module replacement does that), never on their outputs: TensorRT fuses BatchNorm and the activation into
the conv by itself. Placement adds what module replacement cannot reach:

* ``residual_add`` (``residual_add="skip"``): the inputs of a residual add other than the one TensorRT fuses
  into the conv that produces it (:mod:`qdq.targets.common.residual`);
* ``concat``: one scale for every input of a concatenation (:mod:`qdq.targets.common.concat`).

The graph is exported as it is traced (no ONNX rewrite): signed int8, zero point 0, weights as
``Q(float weight) -> DQ``. OpenVINO runs the same graph with every convolution in u8; ONNX Runtime runs it,
but fuses a Conv into ``QLinearConv`` only when its output is quantized, so its Convs stay float there.

Adding a rule: write it (a :class:`~qdq.targets.rules.PlacementRule` with a ``torch`` and, where Keras can
express it, a ``keras`` function) in a module of this package and append it to ``RULES`` below.
"""

from __future__ import annotations

from qdq.targets.common.concat import CONCAT
from qdq.targets.common.residual import RESIDUAL_ADD
from qdq.targets.target import ExportDefaults, RuntimeSupport, Target

__all__ = ["RULES", "RUNTIMES", "TENSORRT"]

RULES = (RESIDUAL_ADD, CONCAT)

RUNTIMES = (
    RuntimeSupport("tensorrt", "native"),
    RuntimeSupport("openvino", "native"),
    RuntimeSupport(
        "onnxruntime",
        "runs",
        "ONNX Runtime runs a Conv as QLinearConv only when its output is quantized, and the tensorrt target "
        "quantizes the inputs and weights of Convs only, so they run in float between Q/DQ conversions",
    ),
)

TENSORRT = Target(
    name="tensorrt",
    description="TensorRT explicit quantization (the same graph runs in u8 on OpenVINO)",
    placement_rules=RULES,
    residual_add="skip",
    export=ExportDefaults(opset=None),
    runtimes=RUNTIMES,
)
