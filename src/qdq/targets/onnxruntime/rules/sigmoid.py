"""``silu`` and ``sigmoid_output`` (PyTorch only): SiLU and squeeze-excitation gates in ONNX Runtime's int8
kernels.

* ``silu``: a SiLU of a quantized tensor is written ``x * sigmoid(x)``, as ONNX has it (Sigmoid, Mul), so that
  ``sigmoid_output`` can quantize the Sigmoid;
* ``sigmoid_output``: the output of a Sigmoid of a quantized tensor is quantized (``DQ -> Sigmoid -> Q`` is
  ``QLinearSigmoid``) unless every reader already quantizes it. With ``mul_inputs`` ONNX Runtime then runs
  SiLU and the gates as ``QLinearSigmoid`` and ``QLinearMul`` instead of float ops between Q/DQ.

A Keras swish runs in float between the conv's Q/DQ and the next one (these two rules have no Keras form).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext

__all__ = ["SIGMOID_OUTPUT", "SILU"]


def _silu(ctx: PlacementContext) -> None:
    import torch

    from qdq.graphs.fx_ops import meta_outside, silu_input

    graph = ctx.graph_module.graph
    for node in list(graph.nodes):
        x = silu_input(ctx, node)
        if not ctx.is_quantized(x):
            continue
        meta = meta_outside(node)
        with graph.inserting_after(node):
            sigmoid = graph.call_function(torch.sigmoid, (x,))
        with graph.inserting_after(sigmoid):
            product = graph.call_function(operator.mul, (x, sigmoid))
        sigmoid.meta.update(meta)
        product.meta.update(meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        ctx.changes.append(f"{node.name}: SiLU written x * sigmoid(x)")


def _sigmoid_output(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import is_sigmoid

    for node in list(ctx.graph_module.graph.nodes):
        if not (is_sigmoid(ctx, node) and node.args and ctx.is_quantized(node.args[0])):
            continue
        if node.users and all(ctx.quantized_by(user, node) for user in node.users):
            continue
        ctx.quantize_output(node, "sigmoid_quantizer")


SILU = PlacementRule(
    "silu",
    torch=_silu,
    description="A SiLU of a quantized tensor is written x * sigmoid(x), so that its Sigmoid can be quantized.",
)
SIGMOID_OUTPUT = PlacementRule(
    "sigmoid_output",
    torch=_sigmoid_output,
    description="The output of a Sigmoid of a quantized tensor is quantized (QLinearSigmoid).",
)
