"""``conv_output``: the output of every quantized conv is quantized, since ``DQ -> Conv -> Q`` is what ONNX
Runtime runs as ``QLinearConv`` (without the Q the Conv runs in float between conversions).

The quantizer goes after the conv's BatchNorm and after an activation ONNX Runtime folds into its int8 conv
(``fusion.folded_activations``: Relu, Clip for ReLU6), else right after the BatchNorm (a SiLU, a Sigmoid, an
add or a pool follows); it is left out when every reader of that tensor already quantizes it.

* PyTorch: a new quantizer on the tensor (looking through dropout / stochastic depth for the readers).
* Keras (stage 0, before the rules that read which inputs are quantized): every layer reading that tensor
  gets it quantized as an input (a layer without a wrapper gets a plain one); a conv's own activation ONNX
  Runtime cannot fold is first split into an ``Activation`` layer (``separates_activations``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from torch import fx

    from qdq.graphs.fx import PlacementContext
    from qdq.graphs.keras import KerasPlacement

__all__ = ["CONV_OUTPUT"]

_KERAS_CONVS = ("Conv2D", "DepthwiseConv2D")


def _folded(ctx: Any) -> frozenset[str]:
    fusion = ctx.target.fusion
    return fusion.folded_activations if fusion is not None else frozenset()


def _chain_end(ctx: PlacementContext, node: fx.Node) -> fx.Node:
    """Follow a conv's output through its BatchNorm and one activation the target folds (each read once)."""
    from qdq.graphs.fx_ops import is_norm, onnx_activation

    if len(node.users) == 1 and is_norm(ctx, next(iter(node.users))):
        node = next(iter(node.users))
    if len(node.users) == 1 and onnx_activation(ctx, next(iter(node.users))) in _folded(ctx):
        node = next(iter(node.users))
    return node


def _torch(ctx: PlacementContext) -> None:
    for node in list(ctx.graph_module.graph.nodes):
        if not ctx.is_conv(node):
            continue
        end = _chain_end(ctx, node)
        if not ctx.readers_quantize(end):
            ctx.quantize_output(end)


def _keras_tail(ctx: KerasPlacement, conv: Any) -> Any:
    """The layer whose output ``QLinearConv`` produces for ``conv``: after its BatchNormalization and a folded
    ReLU / ReLU6 (a layer or an ``Activation``), each the only reader of the one before."""
    folded = _folded(ctx)
    layer = conv
    if ctx.onnx_activation(conv) in folded:
        return layer
    after = ctx.single_use(layer)
    if after is not None and ctx.class_name(after) == "BatchNormalization" and ctx.activation(conv) == "linear":
        layer = after
    after = ctx.single_use(layer)
    if after is not None and ctx.class_name(after) in ("ReLU", "Activation") and ctx.onnx_activation(after) in folded:
        layer = after
    return layer


def _keras(ctx: KerasPlacement) -> None:
    for layer in ctx.layers:
        plan = ctx.plan(layer)
        if ctx.class_name(layer) not in _KERAS_CONVS or plan is None:
            continue
        if not (plan.quantize_weight and 0 in plan.positions(1)):
            continue
        for consumer, position, n_inputs in ctx.readers(_keras_tail(ctx, layer)):
            ctx.quantize_input(consumer, position, n_inputs)


CONV_OUTPUT = PlacementRule(
    "conv_output",
    torch=_torch,
    keras=_keras,
    description="The output of each quantized conv, after its BatchNorm and a folded ReLU/ReLU6, is quantized "
    "(DQ -> Conv -> Q is QLinearConv), unless every reader already quantizes it.",
    keras_stage=0,
    separates_activations=True,
)
