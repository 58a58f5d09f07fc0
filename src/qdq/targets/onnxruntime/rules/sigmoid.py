"""``silu_gate`` and ``sigmoid_output``: SiLU and squeeze-excitation gates in ONNX Runtime's int8 kernels.

* ``silu_gate``: the sigmoid inside a SiLU of a quantized tensor is quantized. Exporters write SiLU as
  ``x * Sigmoid(x)``; with the sigmoid's output quantized ONNX Runtime runs it as ``QLinearSigmoid`` and the
  product as ``QLinearMul`` (PyTorch writes the ``nn.SiLU`` as ``x * sigmoid(x)``, Keras splits a swish into a
  sigmoid and a Multiply layer, to reach that inner tensor);
* ``sigmoid_output``: the output of a Sigmoid of a quantized tensor is quantized (``DQ -> Sigmoid -> Q`` is
  ``QLinearSigmoid``) unless every reader already quantizes it. With ``mul_inputs`` the gates of
  squeeze-excitation then run as ``QLinearSigmoid`` and ``QLinearMul``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["SIGMOID_OUTPUT", "SILU_GATE"]


def _silu_gate(view: GraphView) -> None:
    for silu in view.ops_of(ops.SILU):
        if view.reads_quantized(silu, 0) and "sigmoid" in silu.inner:
            view.quantize_output(silu.inner["sigmoid"], "QLinearSigmoid inside SiLU", stem="sigmoid_quantizer")


def _sigmoid_output(view: GraphView) -> None:
    for sigmoid in view.ops_of("Sigmoid"):
        if view.reads_quantized(sigmoid, 0) and not view.readers_quantize(sigmoid.outputs[0]):
            view.quantize_output(sigmoid.outputs[0], "QLinearSigmoid", stem="sigmoid_quantizer")


SILU_GATE = PlacementRule(
    "silu_gate",
    _silu_gate,
    "The sigmoid inside a SiLU of a quantized tensor is quantized (QLinearSigmoid, then QLinearMul).",
)
SIGMOID_OUTPUT = PlacementRule(
    "sigmoid_output",
    _sigmoid_output,
    "The output of a Sigmoid of a quantized tensor is quantized (QLinearSigmoid).",
)
