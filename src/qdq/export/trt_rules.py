"""TensorRT's rules for an ONNX graph it builds with explicit quantization and strong typing.

Each rule is a function over a :class:`GraphFacts` that yields :class:`Violation` s, registered with its id,
a one-line summary and its source in :data:`RULES`; :func:`qdq.export.trt_check.check_tensorrt` runs them
all. Sources (TensorRT 10.x/11.x documentation unless said otherwise):

Explicit quantization
* ``qdq-pair`` — every QuantizeLinear is read by DequantizeLinear nodes only, and a DequantizeLinear reads a
  QuantizeLinear or a constant (pre-quantized weights). Developer guide, "Explicit Quantization" (Q/DQ pairs
  from fake quantization; "When using pre-quantized weights, an IDequantizeLayer is required between the
  weights and the linear operator").
* ``pair-params`` — a Q and the DQ reading it share scale, zero point and axis (a pair is one fake
  quantization; the guide's Q/DQ propagation and fusion assume the DQ undoes its Q).
* ``int8-type`` — the quantized type is one TensorRT supports: INT8 (or INT4, FP8 E4M3, FP4 E2M1); never UINT8,
  which a missing zero point means in ONNX. "Working with Quantized Types" (supported data types;
  symmetric scheme); operator reference "Quantize"/"Dequantize" (output T3: int8, float8, int4).
* ``zero-point`` — every zero point is 0. Operators "Quantize"/"Dequantize": "The zero_point must only
  contain zero-valued coefficients".
* ``scale`` — the scale is a build-time constant, positive and finite, a scalar (per tensor) or 1-D (per
  channel, one value per element of ``axis``), with a zero point of the same shape; per-channel needs opset
  13 (the ``axis`` attribute). Operators "Quantize"/"Dequantize"; developer guide §"ONNX Support".
* ``activation-per-tensor`` — activations are quantized per tensor. Developer guide, "Quantization Schemes"
  (per-tensor activations; per-channel for weights only).
* ``weight-axis`` — a per-channel weight is quantized along the op's output channels: axis 0 of Conv
  weights, of Gemm ``B`` with ``transB=1`` (axis 1 with ``transB=0``), the last axis of a MatMul's constant
  ``B``; ConvTranspose along axis 0 (its input channels): TensorRT's deconvolution kernels take
  per-input-channel weight scales (maintainers in NVIDIA/TensorRT#2380 and #1694; ModelOpt's ONNX path
  uses axis 1 — the TensorRT maintainers' word is followed).
* ``weighted-op-inputs`` — a Conv/ConvTranspose/Gemm/MatMul with one dequantized input has both its data and
  weight inputs dequantized, each from a DequantizeLinear directly (or through a Transpose/Reshape, which
  TensorRT moves the DQ across), never through a Cast. Developer guide "Q/DQ Layer-Placement
  Recommendations" (quantize all inputs of weighted operations) and "Q/DQ Fusion".
* ``residual-add`` — an Add that follows a quantized weighted op (directly or through BatchNormalization) and
  whose output is quantized again has a dequantized other ("residual") input: TensorRT fuses the Add into
  the op, and the residual input's precision decides the fused output's. Developer guide, placement
  recommendations (element-wise addition fusion).
* ``fused-scales`` — scales agree across ops TensorRT runs on int8 data: the inputs of a quantized Concat
  share one scale with the Q after it, and a DQ -> data-movement op (MaxPool, Reshape, Transpose...) -> Q
  group has one scale. Developer guide, "Q/DQ Propagation" (commuting layers); ModelOpt's ONNX
  quantization groups Concat scales (``concat_elimination``).
* ``integer-ops`` — no integer-arithmetic ONNX ops (QLinearConv, ConvInteger, QLinearMatMul, MatMulInteger,
  QGemm...): "TensorRT does not support" the QOperator format, only Q/DQ. Developer guide §"ONNX Support".

Strong typing (migration guide 10.x -> 11.x, "Strongly Typed Networks Are Now Required"; TensorRT infers
each tensor's type from the network inputs and the operators' types, with no implicit promotion)
* ``type-consistent`` — the inputs and outputs a node binds to one type parameter have one type, a type the
  operator allows in the model's opset, and ONNX type inference accepts the graph.
* ``q-input-type`` — a QuantizeLinear's input has its scale's type (operator "Quantize": input and scale are
  both T1).
* ``dq-output-type`` — a DequantizeLinear outputs its scale's type (operator "Dequantize": output T3 is the
  scale's type), so a DQ feeding an FP16 op has an FP16 scale.
* ``fp32-island`` — in a graph that computes in FP16/BF16, no node computes in FP32 unless allowed: its op
  type is in the allow-list (``fp32_ops``) or the low-precision export recorded it (model metadata
  ``qdq.float.fp32_nodes``: node -> reason). ModelOpt AutoCast keeps such nodes in FP32 explicitly; anything
  else FP32 is a node the conversion missed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qdq.export.onnx_types import FLOAT_TYPES, LOW_PRECISION, TensorTypes, default_opset, float_slots, type_name
from qdq.graphs.onnx import GraphIndex

__all__ = ["FP32_NODES_KEY", "RULES", "GraphFacts", "Rule", "Violation", "run_rules"]

#: Model metadata key: JSON ``{node name: reason}`` of the nodes a low-precision export kept in FP32.
FP32_NODES_KEY = "qdq.float.fp32_nodes"

_Q, _DQ = "QuantizeLinear", "DequantizeLinear"
_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Ops TensorRT moves a DequantizeLinear forward across (shape only): a weight may reach its op through them.
_LAYOUT = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: Ops that run on int8 data between a DQ and a Q with one scale (they commute with quantization).
_DATA_MOVERS = frozenset(
    {
        "MaxPool",
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Gather",
        "Identity",
        "Split",
        "Pad",
        "DepthToSpace",
        "SpaceToDepth",
        "Resize",
    }
)
_INTEGER_OPS = frozenset(
    {
        "QLinearConv",
        "ConvInteger",
        "QLinearMatMul",
        "MatMulInteger",
        "QGemm",
        "QLinearAdd",
        "QLinearMul",
        "QLinearConcat",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearSoftmax",
        "QLinearGlobalAveragePool",
        "QLinearAveragePool",
        "DynamicQuantizeLinear",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "QAttention",
    }
)
_NOT_COMPUTE = frozenset({_Q, _DQ, "Cast", "CastLike", "Constant", "Identity", "Shape", "Size"})
_QUANT_TYPES = frozenset({3, 17, 22, 23})  # INT8, FLOAT8E4M3FN, INT4, FLOAT4E2M1 (onnx.TensorProto)
_UINT8 = 2


@dataclass(frozen=True)
class Violation:
    """One broken rule: the node (or tensor) where it breaks, the rule's id and what is wrong."""

    rule: str
    node: str
    message: str


@dataclass(frozen=True)
class Rule:
    """A registered rule: its id, one line saying what it requires, its source, and its check."""

    id: str
    summary: str
    source: str
    check: Callable[[GraphFacts], Iterable[Violation]] = field(repr=False, compare=False)


#: rule id -> Rule, in the order they run and print.
RULES: dict[str, Rule] = {}


def _rule(rule_id: str, summary: str, source: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(check: Callable[[GraphFacts], Iterable[Violation]]) -> Callable[[GraphFacts], Iterable[Violation]]:
        RULES[rule_id] = Rule(rule_id, summary, source, check)
        return check

    return register


@dataclass
class GraphFacts:
    """What every rule reads: the graph index, tensor types, the opset and the FP32 allow-list."""

    index: GraphIndex
    types: TensorTypes
    opset: int
    fp32_ops: frozenset[str]
    fp32_nodes: dict[str, str]

    @classmethod
    def of(cls, model: Any, fp32_ops: Iterable[str]) -> GraphFacts:
        meta = {p.key: p.value for p in model.metadata_props}
        try:
            recorded = json.loads(meta.get(FP32_NODES_KEY, "{}"))
        except json.JSONDecodeError:
            recorded = {}
        return cls(GraphIndex(model), TensorTypes.of(model), default_opset(model), frozenset(fp32_ops),
                   {str(k): str(v) for k, v in dict(recorded).items()})  # fmt: skip

    @property
    def nodes(self) -> Any:
        return self.index.nodes

    def name(self, node: Any) -> str:
        return node.name or f"{node.op_type}({', '.join(node.output)})"

    def value(self, tensor: str) -> np.ndarray | None:
        """The value of a constant tensor (an initializer or Constant, possibly behind Identity nodes)."""
        node = self.index.producer.get(tensor)
        while node is not None and node.op_type == "Identity" and tensor not in self.index.constants:
            tensor, node = node.input[0], self.index.producer.get(node.input[0])
        return self.index.array(tensor)

    def scale(self, node: Any) -> np.ndarray | None:
        return self.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None

    def zero_point(self, node: Any) -> np.ndarray | None:
        return self.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None

    def axis(self, node: Any) -> int:
        value = next((a.i for a in node.attribute if a.name == "axis"), 1)
        rank = self.types.ranks.get(node.input[0])
        return value + rank if value < 0 and rank is not None else value

    def is_constant(self, tensor: str) -> bool:
        """Is ``tensor`` known when TensorRT builds the engine (a constant, or computed from constants only)?

        TensorRT folds such subgraphs at build time: a weight clipped by ``Min``/``Max`` before its Q (qdq's
        sub-8-bit weights) is still a weight.
        """
        pending, seen = [tensor], set()
        while pending:
            name = pending.pop()
            if name in seen or name in self.index.constants:
                continue
            seen.add(name)
            producer = self.index.producer.get(name)
            if producer is None or producer.op_type in (_Q, _DQ):
                return False
            pending.extend(i for i in producer.input if i)
        return True

    def q_of(self, dq: Any) -> Any | None:
        producer = self.index.producer.get(dq.input[0])
        return producer if producer is not None and producer.op_type == _Q else None

    def quantized_source(self, tensor: str, through: frozenset[str] = _LAYOUT) -> tuple[Any | None, list[Any]]:
        """The DequantizeLinear ``tensor`` comes from, looking back through ``through``, and the ops passed."""
        passed: list[Any] = []
        node = self.index.producer.get(tensor)
        while node is not None and node.op_type in through and node.input:
            passed.append(node)
            node = self.index.producer.get(node.input[0])
        return (node, passed) if node is not None and node.op_type == _DQ else (None, passed)

    def per_channel(self, scale: np.ndarray | None) -> bool:
        return scale is not None and scale.ndim == 1 and scale.size > 1


def run_rules(facts: GraphFacts) -> list[Violation]:
    """Every registered rule's violations, in rule order."""
    return [v for rule in RULES.values() for v in rule.check(facts)]


# ----------------------------------------------------------------------------------- explicit quantization
@_rule(
    "qdq-pair",
    "each Q is read only by DQs; each DQ reads a Q or a constant",
    "TensorRT dev guide: Explicit Quantization",
)
def _qdq_pairs(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type == _Q:
            readers = f.index.consumers.get(node.output[0], [])
            if node.output[0] in f.index.outputs:
                yield Violation("qdq-pair", f.name(node), "its quantized output is a graph output; follow it by a DQ")
            if not readers and node.output[0] not in f.index.outputs:
                yield Violation("qdq-pair", f.name(node), "nothing reads it: a Q without its DQ")
            for reader in readers:
                if reader.op_type != _DQ:
                    yield Violation(
                        "qdq-pair",
                        f.name(node),
                        f"its quantized output is read by {reader.op_type} {f.name(reader)}, not by a DequantizeLinear",
                    )
        elif node.op_type == _DQ:
            producer = f.index.producer.get(node.input[0])
            if producer is not None and producer.op_type not in (_Q, "Constant"):
                yield Violation(
                    "qdq-pair",
                    f.name(node),
                    f"reads {producer.op_type} {f.name(producer)}: a DQ must "
                    "read a QuantizeLinear or a constant (pre-quantized weights)",
                )


@_rule(
    "pair-params", "a Q and its DQ share scale, zero point and axis", "TensorRT dev guide: Q/DQ propagation and fusion"
)
def _pair_params(f: GraphFacts) -> Iterator[Violation]:
    for dq in f.nodes:
        q = f.q_of(dq) if dq.op_type == _DQ else None
        if q is None:
            continue
        s_q, s_dq = f.scale(q), f.scale(dq)
        z_q, z_dq = f.zero_point(q), f.zero_point(dq)
        if s_q is not None and s_dq is not None and not _same_values(s_q, s_dq):
            yield Violation(
                "pair-params",
                f.name(dq),
                f"its scale differs from its Q's ({f.name(q)}): {_brief(s_dq)} vs {_brief(s_q)}",
            )
        if not _same_values(z_q, z_dq):
            yield Violation("pair-params", f.name(dq), f"its zero point differs from its Q's ({f.name(q)})")
        if f.per_channel(s_dq) and f.axis(q) != f.axis(dq):
            yield Violation("pair-params", f.name(dq), f"axis {f.axis(dq)} differs from its Q's axis {f.axis(q)}")


@_rule(
    "int8-type", "the quantized type is INT8 (or INT4/FP8/FP4), never UINT8", "TensorRT: Working with Quantized Types"
)
def _int8_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in (_Q, _DQ):
            continue
        quantized = _quantized_type(f, node)
        if quantized is None:
            continue
        if quantized == _UINT8 and len(node.input) < 3:
            yield Violation(
                "int8-type",
                f.name(node),
                "no zero point: ONNX then quantizes to UINT8, which TensorRT "
                "does not support; add an int8 zero point 0",
            )
        elif quantized not in _QUANT_TYPES:
            yield Violation(
                "int8-type",
                f.name(node),
                f"quantizes to {type_name(quantized)}; TensorRT supports INT8 (and INT4, FP8 E4M3, FP4 E2M1)",
            )


@_rule("zero-point", "every zero point is 0 (symmetric quantization)", "TensorRT operators: Quantize, Dequantize")
def _zero_point(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        zero = f.zero_point(node) if node.op_type in (_Q, _DQ) else None
        if zero is not None and np.any(zero.astype(np.float64) != 0):
            yield Violation("zero-point", f.name(node), f"zero point {_brief(zero)} is not 0; TensorRT is symmetric")


@_rule(
    "scale",
    "scales are constant, positive, finite; scalar or 1-D along axis",
    "TensorRT operators: Quantize, Dequantize",
)
def _scale(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in (_Q, _DQ):
            continue
        yield from _scale_problems(f, node)


def _scale_problems(f: GraphFacts, node: Any) -> Iterator[Violation]:
    name, scale, zero = f.name(node), f.scale(node), f.zero_point(node)
    if scale is None:
        yield Violation(
            "scale", name, f"scale {node.input[1]!r} is not a constant; TensorRT needs a build-time constant"
        )
        return
    if len(node.input) > 2 and node.input[2] and zero is None:
        yield Violation("scale", name, f"zero point {node.input[2]!r} is not a constant")
    values = scale.astype(np.float64)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        yield Violation("scale", name, f"scale {_brief(scale)} must be positive and finite")
    if scale.ndim > 1:
        yield Violation(
            "scale",
            name,
            f"scale has shape {list(scale.shape)}; TensorRT takes a scalar or a 1-D scale "
            "for INT8 (block scales are for INT4)",
        )
    if zero is not None and zero.shape != scale.shape:
        yield Violation(
            "scale", name, f"zero point shape {list(zero.shape)} differs from scale shape {list(scale.shape)}"
        )
    if f.per_channel(scale):
        if f.opset < 13:
            yield Violation("scale", name, f"per-channel scale needs opset >= 13 (the axis attribute); opset {f.opset}")
        dims = f.types.dims.get(node.input[0])
        axis = f.axis(node)
        if dims is not None and not 0 <= axis < len(dims):
            yield Violation("scale", name, f"axis {axis} is outside the input's rank {len(dims)}")
        elif dims is not None and dims[axis] is not None and dims[axis] != scale.size:
            yield Violation("scale", name, f"{scale.size} scales for {dims[axis]} channels on axis {axis}")


@_rule("activation-per-tensor", "activations are quantized per tensor", "TensorRT dev guide: Quantization Schemes")
def _activation_per_tensor(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != _Q or f.is_constant(node.input[0]):
            continue
        if f.per_channel(f.scale(node)):
            yield Violation(
                "activation-per-tensor",
                f.name(node),
                f"quantizes activation {node.input[0]!r} per channel "
                f"(axis {f.axis(node)}); TensorRT quantizes activations per tensor",
            )


@_rule(
    "weight-axis",
    "per-channel weights along the output channels (ConvTranspose: axis 0)",
    "TensorRT dev guide; NVIDIA/TensorRT#2380",
)
def _weight_axis(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in _WEIGHTED:
            continue
        for index in _weight_inputs(f, node):
            dq, passed = f.quantized_source(node.input[index])
            if dq is None or not f.per_channel(f.scale(dq)):
                continue
            expected = _expected_axis(f, node, index)
            at_dq = _axis_before(passed, expected)
            if at_dq is not None and f.axis(dq) != at_dq:
                yield Violation(
                    "weight-axis",
                    f.name(dq),
                    f"quantizes the weight of {node.op_type} {f.name(node)} "
                    f"along axis {f.axis(dq)}; TensorRT needs axis {at_dq} ({_axis_reason(node)})",
                )


@_rule(
    "weighted-op-inputs",
    "a quantized Conv/Gemm/MatMul reads DQs directly (no Cast, no float input)",
    "TensorRT dev guide: Q/DQ placement, fusion",
)
def _weighted_op_inputs(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in _WEIGHTED or len(node.input) < 2:
            continue
        sources = [f.quantized_source(node.input[i]) for i in (0, 1)]
        through_cast = [f.quantized_source(node.input[i], _LAYOUT | {"Cast", "CastLike"}) for i in (0, 1)]
        for i, ((dq, _), (dq_cast, passed)) in enumerate(zip(sources, through_cast)):
            if dq is None and dq_cast is not None:
                cast = next(p for p in passed if p.op_type in ("Cast", "CastLike"))
                yield Violation(
                    "weighted-op-inputs",
                    f.name(node),
                    f"input {i} reaches DQ {f.name(dq_cast)} through "
                    f"{cast.op_type} {f.name(cast)}: TensorRT cannot fuse the DQ; give the DQ a scale of "
                    "the op's type instead",
                )
        quantized = [dq is not None or dq_cast is not None for (dq, _), (dq_cast, _) in zip(sources, through_cast)]
        if any(quantized) and not all(quantized):
            float_input = quantized.index(False)
            yield Violation(
                "weighted-op-inputs",
                f.name(node),
                f"input {float_input} ({node.input[float_input]!r}) is "
                "float while the other is dequantized: TensorRT runs it in float; quantize both",
            )


@_rule(
    "residual-add",
    "an Add fused into a quantized op has a dequantized residual input",
    "TensorRT dev guide: Q/DQ placement (add fusion)",
)
def _residual_add(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        fused = [_quantized_weighted_producer(f, name) for name in node.input]
        if not any(fused) or not _quantized_downstream(f, node.output[0]):
            continue
        if any(f.quantized_source(name, frozenset())[0] is not None for name in node.input):
            continue
        op = next(p for p in fused if p is not None)
        yield Violation(
            "residual-add",
            f.name(node),
            f"adds to quantized {op.op_type} {f.name(op)} and feeds a Q, "
            "but neither input is dequantized: TensorRT fuses the Add in float and the Q cannot fuse; "
            "quantize the residual (skip) input",
        )


@_rule("fused-scales", "one scale across Concat and int8 data-movement ops", "TensorRT dev guide: Q/DQ propagation")
def _fused_scales(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type == "Concat":
            yield from _concat_scales(f, node)
        elif node.op_type in _DATA_MOVERS and node.input:
            dq = f.index.producer.get(node.input[0])
            if dq is None or dq.op_type != _DQ:
                continue
            for q in f.index.consumers.get(node.output[0], []):
                if q.op_type == _Q and not _same_values(f.scale(q), f.scale(dq)):
                    yield Violation(
                        "fused-scales",
                        f.name(node),
                        f"DQ {f.name(dq)} and Q {f.name(q)} around this "
                        f"{node.op_type} have scales {_brief(f.scale(dq))} and {_brief(f.scale(q))}: "
                        "TensorRT runs it on int8 data only with one scale",
                    )


def _concat_scales(f: GraphFacts, node: Any) -> Iterator[Violation]:
    dqs = [f.index.producer.get(name) for name in node.input]
    if not dqs or not all(d is not None and d.op_type == _DQ for d in dqs):
        return
    scales = [f.scale(d) for d in dqs]
    scales += [f.scale(q) for q in f.index.consumers.get(node.output[0], []) if q.op_type == _Q]
    if any(not _same_values(scales[0], s) for s in scales[1:]):
        listed = ", ".join(_brief(s) for s in scales)
        yield Violation(
            "fused-scales",
            f.name(node),
            f"its quantized inputs and output have different scales "
            f"({listed}); TensorRT concatenates int8 data with one scale",
        )


@_rule("integer-ops", "no QOperator integer ops (QLinearConv, ConvInteger...)", "TensorRT dev guide: ONNX support")
def _integer_ops(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type in _INTEGER_OPS:
            yield Violation(
                "integer-ops",
                f.name(node),
                f"{node.op_type} is an integer op TensorRT does not parse; export Q/DQ nodes around a float op instead",
            )


# ------------------------------------------------------------------------------------------ strong typing
@_rule(
    "type-consistent",
    "one type per node type parameter, allowed in the opset",
    "TensorRT 11 migration: strongly typed networks",
)
def _type_consistent(f: GraphFacts) -> Iterator[Violation]:
    found = False
    for node in f.nodes:
        slots = float_slots(node, f.opset)
        if slots.param is None:
            continue
        bound = [node.input[i] for i in slots.inputs] + [node.output[i] for i in slots.outputs]
        types = {name: f.types.get(name) for name in bound}
        known = {t for t in types.values() if t is not None}
        if len(known) > 1:
            found = True
            listed = ", ".join(f"{n!r}: {type_name(t)}" for n, t in types.items() if t is not None)
            yield Violation(
                "type-consistent",
                f.name(node),
                f"{slots.param} is bound to several types ({listed}); "
                "a strongly typed network needs one (convert or Cast one of them)",
            )
        for t in known - set(slots.allowed):
            found = True
            yield Violation(
                "type-consistent",
                f.name(node),
                f"{type_name(t)} is not allowed for {node.op_type}'s {slots.param} in opset {f.opset}",
            )
    if not found and f.types.inference_error is not None:
        yield Violation("type-consistent", "(graph)", f"ONNX type inference fails: {f.types.inference_error}")


@_rule("q-input-type", "a Q's input has its scale's type", "TensorRT operator: Quantize (input and scale are T1)")
def _q_input_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != _Q or len(node.input) < 2:
            continue
        x, scale = f.types.get(node.input[0]), f.types.get(node.input[1])
        if x is not None and scale is not None and x != scale:
            yield Violation(
                "q-input-type",
                f.name(node),
                f"input is {type_name(x)} but the scale is {type_name(scale)}; give the scale the input's type",
            )


@_rule("dq-output-type", "a DQ outputs its scale's type", "TensorRT operator: Dequantize (output is the scale's type)")
def _dq_output_type(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != _DQ or len(node.input) < 2:
            continue
        scale = f.types.get(node.input[1])
        requested = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
        out = requested or f.types.get(node.output[0])
        if scale is not None and out is not None and out != scale:
            yield Violation(
                "dq-output-type",
                f.name(node),
                f"outputs {type_name(out)} but the scale is {type_name(scale)}; TensorRT's DQ outputs the scale's type",
            )


@_rule(
    "fp32-island",
    "no FP32 compute in an FP16/BF16 graph outside the allow-list",
    "TensorRT 11 migration; ModelOpt AutoCast",
)
def _fp32_island(f: GraphFacts) -> Iterator[Violation]:
    precisions = compute_precisions(f)
    low = {t for t in precisions.values() if t in LOW_PRECISION.values()}
    if not low:
        return
    for node in f.nodes:
        if precisions.get(id(node)) == 1 and not fp32_allowed(f, node):
            yield Violation(
                "fp32-island",
                f.name(node),
                f"computes in float32 in a {type_name(min(low))} graph; "
                "convert it, or keep it in FP32 on purpose (allow-list)",
            )


def compute_precisions(f: GraphFacts) -> dict[int, int]:
    """``id(node)`` -> the float type a compute node computes in (its first float output's type)."""
    found: dict[int, int] = {}
    for node in f.nodes:
        if node.op_type in _NOT_COMPUTE or node.domain not in ("", "ai.onnx"):
            continue
        types = [f.types.get(name) for name in node.output if name]
        float_out = next((t for t in types if t in FLOAT_TYPES), None)
        if float_out is not None:
            found[id(node)] = float_out
    return found


def fp32_allowed(f: GraphFacts, node: Any) -> bool:
    """Is ``node`` allowed to compute in FP32 in a low-precision graph (allow-listed op or recorded node)?"""
    return node.op_type in f.fp32_ops or node.name in f.fp32_nodes


# ------------------------------------------------------------------------------------------------ helpers
def _same_values(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return bool(
            np.array_equal(
                np.broadcast_to(a.astype(np.float64), np.broadcast_shapes(a.shape, b.shape)),
                np.broadcast_to(b.astype(np.float64), np.broadcast_shapes(a.shape, b.shape)),
            )
        )
    except ValueError:
        return False


def _brief(array: np.ndarray | None) -> str:
    if array is None:
        return "none"
    flat = array.astype(np.float64).ravel()
    shown = ", ".join(f"{v:.6g}" for v in flat[:3])
    return f"[{shown}{', ...' if flat.size > 3 else ''}]" if array.ndim else f"{flat[0]:.6g}"


def _quantized_type(f: GraphFacts, node: Any) -> int | None:
    """The integer (or FP8/FP4) type a Q produces or a DQ reads."""
    if len(node.input) > 2 and node.input[2]:
        return f.types.get(node.input[2])
    if node.op_type == _Q:
        return next((a.i for a in node.attribute if a.name == "output_dtype" and a.i), _UINT8)
    return f.types.get(node.input[0])


def _weight_inputs(f: GraphFacts, node: Any) -> list[int]:
    """Indices of the inputs of a weighted op that hold its weight (a constant behind its DQ)."""
    if node.op_type in ("Conv", "ConvTranspose", "Gemm"):
        return [1] if len(node.input) > 1 else []
    found = []
    for index in (0, 1):
        dq, _ = f.quantized_source(node.input[index])
        source = f.q_of(dq).input[0] if dq is not None and f.q_of(dq) is not None else (dq.input[0] if dq else None)
        if source is not None and f.is_constant(source):
            found.append(index)
    return found


def _expected_axis(f: GraphFacts, node: Any, index: int) -> int | None:
    rank = f.types.ranks.get(node.input[index])
    if node.op_type in ("Conv", "ConvTranspose"):
        return 0
    if node.op_type == "Gemm":
        trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans else 1
    if rank is None:
        return None
    return rank - 1 if index == 1 else rank - 2


def _axis_reason(node: Any) -> str:
    return {
        "Conv": "output channels",
        "ConvTranspose": "TensorRT's deconvolution takes per-input-channel scales",
        "Gemm": "output channels of B",
        "MatMul": "the output columns of the constant operand",
    }[node.op_type]


def _axis_before(passed: list[Any], axis: int | None) -> int | None:
    """The axis at the DQ that becomes ``axis`` at the op after the layout ops ``passed`` (nearest op first)."""
    for node in passed:
        if axis is None:
            return None
        if node.op_type == "Identity":
            continue
        if node.op_type != "Transpose":
            return None  # a reshape: the channel axis cannot be followed
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if perm is None:
            return None
        axis = perm[axis]
    return axis


def _quantized_weighted_producer(f: GraphFacts, tensor: str) -> Any | None:
    """The quantized weighted op producing ``tensor`` (directly or through BatchNormalization), else None."""
    node = f.index.source(tensor, through=frozenset({"BatchNormalization"}))
    if node is None or node.op_type not in _WEIGHTED or len(node.input) < 2:
        return None
    return node if all(f.quantized_source(node.input[i])[0] is not None for i in (0, 1)) else None


def _quantized_downstream(f: GraphFacts, tensor: str) -> bool:
    """Does ``tensor`` reach a QuantizeLinear through activations TensorRT fuses after an add?"""
    readers = f.index.readers(tensor, through=frozenset({"Relu", "Clip", "LeakyRelu"}))
    return any(r is not None and r.op_type == _Q for r in readers)
