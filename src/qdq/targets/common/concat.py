"""``concat``: a concatenation whose inputs share one int8 form.

* PyTorch: ``torch.cat`` becomes a :class:`~qdq.nn.QuantConcat`, one quantizer (one scale) for every input,
  which TensorRT needs to keep a concatenation in int8; skipped when every reader of the concatenation
  already quantizes it (their quantizer then gives the shared scale).
* Keras: a ``Concatenate`` one of whose inputs is quantized gets all of them quantized (ONNX Runtime's
  ``QLinearConcat`` takes int8 inputs of any scales).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext
    from qdq.graphs.keras import KerasPlacement

__all__ = ["CONCAT", "all_inputs_once_one_is"]


def _torch(ctx: PlacementContext) -> None:
    from qdq.graphs.fx_ops import concat_arguments
    from qdq.nn.elementwise import QuantConcat

    for node in list(ctx.graph_module.graph.nodes):
        found = concat_arguments(node)
        if found is None:
            continue
        if node.users and all(ctx.quantized_by(user, node) for user in node.users):
            continue
        tensors, dim = found
        new = ctx.replace_with_module(node, "concat", QuantConcat(dim, ctx.quant_desc), (tensors,))
        ctx.changes.append(f"{new.target}: QuantConcat(dim={dim})")


def all_inputs_once_one_is(class_name: str):
    """The Keras rule quantizing every input of each ``class_name`` layer one of whose inputs is quantized."""

    def rule(ctx: KerasPlacement) -> None:
        for layer in ctx.layers:
            plan = ctx.plan(layer)
            if ctx.class_name(layer) == class_name and plan is not None and plan.positions(len(ctx.producers(layer))):
                ctx.quantize_all_inputs(layer)

    return rule


CONCAT = PlacementRule(
    "concat",
    torch=_torch,
    keras=all_inputs_once_one_is("Concatenate"),
    description="A concatenation's inputs share one int8 form: one quantizer on torch.cat; on Keras every input "
    "of a Concatenate once one is quantized.",
)
