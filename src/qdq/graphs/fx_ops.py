"""The PyTorch side of the op vocabulary: which ONNX op a ``torch.fx`` node is (:func:`op_type`).

A node calls a module (``call_module``), a function (``call_function``: ``torch.cat``, ``operator.add``) or a
tensor method (``call_method``: ``x.relu()``); each spelling of an op gets the ONNX op type its export writes
(``nn.Conv2d`` and ``F.conv2d``: ``"Conv"``; ``nn.ReLU6``: ``"Clip"`` with ``min`` 0, ``max`` 6; ``nn.SiLU``:
``"Silu"``), with the attributes placement reads. Nothing here knows a target.
"""

from __future__ import annotations

import operator
from typing import Any, SupportsFloat, SupportsIndex

import torch
import torch.nn.functional as F
from torch import fx, nn

from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantModule
from qdq.nn.elementwise import QuantAdd, QuantConcat, QuantMatMul
from qdq.quantizer import TensorQuantizer

__all__ = ["LEAF_CLASS_NAMES", "QDQ_LEAVES", "fetch_attr", "function_type", "is_tensor", "meta_outside", "op_type",
           "returns_sequence"]

#: modules ``torch.fx`` keeps as calls (qdq's quantized modules and quantizers), whatever they contain
QDQ_LEAVES: tuple[type, ...] = (QuantModule, TensorQuantizer)
LEAF_CLASS_NAMES = frozenset({"StochasticDepth"})  # its forward bakes ``self.training`` into a traced call

_NON_TENSOR_METHODS = {"size", "dim", "numel", "item", "tolist", "__len__", "nelement"}

# module class -> ONNX op type, most specific first (quantized modules subclass their float class)
_MODULES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (QuantScaledDotProductAttention, "Attention"),
    (QuantAdd, "Add"),
    (QuantConcat, "Concat"),
    (QuantMatMul, "MatMul"),
    ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "ConvTranspose"),
    (nn.modules.conv._ConvNd, "Conv"),
    (nn.Linear, "Gemm"),
    (nn.modules.batchnorm._BatchNorm, "BatchNormalization"),
    ((nn.LayerNorm,), "LayerNormalization"),
    ((nn.GroupNorm,), "GroupNormalization"),
    ((nn.RMSNorm,), "RMSNormalization"),
    ((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d), "InstanceNormalization"),
    ((nn.LSTM, nn.LSTMCell), "LSTM"),
    ((nn.GRU, nn.GRUCell), "GRU"),
    ((nn.RNN, nn.RNNCell), "RNN"),
    (nn.ReLU, "Relu"),
    (nn.Hardtanh, "Clip"),  # ReLU6 is a Hardtanh
    (nn.SiLU, "Silu"),
    (nn.Sigmoid, "Sigmoid"),
    (nn.Hardsigmoid, "HardSigmoid"),
    (nn.Hardswish, "HardSwish"),
    (nn.GELU, "Gelu"),
    (nn.LeakyReLU, "LeakyRelu"),
    (nn.Tanh, "Tanh"),
    (nn.ELU, "Elu"),
    (nn.Mish, "Mish"),
    (nn.Softmax, "Softmax"),
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity), "Identity"),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), "MaxPool"),
    ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), "AveragePool"),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), "AveragePool"),
    ((nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), "MaxPool"),
    (nn.Flatten, "Flatten"),
    (nn.Upsample, "Resize"),
    (nn.ZeroPad2d, "Pad"),
)
_FUNCTIONS: dict[Any, str] = {
    F.conv1d: "Conv", F.conv2d: "Conv", F.conv3d: "Conv", F.conv_transpose1d: "ConvTranspose",
    F.conv_transpose2d: "ConvTranspose", F.conv_transpose3d: "ConvTranspose", F.linear: "Gemm",
    torch.matmul: "MatMul", operator.matmul: "MatMul", torch.bmm: "MatMul",
    operator.add: "Add", operator.iadd: "Add", torch.add: "Add", operator.mul: "Mul", operator.imul: "Mul",
    torch.mul: "Mul", torch.cat: "Concat", torch.concat: "Concat",
    F.relu: "Relu", torch.relu: "Relu", F.relu6: "Clip", F.hardtanh: "Clip", F.silu: "Silu",
    torch.sigmoid: "Sigmoid", F.sigmoid: "Sigmoid", F.hardsigmoid: "HardSigmoid", F.hardswish: "HardSwish",
    F.gelu: "Gelu", F.leaky_relu: "LeakyRelu", torch.tanh: "Tanh", F.softmax: "Softmax", torch.softmax: "Softmax",
    F.batch_norm: "BatchNormalization", F.layer_norm: "LayerNormalization", F.group_norm: "GroupNormalization",
    F.rms_norm: "RMSNormalization",
    F.max_pool1d: "MaxPool", F.max_pool2d: "MaxPool", F.max_pool3d: "MaxPool", F.avg_pool1d: "AveragePool",
    F.avg_pool2d: "AveragePool", F.avg_pool3d: "AveragePool", F.adaptive_avg_pool1d: "AveragePool",
    F.adaptive_avg_pool2d: "AveragePool", F.adaptive_avg_pool3d: "AveragePool", F.interpolate: "Resize",
    torch.flatten: "Flatten", torch.reshape: "Reshape", torch.squeeze: "Squeeze", torch.unsqueeze: "Unsqueeze",
    torch.permute: "Transpose", torch.transpose: "Transpose", F.pad: "Pad", F.dropout: "Identity",
    operator.getitem: "Slice",
}  # fmt: skip
_FUNCTION_NAMES = {"stochastic_depth": "Identity", "dropout": "Identity"}
_METHODS = {
    "add": "Add", "add_": "Add", "mul": "Mul", "mul_": "Mul", "relu": "Relu", "relu_": "Relu",
    "sigmoid": "Sigmoid", "sigmoid_": "Sigmoid", "softmax": "Softmax", "view": "Reshape", "reshape": "Reshape",
    "flatten": "Flatten", "contiguous": "Identity", "permute": "Transpose", "transpose": "Transpose",
    "squeeze": "Squeeze", "unsqueeze": "Unsqueeze", "mean": "ReduceMean", "max": "ReduceMax", "matmul": "MatMul",
}  # fmt: skip


#: calls that return a sequence of tensors (``operator.getitem`` reads each): the sequence is not a tensor a quantizer
#: can take; its items are
_SEQUENCE_FUNCTIONS = {torch.split, torch.chunk, torch.unbind, torch.tensor_split, torch.Tensor.split,
                       torch.Tensor.chunk, torch.Tensor.unbind, torch.Tensor.tensor_split}  # fmt: skip
_SEQUENCE_METHODS = {"split", "chunk", "unbind", "tensor_split"}
_SEQUENCE_MODULES = (nn.RNNBase, nn.MultiheadAttention)


def returns_sequence(node: fx.Node, module: nn.Module | None) -> bool:
    """Does ``node`` return a tuple or list of tensors (``torch.split``, ``x.chunk``, an LSTM's ``(out, (h, c))``)
    rather than one tensor?"""
    if node.op == "call_function":
        return node.target in _SEQUENCE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _SEQUENCE_METHODS
    return isinstance(module, _SEQUENCE_MODULES)


def fetch_attr(root: nn.Module, target: str) -> Any:
    """``root``'s attribute at the dotted path ``target``, or None."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_tensor(root: nn.Module, node: Any) -> bool:
    """Best-effort: does ``node`` produce a tensor (not a size, a shape entry or a Python number)?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return isinstance(fetch_attr(root, str(node.target)), torch.Tensor)
    if node.op == "call_method":
        return node.target not in _NON_TENSOR_METHODS
    if node.op == "call_function":
        if node.target in (getattr, len):
            return False
        if node.target is operator.getitem:
            return is_tensor(root, node.args[0])
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return any(is_tensor(root, a) for a in node.args)
    return True


def op_type(node: fx.Node, module: nn.Module | None) -> tuple[str, dict[str, Any]]:
    """The ONNX op type ``node`` exports to and the attributes placement reads; ``"torch:<name>"`` when unknown."""
    if module is not None:
        return _module_type(module)
    if node.op == "call_function":
        found = _FUNCTIONS.get(node.target) or _FUNCTION_NAMES.get(getattr(node.target, "__name__", ""))
        if found is not None:
            return found, _function_attrs(node, found)
        return f"torch:{getattr(node.target, '__name__', node.target)}", {}
    if node.op == "call_method":
        found = _METHODS.get(str(node.target))
        return (found, {}) if found is not None else (f"torch:{node.target}", {})
    return f"torch:{node.op}", {}


def function_type(function: Any) -> str | None:
    """The ONNX op type of a torch function (``operator.mul``) or tensor method name (``"mul"``), or None."""
    if isinstance(function, str):
        return _METHODS.get(function)
    return _FUNCTIONS.get(function) or _FUNCTION_NAMES.get(getattr(function, "__name__", ""))


def _module_type(module: nn.Module) -> tuple[str, dict[str, Any]]:
    if type(module).__name__ in LEAF_CLASS_NAMES:  # stochastic depth: the identity at inference
        return "Identity", {}
    for classes, name in _MODULES:
        if isinstance(module, classes):
            return name, _module_attrs(module, name)
    return f"torch:{type(module).__name__}", {}


def _number(value: object) -> float:
    """A module's or a call's constant number as a float; TypeError for anything ``float()`` refuses (a traced
    value: an ``fx.Node``)."""
    if isinstance(value, SupportsFloat | SupportsIndex):
        return float(value)
    raise TypeError(f"float() argument must be a number, not {type(value).__name__!r} ({value!r})")


def _module_attrs(module: nn.Module, name: str) -> dict[str, Any]:
    if name == "Clip":
        return {"min": _number(module.min_val), "max": _number(module.max_val)}
    if name == "Resize":
        return {"mode": str(getattr(module, "mode", "nearest"))}
    if name == "Pad":
        return {"mode": "constant", "value": 0.0}
    return {}


def _function_attrs(node: fx.Node, name: str) -> dict[str, Any]:
    if node.target is F.relu6:
        return {"min": 0.0, "max": 6.0}
    if node.target is F.hardtanh:
        return {"min": _number(node.kwargs.get("min_val", node.args[1] if len(node.args) > 1 else -1.0)),
                "max": _number(node.kwargs.get("max_val", node.args[2] if len(node.args) > 2 else 1.0))}  # fmt: skip
    if name == "Resize":
        return {"mode": str(node.kwargs.get("mode", "nearest"))}
    if node.target is F.pad:
        mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 0.0)
        return {"mode": str(mode), "value": _number(value or 0.0)}
    return {}


def meta_outside(node: fx.Node) -> dict[str, Any]:
    """``node.meta`` with the module ``node`` calls left out of its module stack (new nodes then live in the
    module that called it, and so do quantizers added next to them)."""
    meta = dict(node.meta)
    stack = meta.get("nn_module_stack")
    if stack and node.op == "call_module":
        meta["nn_module_stack"] = {k: v for k, v in stack.items() if k != node.target}
    return meta
