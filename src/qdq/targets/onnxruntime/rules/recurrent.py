"""``float_recurrent`` (PyTorch only): LSTM and GRU layers run in float on ONNX Runtime.

ONNX Runtime runs an ONNX ``LSTM`` / ``GRU`` node in its own float kernel, and a quantized layer (the seed's
``QuantLSTM``, unrolled into a loop of quantized matrix products at export) has no int8 kernel there: its
Q/DQ only cost time and keep the layer out of that kernel. So a quantized recurrent layer becomes its float
module again (:meth:`~qdq.nn.base.QuantInputMixin.to_float`, the same parameters): the export writes one
``LSTM`` node, and the convs before it still run as ``QLinearConv`` (``conv_output`` quantizes their outputs).

ONNX Runtime also has an int8 recurrent kernel, ``DynamicQuantizeLSTM`` (what ``quantize_dynamic`` writes).
It does pay on the CRNN of ``benchmarks/crnn_int8.py`` (``benchmarks/RESULTS.md``), but it quantizes the
activations at run time from each call's own range (asymmetric uint8): no calibrated PyTorch model computes
that, so a graph using it would no longer compute what the trained model computes. This target keeps the
LSTMs float; ONNX Runtime's own ``quantize_static`` does the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext

__all__ = ["FLOAT_RECURRENT"]


def _torch(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import is_recurrent
    from qdq.nn.base import QuantInputMixin

    for node in ctx.graph_module.graph.nodes:
        module = ctx.module(node)
        if isinstance(module, QuantInputMixin) and is_recurrent(ctx, node):
            ctx.swap_module(node, module.to_float())
            ctx.changes.append(f"{node.target}: {type(module).__name__} runs in float (ONNX Runtime's LSTM kernel)")


FLOAT_RECURRENT = PlacementRule(
    "float_recurrent",
    torch=_torch,
    description="Quantized LSTM / GRU layers become float again: ONNX Runtime runs them in its float kernels.",
)
