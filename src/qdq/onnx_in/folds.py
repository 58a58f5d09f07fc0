"""The folds and fusions :func:`qdq.onnx_in.load.prepare` makes: rules of onnxscript's rewriter.

onnxscript's own rules, under qdq's guards: ``FuseBatchNormIntoConv`` (not a BatchNormalization writing its
training outputs: it normalizes with the batch's statistics); ``ConvAffineFusion`` (``Conv -> Mul(s) -> Add(d)``,
``s`` and ``d`` one number each and a constant bias; not when ``s`` or ``d`` has more than one axis, its fused bias
would take their shape, nor when the weight or bias is read elsewhere, the fused constants being named after them);
``HardSwishFusion`` (``x * Clip(x + 3, 0, 6) / 6``; not its hard-sigmoid rules). qdq's own rules, where onnxscript
has none: a constant scale (``Mul``) or shift (``Add``) after a Conv, per tensor or per output channel, with or
without a bias (PP-LCNetV3's learnt affine layers), and the hard-swish written ``* (1 / 6)`` (PyTorch's export).

Every rule acts on the main graph only (a branch's weights live in the main graph: a fold inside a branch would put
new ones there); a fold keeps its conv's name (``keep_float`` and the report name ops), a ``HardSwish`` is named
``<output>/HardSwish``. A fold computes in float64 and rounds once to the weight's type (onnxscript computes in the
weights' type): a scale and a shift that qdq's rules fold one after the other round the bias twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet
from onnxscript.rewriter.rules.common._fuse_batchnorm import FuseBatchNormIntoConv
from onnxscript.rewriter.rules.common._fuse_conv_affine import ConvAffineFusion
from onnxscript.rewriter.rules.common._fuse_hardswish import HardSwishFusion

__all__ = ["BATCHNORMS", "HARD_SWISHES", "SCALE_SHIFTS"]

Bindings = dict[str, Any]


def _rule(pattern: Callable[..., Any], replacement: Callable[..., Any], condition: Callable[..., Any],
          *, conv: str = "conv_out", float64: bool = False, refuse: Callable[[Bindings], str | None] = lambda b: None,
          ) -> RewriteRule:  # fmt: skip
    """A rule of the main graph: ``refuse`` (a reason or None), ``condition``, then ``replacement`` (in float64 when
    ``float64``), its node named as the conv it replaces (``conv``: its output's binding) or ``<output>/<op>``."""
    replaced: list[str] = [""]

    def check(context: Any, **bindings: Any) -> Any:
        reason = "a subgraph" if context.graph_or_function is not context.model.graph else refuse(bindings)
        if reason is not None:
            return MatchResult().fail(reason)
        replaced[0] = context.output_values[0].name
        return condition(context, **bindings)

    def rewrite(op: Any, **bindings: Any) -> Any:
        value = _in_float64(replacement, op, bindings, conv) if float64 else replacement(op, **bindings)
        node = value.producer()
        node.name = bindings[conv].producer().name if conv in bindings else f"{replaced[0]}/{node.op_type}"
        return value

    return RewriteRule(pattern, rewrite, check)  # unnamed: no record of the rule on the nodes it makes


def _in_float64(replacement: Callable[..., Any], op: Any, bindings: Bindings, conv: str) -> Any:
    """``replacement`` with the float constants it reads as float64, those it makes cast back to the weight's type."""
    dtype = _array(bindings[conv].producer().inputs[1]).dtype
    read = _constants_of([v for k, v in bindings.items() if k != "x"])
    for v, tensor in read.items():
        v.const_value = ir.tensor(tensor.numpy().astype(np.float64), name=v.name)
    try:
        value = replacement(op, **bindings)
    finally:
        for v, tensor in read.items():
            v.const_value = tensor
    for v, tensor in _constants_of([value]).items():
        if v not in read and tensor.dtype == ir.DataType.DOUBLE:
            v.const_value = ir.tensor(tensor.numpy().astype(dtype), name=v.name)
            v.type = ir.TensorType(v.const_value.dtype)
    return value


def _batchnorm_refusal(bindings: Bindings) -> str | None:
    training = len(bindings["batchnorm_out"].producer().outputs) != 1
    return "a BatchNormalization in training mode" if training else None


def _affine_refusal(bindings: Bindings) -> str | None:
    if any(_array(bindings[name]) is None or _array(bindings[name]).ndim > 1 for name in ("scale", "offset")):
        return "a scale or shift of more than one axis"
    return "a weight read elsewhere" if any(len(bindings[name].uses()) > 1 for name in ("w", "b")) else None


def _conv_then(op_type: str) -> RewriteRule:
    """``Conv -> Mul(c)`` (weight ``W * c``, bias ``b * c``) or ``Conv -> Add(c)`` (bias ``b + c``), ``c`` one
    number or one per output channel; a conv without bias gets one."""

    def pattern(op: Any, x: Any, c: Any) -> Any:
        conv = op.Conv(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["conv_out"])
        return getattr(op, op_type)(conv, c, _outputs=["out"])

    def condition(context: Any, conv_out: ir.Value, c: ir.Value, **_: Any) -> bool:
        conv = conv_out.producer()
        if conv is None or len(conv.inputs) not in (2, 3) or any(_array(v) is None for v in conv.inputs[1:]):
            return False
        return _channel_values(conv, c) is not None

    def replacement(op: Any, x: ir.Value, c: ir.Value, conv_out: ir.Value, out: ir.Value) -> ir.Value:
        conv = conv_out.producer()
        assert conv is not None
        value, weight = _channel_values(conv, c), _array(conv.inputs[1])
        assert value is not None  # the condition
        bias = _array(conv.inputs[2]) if len(conv.inputs) > 2 else np.zeros(weight.shape[0])
        new_weight: Any = conv.inputs[1]
        if op_type == "Mul":
            scaled = weight.astype(np.float64) * value.reshape(-1, *([1] * (weight.ndim - 1)))
            new_weight = op.initializer(ir.tensor(scaled.astype(weight.dtype)), name=f"{out.name}_folded_weight")
        new_bias = bias.astype(np.float64) * value if op_type == "Mul" else bias.astype(np.float64) + value
        bias_value = op.initializer(ir.tensor(new_bias.astype(weight.dtype)), name=f"{out.name}_folded_bias")
        return op.Conv(x, new_weight, bias_value, **conv.attributes)

    return _rule(pattern, replacement, condition)


def _hard_swish_by_sixth() -> RewriteRule:
    """``x * Clip(x + 3, 0, 6) * (1 / 6)``, its constants within onnxscript's tolerance."""

    def pattern(op: Any, x: Any, low: Any, high: Any, three: Any, sixth: Any) -> Any:
        return op.Clip(x + three, low, high) * x * sixth

    def condition(context: Any, **bindings: Any) -> bool:
        values = {name: _array(bindings[name]) for name in ("low", "high", "three", "sixth")}
        if any(v is None or v.size != 1 for v in values.values()):
            return False
        return all(np.isclose(values[n].item(), v, rtol=1e-4, atol=0) for n, v in zip(values, (0, 6, 3, 1 / 6)))

    return _rule(pattern, lambda op, x, **_: op.HardSwish(x), condition)


def _array(value: ir.Value | None) -> Any:
    """The constant ``value`` holds (an initializer's or a ``Constant``'s), as numpy; None for data."""
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def _constants_of(values: list[ir.Value]) -> dict[ir.Value, ir.TensorProtocol]:
    """The float constants among ``values`` and among the inputs of the nodes that compute them, with their
    tensors."""
    nodes = [v.producer() for v in values]
    found = [*values, *(v for node in nodes if node is not None for v in node.inputs)]
    tensors = {v: v.const_value for v in found if v is not None}
    return {v: t for v, t in tensors.items() if t is not None and t.dtype.is_floating_point()}


def _channel_values(conv: ir.Node, constant: ir.Value) -> np.ndarray | None:
    """``constant`` as one float64 number per output channel of ``conv``'s output (one element, or ``C`` along axis
    1 of the output, broadcast right-aligned), else None."""
    value, weight = _array(constant), _array(conv.inputs[1])
    if value is None or weight is None or value.ndim > weight.ndim:
        return None
    channels = weight.shape[0]
    if value.size == 1:
        return np.full(channels, value.reshape(()), np.float64)
    shape = (1,) * (weight.ndim - value.ndim) + value.shape
    if shape[1] != channels or any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    return np.asarray(value.reshape(channels), np.float64)


def _library(rule: Any, **guards: Any) -> RewriteRule:
    """onnxscript's ``rule`` (an instance of one of its rule classes) under qdq's guards (:func:`_rule`)."""
    return _rule(rule.pattern, rule.rewrite, rule.check, **guards)


#: the rule sets, applied in this order (a scale-and-shift after a BatchNorm folds into the folded conv)
BATCHNORMS = RewriteRuleSet([_library(FuseBatchNormIntoConv(), conv="inbound_out", float64=True,
                                      refuse=_batchnorm_refusal)])  # fmt: skip
SCALE_SHIFTS = (
    RewriteRuleSet([_library(ConvAffineFusion(), float64=True, refuse=_affine_refusal)], commute=True),
    RewriteRuleSet([_conv_then("Mul"), _conv_then("Add")], commute=True),
)
HARD_SWISHES = RewriteRuleSet([_library(HardSwishFusion()), _hard_swish_by_sixth()], commute=True)
