"""``residual_add``: the adds that follow a weighted op, and which of their inputs get quantized.

TensorRT fuses an elementwise add into the weighted op (Conv, Gemm) that produces one of its inputs; the
*other* input, the residual, is added in the fused kernel's epilogue, and its precision decides the kernel's
output precision (anchors §4.3, rule 4). So for a target with ``residual_add="skip"`` the input TensorRT fuses
stays float and every other input is quantized: the fused conv then runs int8 in and int8 out. A target with
``residual_add="both"`` (ONNX Runtime's ``QLinearAdd``) quantizes every input.

**Which input is fused** (one choice, both front ends, :func:`fused_input`): among the inputs that come from a
weighted op (through BatchNorm, an activation, dropout or stochastic depth, each read once), the one with the
most weighted ops on its longest path from the model's input; on a tie, the first in argument order. In a
ResNet projection block both inputs come from a conv: the main branch (three convs in a bottleneck, two in a
basic block) is fused and the projection shortcut (one conv) is quantized. Every block of the network then
has the same int8 form: its last main-branch conv fused with the add, the shortcut arriving in int8 (in an
identity block the shortcut is the block's input, already int8). Argument order cannot decide it:
torchvision writes ``out += identity`` (main branch first) where keras.applications writes
``Add([shortcut, x])`` (shortcut first), so a first-in-order rule quantized the shortcut in PyTorch and the
main branch in Keras.

Adds with no weighted input are left alone (a Q/DQ the runtime cannot fuse only costs time).

**Adds read by a layer normalization** (a transformer's residual adds: ``LayerNorm(x + sublayer(x))`` in BERT,
``x + attn(norm1(x))`` read by ``norm2`` in a pre-LN ViT) stay float with ``residual_add="both"``: ONNX Runtime
has no int8 LayerNorm, so the add's output is float and no ``QLinearAdd`` can form; quantized inputs would
only leave a standalone ``DequantizeLinear`` per input before a float ``Add`` (measured on BERT). TensorRT's
``"skip"`` keeps quantizing the shortcut there (its fused kernels read it in int8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext
    from qdq.graphs.keras import KerasPlacement

__all__ = ["RESIDUAL_ADD", "fused_input"]


def fused_input(follows_weighted: Sequence[bool], weighted_depth: Callable[[int], int]) -> int | None:
    """The index of the add input TensorRT fuses into its weighted op (see the module doc), or None when no
    input comes from a weighted op. ``weighted_depth(i)`` is asked only when several inputs do."""
    candidates = [i for i, follows in enumerate(follows_weighted) if follows]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    depths = {i: weighted_depth(i) for i in candidates}
    return max(candidates, key=lambda i: (depths[i], -i))


def _torch(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import add_operands, is_layer_norm
    from qdq.nn.elementwise import QuantAdd

    both = ctx.target.residual_add == "both"
    for node in list(ctx.graph_module.graph.nodes):
        operands = add_operands(ctx, node)
        if operands is None or (both and any(is_layer_norm(ctx, user) for user in node.users)):
            continue
        follows = [ctx.follows_weighted(x) for x in operands]
        fused = fused_input(follows, lambda i, xs=operands: ctx.weighted_depth(xs[i]))
        if fused is None:
            continue
        quantize = (True, True) if both else tuple(i != fused for i in range(2))
        new = ctx.replace_with_module(node, "residual_add", QuantAdd(ctx.quant_desc, quantize=quantize), operands)
        ctx.changes.append(f"{new.target}: QuantAdd(quantize={quantize})")


def _keras(ctx: KerasPlacement) -> None:
    for layer in ctx.layers:
        if ctx.class_name(layer) != "Add":
            continue
        inputs = ctx.producers(layer)
        if ctx.target.residual_add == "both":
            if any(ctx.class_name(reader) == "LayerNormalization" for reader, _, _ in ctx.readers(layer)):
                continue  # read by a float LayerNorm: the add stays float (module doc)
            # once one input is quantized (a conv output, stage 0), all are: QLinearAdd
            plan = ctx.plan(layer)
            if plan is not None and plan.positions(len(inputs)):
                ctx.quantize_all_inputs(layer)
            continue
        fused = fused_input([ctx.follows_weighted(p) for p in inputs], lambda i, xs=inputs: ctx.weighted_depth(xs[i]))
        for position in range(len(inputs)) if fused is not None else ():
            if position != fused:
                ctx.quantize_input(layer, position, len(inputs))


RESIDUAL_ADD = PlacementRule(
    "residual_add",
    torch=_torch,
    keras=_keras,
    description="An add fed by a weighted op: with residual_add='skip' every input but the one TensorRT fuses "
    "(the deepest weighted branch) is quantized; with 'both' every input (QLinearAdd), unless a LayerNorm reads "
    "the sum (float there).",
)
