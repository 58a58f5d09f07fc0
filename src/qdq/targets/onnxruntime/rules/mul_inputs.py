"""``mul_inputs``: a product of two tensors runs as ONNX Runtime's ``QLinearMul`` (the squeeze-excitation
product of EfficientNet), which needs both operands quantized.

* PyTorch: a ``tensor * tensor`` with one operand quantized and its output quantized by every reader gets its
  other operand quantized, by the quantizer another reader already applies to that tensor when there is one
  (ONNX Runtime fuses a tensor with one Q only), else by a new one.
* Keras: a ``Multiply`` one of whose inputs is quantized gets all of them quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.common.concat import all_inputs_once_one_is
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from torch import fx

    from qdq.graphs.fx import PlacementContext

__all__ = ["MUL_INPUTS"]


def _quantize_operand(ctx: PlacementContext, node: fx.Node, index: int) -> None:
    """Quantize argument ``index`` of ``node`` with the quantizer another reader applies to it, else a new one."""
    arg = node.args[index]
    shared = ctx.sibling_quantizer(arg)  # type: ignore[arg-type]
    if shared is None:
        ctx.quantize_input(node, index)
        return
    with ctx.graph_module.graph.inserting_before(node):
        quantized = ctx.graph_module.graph.call_module(shared, args=(arg,))
    node.update_arg(index, quantized)
    ctx.changes.append(f"{shared}: also quantizes input {index} of {node.name}")


def _torch(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import mul_operands

    for node in list(ctx.graph_module.graph.nodes):
        operands = mul_operands(ctx, node)
        if operands is None or not any(ctx.is_quantized(x) for x in operands):
            continue
        if not node.users or not all(ctx.quantized_by(user, node) for user in node.users):
            continue
        for index, x in enumerate(operands):
            if not ctx.is_quantized(x):
                _quantize_operand(ctx, node, index)


MUL_INPUTS = PlacementRule(
    "mul_inputs",
    torch=_torch,
    keras=all_inputs_once_one_is("Multiply"),
    description="A product of two tensors with one operand quantized gets the other quantized (QLinearMul).",
)
