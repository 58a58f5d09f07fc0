"""The ONNX front end's view: an ONNX graph as a :class:`~qdq.graphs.view.GraphView`, and the first decisions.

Each node is an op as it is (ONNX's vocabulary is the view's; an operator of a custom domain is named
``"<domain>:<op>"``, which no rule knows); initializers are constants; a ``Mul`` of a tensor
and its own ``Sigmoid`` (how exporters write SiLU) is one ``Silu`` op whose sigmoid is an inner value, as on the
PyTorch path; attention written out op by op (``MatMul(Q, Kᵀ)``, a constant scale, a mask ``Add``, ``Softmax``,
``MatMul(·, V)``: :mod:`qdq.onnx_in.attention`) is one ``Attention`` op, its inputs the query, the key (as ``Q·Kᵀ``
reads it), ``V`` and the mask, the probabilities an inner value, as qdq's attention module is on the PyTorch path.
An op's ``ref`` is its node's position in ``graph.node`` (a ``Silu``: the sigmoid's and the product's; an
``Attention``: its nodes', :class:`~qdq.onnx_in.attention.AttentionNodes`), so that the decisions can be written
into any copy of the model. The branches of every ``If`` are part of the view
(:mod:`qdq.onnx_in.subgraphs`): their ops come before the ``If``, each with a ``Nested`` ref; what a branch
returns is an output of its graph, and an input of the ``If`` after its condition (an ``If`` is >= 0 where its
branches' outputs are); ``Loop`` and ``Scan`` bodies are not (their ops stay float).

:func:`select_weighted` makes the decisions module replacement makes on the PyTorch path: the data inputs of every
``Conv``, ``ConvTranspose``, ``Gemm`` and ``MatMul`` (both inputs of a product of two activations) and of the
average pools, and their constant weights per channel, except where the user keeps an op float (by node name,
op type, or a pattern of node names). :func:`select_attention`, after the target's rules, quantizes what each
``Attention`` op's facts list (:class:`~qdq.targets.AttentionFacts`: all four tensors where no rule gave it facts),
as the PyTorch front end enables its attention module's quantizers, or keeps it float where the calibration shapes
fall outside them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import onnx
import onnx_ir as ir

from qdq.graphs.onnx_types import FLOAT_TYPES
from qdq.graphs.ops import ATTENTION, ATTENTION_SITES, QUANTIZED_BY_DEFAULT
from qdq.graphs.view import GraphView, Op, Quantizer, Value
from qdq.onnx_in.attention import AttentionNodes, find_attention
from qdq.onnx_in.subgraphs import Nested, Path

__all__ = ["KeepFloat", "build_view", "keep_unreached_float", "keep_user_float", "select_attention", "select_weighted",
           "weight_axis"]  # fmt: skip

_ATTENTION_INPUTS = {"query": 0, "key": 1, "value": 2}  # the Attention op's inputs (the probabilities are inner)


@dataclass(frozen=True)
class KeepFloat:
    """Ops the user keeps float: by node name, by op type, or by a shell pattern of node names (``"head.*"``)."""

    names: frozenset[str] = frozenset()
    op_types: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, spec: Iterable[str] | None) -> KeepFloat:
        """From a list of names, op types (``"op:Concat"`` or a capitalized ONNX op type) and patterns (``*?[``)."""
        names, types, patterns = set(), set(), []
        for item in spec or ():
            item = str(item)
            if item.startswith("op:"):
                types.add(item[3:])
            elif any(c in item for c in "*?["):
                patterns.append(item)
            else:
                names.add(item)
        return cls(frozenset(names), frozenset(types), tuple(patterns))

    def match(self, op: Op) -> str | None:
        """Why ``op`` is kept float (``"op type Concat"``, ``"name"``, ``"pattern 'head.*'"``), or None."""
        if op.type in self.op_types:
            return f"op type {op.type} kept float by the user"
        if op.name in self.names:
            return "kept float by the user (by name)"
        hit = next((p for p in self.patterns if fnmatch.fnmatchcase(op.name, p)), None)
        return None if hit is None else f"kept float by the user (pattern {hit!r})"


def build_view(model: onnx.ModelProto, target: Any) -> GraphView:
    """The view of ``model``'s main graph and of its ``If`` branches (nodes in their topological order: a branch's
    ops before its ``If``; :mod:`qdq.onnx_in.subgraphs`), read through onnx_ir (its tensors shared, not copied)."""
    view = GraphView("onnx", target)
    graph = ir.serde.deserialize_model(model).graph
    constants = {name: value.const_value.size if value.const_value is not None else 0
                 for name, value in graph.initializers.items()}
    scalars = {name: float(value.const_value.numpy()) for name, value in graph.initializers.items()
               if value.const_value is not None and not value.shape and value.dtype != ir.DataType.STRING}  # fmt: skip
    for value in graph.initializers.values():
        _value(view, value, constants)
    _add_graph(view, graph, (), scalars, constants)
    return view


def _add_graph(view: GraphView, graph: ir.Graph, path: Path, scalars: dict[str, float],
               constants: dict[str, int]) -> None:  # fmt: skip
    """The ops of ``graph`` (at ``path``), each ``If``'s branches before it; the values ``graph`` returns are its
    outputs (the model's, or an ``If`` branch's)."""
    nodes = list(graph)
    sigmoid_of = _silu_pairs(graph)
    attention = find_attention(graph, constants)  # a branch's initializers live in the main graph once prepared
    inside = set(sigmoid_of.values()) | {n for found in attention.values() for n in found.nodes[:-1]}
    for number, node in enumerate(nodes):
        if number in inside:  # a SiLU's sigmoid, an attention's nodes: added with the node that ends them, as one op
            for value in [v for v in node.outputs if v.name]:  # the graph's tensors still (a user may keep one float)
                _value(view, value, constants)
            continue
        for name, attribute in node.attributes.items() if node.op_type == "If" else ():
            _add_graph(view, attribute.as_graph(), (*path, (number, name)), scalars, constants)
        inputs = [_value(view, v, constants) for v in [*node.inputs, *_returned(node)] if v is not None]
        produced = [_value(view, v, constants) for v in node.outputs if v.name]  # an optional output left out: ""
        gate = sigmoid_of.get(number)
        name = node.name or f"{node.op_type}_{number}"
        if number in attention:
            _add_attention(view, nodes, attention[number], path, constants)
        elif gate is not None:
            sigmoid = nodes[gate]
            x = cast(ir.Value, sigmoid.inputs[0])  # the pair's sigmoid reads the Mul's other input (_silu_pairs)
            view.add_op(name, "Silu", [_value(view, x, constants)], produced,
                        inner={"sigmoid": _value(view, sigmoid.outputs[0], constants)},
                        ref=_ref(path, (gate, number)))  # fmt: skip
        else:
            op_type = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
            weights = [i for i, v in enumerate(inputs) if v.constant and _is_weight(op_type, i)]
            view.add_op(name, op_type, inputs, produced, attrs=_attrs(node, scalars), weights=weights,
                        ref=_ref(path, number))  # fmt: skip
    for value in graph.outputs:
        _value(view, value, constants).graph_output = True


def _value(view: GraphView, value: ir.Value, constants: Mapping[str, int]) -> Value:
    """The view's value for ``value``: a constant where it is an initializer; integer and boolean tensors (shapes,
    indices) are not real numbers, never quantized."""
    dtype = value.dtype
    real = dtype is None or int(dtype) in FLOAT_TYPES or dtype == ir.DataType.UNDEFINED
    return view.value(str(value.name), constant=value.name in constants, real=real)


def _add_attention(view: GraphView, nodes: list[ir.Node], found: AttentionNodes, path: Path,
                   constants: Mapping[str, int]) -> None:  # fmt: skip
    """The ``Attention`` op of ``found``'s nodes, named after its ``Q·Kᵀ`` node: reads the query, the key, ``V`` and
    the mask (:meth:`AttentionNodes.reads`), writes the last MatMul's output, the probabilities inside."""
    reads = [found.reads(index)[0] for index in range(4 if found.mask is not None else 3)]
    inputs = [_value(view, nodes[position].inputs[slot], constants) for position, slot in reads]  # type: ignore[arg-type]
    probs = _value(view, nodes[found.output].inputs[0], constants)  # type: ignore[arg-type]
    scores = nodes[found.scores]
    view.add_op(scores.name or f"MatMul_{found.scores}", ATTENTION, inputs,
                [_value(view, nodes[found.output].outputs[0], constants)], inner={"probs": probs},
                ref=_ref(path, found))  # fmt: skip


def _returned(node: ir.Node) -> list[ir.Value]:
    """What an ``If``'s branches return (the values of its outputs: the view's ``If`` reads them), else nothing."""
    if node.op_type != "If":
        return []
    return [value for attribute in node.attributes.values() if attribute.type == ir.AttributeType.GRAPH
            for value in attribute.as_graph().outputs]  # fmt: skip


def _ref(path: Path, ref: Any) -> Any:
    """An op's ``ref``: its node's position in the main graph, or where it is inside an ``If`` branch."""
    return Nested(path, ref) if path else ref


def select_weighted(view: GraphView, keep: KeepFloat) -> None:
    """Quantize the data inputs and weights of the ops :data:`qdq.graphs.ops.QUANTIZED_BY_DEFAULT` names: the weighted
    ops and the average pools (module doc)."""
    for op in view.ops:
        if op.type not in QUANTIZED_BY_DEFAULT or keep.match(op) is not None or _on_constants(op):
            continue
        for index, value in enumerate(op.inputs):
            if index in op.weights:
                quantizer = Quantizer(per_channel=True, stem="weight_quantizer")
                view.quantize_input(op, index, "its weight, per channel", like=quantizer)
            elif not value.constant and index < 2 and (index == 0 or op.type == "MatMul"):
                view.quantize_input(op, index, f"the input of a {op.type}")


def _on_constants(op: Op) -> bool:
    """Does the weighted op multiply a constant (a table the model holds: Swin V2's relative coordinates into its
    position-bias MLP)? Nothing there is an activation to calibrate; the runtime folds it, float."""
    data = [v for i, v in enumerate(op.inputs[:2]) if i not in op.weights and (i == 0 or op.type == "MatMul")]
    return bool(data) and all(v.constant for v in data)


def select_attention(view: GraphView, keep: KeepFloat, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Quantize what each ``Attention`` op's facts list (module doc), unless the user keeps it float; it stays float
    where its ``shapes`` (op name -> head size and longest sequence: :func:`~qdq.onnx_in.attention.attention_shapes`)
    fall outside them."""
    for op in view.ops_of(ATTENTION):
        if keep.match(op) is not None:
            continue
        facts, shape = view.notes.get(op.name, {}).get("attention"), shapes.get(op.name)
        if facts is not None and shape is not None and (why := facts.outside(*shape)) is not None:
            view.keep_float(op, f"{why}: {facts.reason}")
            continue
        for site in ATTENTION_SITES if facts is None else [s for s in ATTENTION_SITES if s in facts.quantized]:
            if site == "probs":
                view.quantize_output(op.inner["probs"], "the attention's probabilities")
            else:
                view.quantize_input(op, _ATTENTION_INPUTS[site], f"the attention's {site}")


def keep_user_float(view: GraphView, keep: KeepFloat) -> None:
    """The user's choice last: every op ``keep`` matches stays float, whatever the rules decided."""
    for op in view.ops:
        why = keep.match(op)
        if why is not None:
            view.keep_float(op, why)


def keep_unreached_float(view: GraphView, quantizers: Iterable[Quantizer]) -> None:
    """Each of ``quantizers`` (activations the calibration data never reached: inside an ``If`` branch no batch
    took) goes: the ops reading through it stay float, so does a tensor it quantized for every reader."""
    why = "the calibration data never reached it (an If branch no batch took)"
    for quantizer in quantizers:
        for site in list(quantizer.sites):
            if site.reader is not None:
                view.keep_float(site.reader, why)
            else:
                view.keep_value_float(site.value, why)


def weight_axis(op: Op, index: int) -> int:
    """The axis of a weight's output channels (its per-channel axis) for input ``index`` of ``op``."""
    if op.type == "Gemm":
        return 0 if op.attrs.get("transB", 0) else 1
    if op.type == "MatMul":
        return 1 if index == 1 else 0
    return 0  # Conv: [C_out, ...]; ConvTranspose: [C_in, ...], per input channel as TensorRT requires


def _is_weight(op_type: str, index: int) -> bool:
    return (op_type in ("Conv", "ConvTranspose") and index == 1) or (op_type in ("Gemm", "MatMul") and index == 1)


def _attrs(node: ir.Node, scalars: dict[str, float]) -> dict[str, Any]:
    """The attributes placement reads: ints, floats and strings; a ``Clip``'s bounds given as constant inputs
    (opset 11 on) as its ``min`` and ``max``, as the older attributes named them."""
    found: dict[str, Any] = {name: attribute.value for name, attribute in node.attributes.items()
                             if attribute.type in _SCALAR_ATTRIBUTES}  # fmt: skip
    if node.op_type == "Clip":
        for index, key in ((1, "min"), (2, "max")):
            value = node.inputs[index] if len(node.inputs) > index else None
            if value is not None and value.name in scalars:
                found[key] = scalars[value.name]
    return found


_SCALAR_ATTRIBUTES = (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING)


def _silu_pairs(graph: ir.Graph) -> dict[int, int]:
    """``position of the Mul -> position of its Sigmoid`` for every ``Mul(x, Sigmoid(x))`` whose sigmoid only that
    Mul reads, in ``graph`` (positions in its node list: the view's refs)."""
    position = {node: index for index, node in enumerate(graph)}
    pairs = {}
    for index, node in enumerate(graph):
        if node.op_type != "Mul" or len(node.inputs) != 2:
            continue
        for gate_index in (0, 1):
            gate, x = node.inputs[gate_index], node.inputs[1 - gate_index]
            sigmoid = gate.producer() if gate is not None else None
            if (gate is not None and sigmoid is not None and sigmoid in position and sigmoid.op_type == "Sigmoid"
                    and sigmoid.inputs[0] is x and len(gate.uses()) == 1 and not gate.is_graph_output()):  # fmt: skip
                pairs[index] = position[sigmoid]
                break
    return pairs
