"""``float_recurrent``: LSTM and GRU layers run in float on ONNX Runtime.

ONNX Runtime runs an ONNX ``LSTM`` / ``GRU`` node in its own float kernel, and a quantized layer (the seed's
``QuantLSTM``, unrolled into a loop of quantized matrix products at export) has no int8 kernel there: its
Q/DQ only cost time and keep the layer out of that kernel. So a recurrent layer stays float (PyTorch: the
quantized module becomes its float module again, the same parameters): the export writes one ``LSTM`` node,
and the convs before it still run as ``QLinearConv`` (``conv_output`` quantizes their outputs).

ONNX Runtime also has an int8 recurrent kernel, ``DynamicQuantizeLSTM`` (what ``quantize_dynamic`` writes).
It does pay on the CRNN of ``benchmarks/crnn_int8.py`` (``benchmarks/RESULTS.md``), but it quantizes the
activations at run time from each call's own range (asymmetric uint8): no calibrated model computes that, so a
graph using it would no longer compute what the trained model computes. This target keeps the LSTMs float;
ONNX Runtime's own ``quantize_static`` does the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["FLOAT_RECURRENT"]


def _decide(view: GraphView) -> None:
    for op in view.ops_of(*ops.RECURRENT):  # a quantized layer's own quantizers are inside it: keep every one float
        view.keep_float(op, "ONNX Runtime runs recurrent layers in its float kernel")


FLOAT_RECURRENT = PlacementRule(
    "float_recurrent",
    _decide,
    "Quantized LSTM / GRU layers stay float: ONNX Runtime runs them in its float kernels.",
)
