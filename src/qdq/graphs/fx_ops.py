"""The torch vocabulary placement rules read on a ``torch.fx`` graph: which node is a conv, an add, a ReLU...

A node calls a module (``call_module``), a function (``call_function``: ``torch.cat``, ``operator.add``) or a
tensor method (``call_method``: ``x.relu()``); each question below accepts all three spellings of an op.
The answers are about the torch op and the ONNX op it exports to (:func:`onnx_activation`), never about a
target: the targets' rules (:mod:`qdq.targets`) decide what to do with them.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qdq.nn.base import QuantModule
from qdq.nn.elementwise import QuantAdd, QuantConcat, QuantMatMul
from qdq.quantizer import TensorQuantizer

if TYPE_CHECKING:
    from qdq.graphs.fx import PlacementContext

__all__ = [
    "QDQ_LEAVES",
    "add_operands",
    "concat_arguments",
    "is_identity",
    "is_layer_norm",
    "is_nonnegative",
    "is_norm",
    "is_passthrough",
    "is_recurrent",
    "is_sigmoid",
    "is_weighted_module",
    "meta_outside",
    "mul_operands",
    "onnx_activation",
    "silu_input",
]

#: modules ``torch.fx`` keeps as calls (qdq's quantized modules and quantizers), whatever they contain
QDQ_LEAVES: tuple[type, ...] = (QuantModule, TensorQuantizer)
LEAF_CLASS_NAMES = frozenset({"StochasticDepth"})  # its forward bakes ``self.training`` into a traced call

_WEIGHTED_MODULES = (nn.modules.conv._ConvNd, nn.Linear, QuantMatMul)
_WEIGHTED_FUNCTIONS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
                       F.linear, torch.matmul, operator.matmul}  # fmt: skip
_NORM_MODULES = (nn.modules.batchnorm._BatchNorm,)
# Normalizations over features (exported as LayerNormalization / a float reduction): they read float.
_LAYER_NORM_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_LAYER_NORM_FUNCTIONS = {F.layer_norm, F.group_norm, F.rms_norm}
_RECURRENT_MODULES = (nn.RNNBase, nn.RNNCellBase)
# The ONNX op each activation a runtime may fold into an int8 conv exports to (a target's fusion facts list
# which ones it folds).
_ACTIVATION_MODULE_OPS: dict[type, str] = {nn.ReLU: "Relu", nn.ReLU6: "Clip"}
_ACTIVATION_FUNCTION_OPS: dict[Any, str] = {F.relu: "Relu", torch.relu: "Relu", F.relu6: "Clip"}
_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.SiLU, nn.GELU, nn.LeakyReLU, nn.Hardswish, nn.Sigmoid,
                       nn.Tanh, nn.ELU, nn.Mish)  # fmt: skip
_PASS_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_ACTIVATION_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.silu, F.gelu, F.hardswish, torch.sigmoid, F.leaky_relu}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
_MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul}
_MUL_METHODS = {"mul", "mul_"}
_PASS_FUNCTION_NAMES = {"stochastic_depth", "dropout"}

# Non-negative by construction, and ops that keep a non-negative input non-negative.
_NONNEG_MODULES = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Hardsigmoid, nn.Softmax)
_NONNEG_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.sigmoid, F.sigmoid, F.hardsigmoid, F.softmax, torch.softmax}
_NONNEG_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "softmax"}
_KEEP_SIGN_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Flatten, nn.Upsample, *_PASS_MODULES)  # fmt: skip
_KEEP_SIGN_FUNCTIONS = {torch.flatten, torch.reshape, F.adaptive_avg_pool2d, F.adaptive_avg_pool1d,
                        F.adaptive_avg_pool3d, F.avg_pool2d, F.max_pool2d, F.interpolate, torch.squeeze,
                        torch.unsqueeze, torch.permute, torch.transpose}  # fmt: skip
_KEEP_SIGN_METHODS = {"view", "reshape", "flatten", "contiguous", "permute", "transpose", "squeeze", "unsqueeze",
                      "mean", "max"}  # fmt: skip


def is_weighted_module(module: nn.Module) -> bool:
    """Conv / ConvTranspose / Linear / QuantMatMul."""
    return isinstance(module, _WEIGHTED_MODULES)


def is_weighted_function(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _WEIGHTED_FUNCTIONS


def is_norm(ctx: PlacementContext, node: fx.Node) -> bool:
    """A BatchNorm (what a conv's output goes through before the activation)."""
    return isinstance(ctx.module(node), _NORM_MODULES)


def is_layer_norm(ctx: PlacementContext, node: fx.Node) -> bool:
    """A LayerNorm / GroupNorm / RMSNorm (module or function): a transformer's normalization."""
    module = ctx.module(node)
    if module is not None:
        return isinstance(module, _LAYER_NORM_MODULES)
    return node.op == "call_function" and node.target in _LAYER_NORM_FUNCTIONS


def is_recurrent(ctx: PlacementContext, node: fx.Node) -> bool:
    """An LSTM / GRU / RNN layer or cell (float or quantized)."""
    return isinstance(ctx.module(node), _RECURRENT_MODULES)


def is_passthrough(ctx: PlacementContext, node: fx.Node) -> bool:
    """BatchNorm, an activation, dropout or stochastic depth: what a runtime fuses after a weighted op."""
    module = ctx.module(node)
    if module is not None:
        return isinstance(module, (*_NORM_MODULES, *_ACTIVATION_MODULES, *_PASS_MODULES)) or (
            type(module).__name__ in LEAF_CLASS_NAMES
        )
    if node.op == "call_function":
        return node.target in _ACTIVATION_FUNCTIONS or getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES
    return node.op == "call_method" and node.target in ("relu", "relu_")


def is_identity(ctx: PlacementContext, node: fx.Node) -> bool:
    """Dropout, Identity or stochastic depth: the identity at inference."""
    module = ctx.module(node)
    if module is not None:
        return isinstance(module, _PASS_MODULES) or type(module).__name__ in LEAF_CLASS_NAMES
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES


def onnx_activation(ctx: PlacementContext, node: fx.Node) -> str | None:
    """The ONNX op a ReLU / ReLU6 node exports to (``"Relu"``, ``"Clip"``), else None."""
    module = ctx.module(node)
    if module is not None:
        return _ACTIVATION_MODULE_OPS.get(type(module))
    return _ACTIVATION_FUNCTION_OPS.get(node.target) if node.op == "call_function" else None


def _binary_operands(
    ctx: PlacementContext, node: fx.Node, functions: set[Any], methods: set[str]
) -> tuple[fx.Node, fx.Node] | None:
    is_op = (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods
    )
    if not is_op or len(node.args) != 2:
        return None
    a, b = node.args
    if not (ctx.is_tensor(a) and ctx.is_tensor(b)) or a.op == "get_attr" or b.op == "get_attr":  # type: ignore[union-attr]
        return None
    return a, b  # type: ignore[return-value]


def add_operands(ctx: PlacementContext, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of a tensor + tensor node (``+``, ``+=``, ``torch.add``), else None."""
    if node.kwargs.get("alpha", 1) != 1:
        return None
    return _binary_operands(ctx, node, _ADD_FUNCTIONS, _ADD_METHODS)


def mul_operands(ctx: PlacementContext, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of a tensor * tensor node (constants and numbers excluded), else None."""
    if node.kwargs:
        return None
    return _binary_operands(ctx, node, _MUL_FUNCTIONS, _MUL_METHODS)


def concat_arguments(node: fx.Node) -> tuple[list[Any], int] | None:
    """``(tensors, dim)`` of a ``torch.cat`` node with a literal list and dim, else None."""
    if not (node.op == "call_function" and node.target in (torch.cat, torch.concat)):
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or not isinstance(dim, int):
        return None
    return list(tensors), dim


def is_sigmoid(ctx: PlacementContext, node: fx.Node) -> bool:
    if isinstance(ctx.module(node), nn.Sigmoid):
        return True
    if node.op == "call_function":
        return node.target in (torch.sigmoid, F.sigmoid)
    return node.op == "call_method" and node.target == "sigmoid"


def silu_input(ctx: PlacementContext, node: fx.Node) -> Any:
    """The input of a SiLU node (``nn.SiLU`` or ``F.silu``), else None."""
    functional = node.op == "call_function" and node.target is F.silu
    if not (functional or isinstance(ctx.module(node), nn.SiLU)):
        return None
    return node.args[0] if node.args else node.kwargs.get("input")


def meta_outside(node: fx.Node) -> dict[str, Any]:
    """``node.meta`` with the module ``node`` calls left out of its module stack (new nodes then live in the
    module that called it, and so do quantizers added next to them)."""
    meta = dict(node.meta)
    stack = meta.get("nn_module_stack")
    if stack and node.op == "call_module":
        meta["nn_module_stack"] = {k: v for k, v in stack.items() if k != node.target}
    return meta


def is_nonnegative(ctx: PlacementContext, node: Any, depth: int = 0) -> bool:
    """Is ``node`` non-negative by construction (ReLU, Sigmoid... possibly pooled or reshaped)?"""
    if not isinstance(node, fx.Node) or depth > 32:
        return False
    module = ctx.module(node)
    if module is not None:
        return _module_nonnegative(ctx, module, node, depth)
    if node.op == "call_function":
        if node.target in _NONNEG_FUNCTIONS:
            return True
        if node.target in _KEEP_SIGN_FUNCTIONS or getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES:
            return is_nonnegative(ctx, node.args[0], depth + 1)
        if node.target in (operator.add, operator.mul, torch.cat):
            args = node.args[0] if node.target is torch.cat else node.args
            return all(is_nonnegative(ctx, a, depth + 1) for a in args if isinstance(a, fx.Node))  # type: ignore[union-attr]
        return False
    if node.op == "call_method":
        if node.target in _NONNEG_METHODS:
            return True
        return node.target in _KEEP_SIGN_METHODS and is_nonnegative(ctx, node.args[0], depth + 1)
    return False


def _module_nonnegative(ctx: PlacementContext, module: nn.Module, node: fx.Node, depth: int) -> bool:
    if isinstance(module, _NONNEG_MODULES) or (isinstance(module, nn.Hardtanh) and module.min_val >= 0):
        return True
    if isinstance(module, TensorQuantizer):
        return module.unsigned or is_nonnegative(ctx, node.args[0], depth + 1)
    if isinstance(module, QuantConcat):
        return all(is_nonnegative(ctx, a, depth + 1) for a in node.args[0])  # type: ignore[union-attr]
    if isinstance(module, QuantAdd):
        return all(is_nonnegative(ctx, a, depth + 1) for a in node.args[:2])
    keeps = isinstance(module, _KEEP_SIGN_MODULES) or type(module).__name__ in LEAF_CLASS_NAMES
    return keeps and is_nonnegative(ctx, node.args[0], depth + 1)
