"""Attention written out op by op in an ONNX graph, found as one ``Attention`` op of the view, and its shapes.

Exporters write ``softmax(Q·Kᵀ·s + mask)·V`` as its ops (a fused attention op is never assumed)::

    MatMul(Q, Kᵀ) -> [Div | Mul by a constant] -> [Add(·, mask)] -> [Flatten] -> Softmax -> [Reshape]
                  -> [Where(IsNaN(p), 0, p)] -> MatMul(·, V)

(the guard after the softmax is how torch exports ``F.scaled_dot_product_attention``, which also scales Q and Kᵀ
before their product instead: those are then the op's query and key, as a scale on Q alone is in Paddle's exports;
the Flatten and the Reshape around the softmax are paddle2onnx's). Every value between the two MatMuls is read
once, by the next op of the chain (a ``Shape`` may read its shape), and none is a graph output.
:func:`find_attention` finds these chains; :mod:`qdq.onnx_in.view` makes each one ``Attention`` op (inputs: the
query, the key as ``Q·Kᵀ`` reads it, ``V``, the mask; inner value ``"probs"``: what ``MatMul(·, V)`` reads), as
the PyTorch front end makes qdq's attention module one, so that the targets' ``attention`` rule
(:mod:`qdq.targets.common.attention`) reaches both.

A target's facts may limit the head size and the sequence length (TensorRT's fused kernels). Shapes are not in the
graph's ops: :func:`attention_shapes` reads them from ONNX shape inference for the input shapes of the calibration
batches, as the PyTorch module records them while it calibrates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from qdq.graphs.onnx import feed_inputs
from qdq.graphs.onnx_types import recorded_dims
from qdq.graphs.ops import ATTENTION
from qdq.graphs.view import GraphView

__all__ = ["AttentionNodes", "attention_shapes", "find_attention"]

_SMALL = 64  # initializers of at most this many elements stay in the graph shape inference reads (shapes, axes)


@dataclass(frozen=True)
class AttentionNodes:
    """One attention written out op by op: the positions of its nodes in its graph's ``node`` list (the ``ref`` of
    the view's ``Attention`` op).

    Attributes:
        scores: ``MatMul(Q, Kᵀ)``.
        softmax: the ``Softmax`` over the scores.
        output: ``MatMul(probs, V)``.
        scale: the ``Div`` or ``Mul`` of the scores by a one-element constant, or None.
        mask: the ``Add`` of a mask to the (scaled) scores, or None; ``mask_index``: the mask's input there.
        guard: the ``IsNaN`` and the ``Where`` that zero a fully masked row's probabilities, or ``()``.
        layout: the ``Flatten`` (or ``Reshape``) before the softmax and the ``Reshape`` after it, where there are.
    """

    scores: int
    softmax: int
    output: int
    scale: int | None = None
    mask: int | None = None
    mask_index: int = 1
    guard: tuple[int, ...] = ()
    layout: tuple[int, ...] = ()

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every node's position, the last MatMul's last."""
        optional = [p for p in (self.scale, self.mask) if p is not None]
        return (self.scores, *optional, *self.layout, self.softmax, *self.guard, self.output)

    def reads(self, index: int) -> list[tuple[int, int]]:
        """``(node position, input position)`` where the op's input ``index`` is read: the query (0) and the key
        (1) by ``Q·Kᵀ``, ``V`` (2) by the last MatMul, the mask (3) by the ``Add``."""
        if index == 3:
            return [] if self.mask is None else [(self.mask, self.mask_index)]
        return [[(self.scores, 0)], [(self.scores, 1)], [(self.output, 1)]][index]


def find_attention(graph: ir.Graph, constants: Mapping[str, int]) -> dict[int, AttentionNodes]:
    """The attentions of ``graph`` written out op by op (module doc), by the position of their last ``MatMul``.
    ``constants``: the initializers the graph reads (its own and, in a branch, the main graph's), name -> size."""
    return {found.output: found for found in _Chains(graph, constants).all()}


class _Chains:
    """The attention chains through a graph's ``Softmax`` nodes, walked with onnx_ir's producers and uses; nodes by
    their position in the graph (a read inside a subgraph is not this graph's)."""

    def __init__(self, graph: ir.Graph, constants: Mapping[str, int]) -> None:
        self.nodes, self.constants = list(graph), constants
        self.position = {node: index for index, node in enumerate(self.nodes)}

    def all(self) -> Iterable[AttentionNodes]:
        for number, node in enumerate(self.nodes):
            found = self._around(number) if node.op_type == "Softmax" else None
            if found is not None:
                yield found

    def _readers(self, value: ir.Value) -> list[int]:
        """The positions of this graph's nodes reading ``value``, once per read, in graph order."""
        return sorted(self.position[use.node] for use in value.uses() if use.node in self.position)

    def _values_read(self, value: ir.Value) -> list[int]:
        """The nodes reading ``value``'s values (a ``Shape`` reads only its shape)."""
        return [i for i in self._readers(value) if self.nodes[i].op_type != "Shape"]

    def _only(self, value: ir.Value, op_type: str) -> int | None:
        """The one node reading ``value`` (once), when it is a ``op_type`` and ``value`` no graph output."""
        found = self._values_read(value)
        if len(found) != 1 or value.is_graph_output() or self.nodes[found[0]].op_type != op_type:
            return None
        return found[0]

    def _made_by(self, value: ir.Value | None, op_type: str, reader: int) -> int | None:
        """The ``op_type`` node writing ``value``, when ``reader`` alone reads it."""
        if value is None:
            return None
        found = self._writer(value)
        ok = found is not None and self.nodes[found].op_type == op_type and self._values_read(value) == [reader]
        return found if ok and not value.is_graph_output() else None

    def _writer(self, value: ir.Value) -> int | None:
        """The position of the node of this graph writing ``value``, or None."""
        producer = value.producer()
        return self.position.get(producer) if producer is not None else None

    def _activation(self, value: ir.Value | None) -> bool:
        return value is not None and value.name not in self.constants

    def _input(self, node: int, index: int) -> ir.Value | None:
        inputs = self.nodes[node].inputs
        return inputs[index] if len(inputs) > index else None

    def _around(self, softmax: int) -> AttentionNodes | None:
        probs, layout = self.nodes[softmax].outputs[0], []
        unflatten = self._only(probs, "Reshape")
        if unflatten is not None:
            probs = self.nodes[unflatten].outputs[0]
            layout.append(unflatten)
        probs, guard = self._guarded(probs)
        output = self._only(probs, "MatMul")
        if output is None or self._input(output, 0) is not probs:
            return None
        scores_out, last = self._input(softmax, 0), softmax
        flatten = self._made_by(scores_out, "Flatten", softmax) or self._made_by(scores_out, "Reshape", softmax)
        if flatten is not None:
            scores_out, last = self._input(flatten, 0), flatten
            layout.insert(0, flatten)
        mask, mask_index = None, 1
        add = self._made_by(scores_out, "Add", last)
        if add is not None:
            first = self._input(add, 0)
            mask_index = 1 if first is not None and self._writer(first) in self._score_writers(add) else 0
            mask, scores_out, last = add, self._input(add, 1 - mask_index), add
        scale = self._scale(scores_out, last)
        if scale is not None:
            second = self._input(scale, 1)
            scores_out = self._input(scale, 0 if second is not None and second.name in self.constants else 1)
        scores = self._made_by(scores_out, "MatMul", scale if scale is not None else last)
        if scores is None:
            return None
        query, key, value = self._input(scores, 0), self._input(scores, 1), self._input(output, 1)
        if not all(map(self._activation, (query, key, value))) or len({id(query), id(key), id(value)}) < 3:
            return None
        return AttentionNodes(scores, softmax, output, scale, mask, mask_index, guard, tuple(layout))

    def _score_writers(self, add: int) -> set[int | None]:
        """The nodes that may write the scores an ``Add`` adds a mask to: a scale or ``Q·Kᵀ``, read by it alone."""
        found = {self._made_by(value, t, add) for value in self.nodes[add].inputs for t in ("Mul", "Div", "MatMul")}
        return found - {None}

    def _scale(self, value: ir.Value | None, reader: int) -> int | None:
        """The ``Div`` (by a one-element constant) or ``Mul`` (by one, either side) writing ``value`` for ``reader``
        alone, whose data input is written by a ``MatMul``."""
        for op_type in ("Div", "Mul"):
            found = self._made_by(value, op_type, reader)
            if found is None:
                continue
            inputs = list(self.nodes[found].inputs)
            sides = [1] if op_type == "Div" else [1, 0]
            for side in sides:
                constant, data = inputs[side], inputs[1 - side]
                if (constant is not None and self.constants.get(constant.name or "") == 1
                        and self._made_by(data, "MatMul", found) is not None):  # fmt: skip
                    return found
        return None

    def _guarded(self, probs: ir.Value) -> tuple[ir.Value, tuple[int, ...]]:
        """``(what the last MatMul reads, the guard's nodes)``: ``Where(IsNaN(p), 0, p)`` after the softmax, else
        the softmax's output and no guard."""
        readers = self._readers(probs)
        if len(readers) != 2 or probs.is_graph_output():
            return probs, ()
        isnan = next((i for i in readers if self.nodes[i].op_type == "IsNaN"), None)
        where = next((i for i in readers if self.nodes[i].op_type == "Where"), None)
        if isnan is None or where is None or self._only(self.nodes[isnan].outputs[0], "Where") != where:
            return probs, ()
        inputs = list(self.nodes[where].inputs)
        if (len(inputs) != 3 or inputs[0] is not self.nodes[isnan].outputs[0] or inputs[2] is not probs
                or inputs[1] is None or inputs[1].name not in self.constants):  # fmt: skip
            return probs, ()
        return self.nodes[where].outputs[0], (isnan, where)


def attention_shapes(model: onnx.ModelProto, view: GraphView,
                     batches: Sequence[Any] = ()) -> dict[str, tuple[int, int]]:  # fmt: skip
    """Op name -> ``(head size, longest query or key sequence)`` of each ``Attention`` op of the main graph whose
    target facts limit the shapes (``head_sizes``, ``max_length``), from ONNX shape inference on ``model`` with the
    input shapes of ``batches`` (each distinct set once; none: the shapes the graph declares). A sequence length
    shape inference leaves unknown is 0; an op whose head size it leaves unknown is left out."""
    limited = {op.name: op for op in view.ops_of(ATTENTION) if isinstance(op.ref, AttentionNodes)
               and _limits(view.notes.get(op.name, {}).get("attention"))}  # fmt: skip
    found: dict[str, tuple[int, int]] = {}
    for feeds in _input_shapes(model, batches) if limited else []:
        inferred = _inferred(model, feeds)
        for name, op in limited.items():
            query, key = inferred.get(op.inputs[0].name), inferred.get(op.inputs[1].name)
            if not query or not key or query[-1] is None:
                continue
            length = max([d for d in (query[-2] if len(query) > 1 else None, key[-1]) if d is not None], default=0)
            found[name] = (query[-1], max(length, found.get(name, (0, 0))[1]))
    return found


def _limits(facts: Any) -> bool:
    return facts is not None and (facts.head_sizes is not None or facts.max_length is not None)


def _input_shapes(model: onnx.ModelProto, batches: Sequence[Any]) -> list[dict[str, tuple[int, ...]]]:
    """The distinct input shapes of ``batches`` (dicts of graph input name -> array, or one input's arrays); a
    list with no shapes (``[{}]``) when none is given."""
    inputs = [i.name for i in feed_inputs(model)]
    found: dict[tuple[Any, ...], dict[str, tuple[int, ...]]] = {}
    for batch in batches:
        named = batch if isinstance(batch, Mapping) else dict(zip(inputs[:1], [batch])) if len(inputs) == 1 else {}
        shapes = {name: tuple(np.shape(named[name])) for name in inputs if name in named}
        found.setdefault(tuple(sorted(shapes.items())), shapes)
    return list(found.values()) or [{}]


def _inferred(model: onnx.ModelProto, feeds: Mapping[str, tuple[int, ...]]) -> dict[str, list[int | None]]:
    """Tensor name -> its dimensions (None where unknown) by ONNX shape inference with data propagation, the graph's
    inputs given the shapes ``feeds`` names. It runs on a copy that holds the small initializers only (the large
    ones are typed inputs): a shape never depends on a weight's values."""
    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.output.extend(model.graph.output)
    for value in model.graph.input:
        shape = feeds.get(value.name)
        graph.input.append(value if shape is None else helper.make_tensor_value_info(
            value.name, value.type.tensor_type.elem_type, list(shape)))  # fmt: skip
    for tensor in model.graph.initializer:
        if int(np.prod(tensor.dims)) <= _SMALL:
            graph.initializer.append(tensor)
        else:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True).graph
    except onnx.shape_inference.InferenceError:
        return {}
    return recorded_dims((*inferred.input, *inferred.value_info, *inferred.output))
