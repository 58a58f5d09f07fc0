"""The branches of an ONNX file's ``If`` nodes, as the ONNX front end reads, calibrates and writes them.

Exporters put whole networks inside ``If`` branches (silero-vad: one branch per sample rate, its convolutions and
their weights inside) and read main-graph weights from inside a branch (the LSTM of ``silero_vad_16k_op15``).
The front end takes every ``If`` branch, nested ones included, as part of the one graph it places Q/DQ on:

* a branch is addressed by its :data:`Path` from the main graph (the ``If`` node's position, the attribute name,
  and so on down): :func:`if_branches`, :func:`graph_at`; a node inside a branch is an op of the view whose ``ref``
  is a :class:`Nested` (the branch's path and the node's position there);
* preparing (:func:`qdq.onnx_in.load.prepare`) moves the branches' weights (their ``Constant`` nodes and
  initializers) to the main graph's initializers, which every graph of the model can read: a weight is an
  initializer wherever its op is;
* calibration (:func:`expose`): ONNX Runtime returns only the main graph's outputs, so each tensor a branch
  computes is returned by its branch, by the ``If`` (the other branch returns an empty tensor in its place), and
  so on up to the main graph, under its own name. A branch the calibration data takes is calibrated on the values
  it computes when it runs; an empty tensor is no data, and a quantizer that only ever saw empty tensors (a branch
  the data never took) goes, its ops left float.

``Loop`` and ``Scan`` bodies are not walked: they run many times per call and their values leave the loop only as
its outputs, so their ops stay float and the report says so.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import onnx
from onnx import TensorProto, helper

__all__ = ["Nested", "Path", "expose", "graph_at", "if_branches"]

#: where a branch is: ``((position of the If node, "then_branch" | "else_branch"), ...)`` from the main graph down
Path = tuple[tuple[int, str], ...]

_BRANCHES = ("then_branch", "else_branch")
_PROBE = "::probe"


class Nested(NamedTuple):
    """The ``ref`` of an op inside an ``If`` branch: the branch's path and the node's position in it (a pair of
    positions for a SiLU, as in the main graph). A tuple, as a SiLU's pair is: code that reads the main graph's
    positions alone (``auto``'s scoring, bias correction) passes it by."""

    path: Path
    ref: Any


def if_branches(graph: onnx.GraphProto, path: Path = ()) -> list[tuple[Path, onnx.GraphProto]]:
    """Every ``If`` branch under ``graph`` (at ``path``), nested ones included, each before those inside it."""
    found: list[tuple[Path, onnx.GraphProto]] = []
    for position, node in enumerate(graph.node):
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        for attribute in node.attribute:
            if attribute.name in _BRANCHES:
                inner = (*path, (position, attribute.name))
                found += [(inner, attribute.g), *if_branches(attribute.g, inner)]
    return found


def graph_at(model: onnx.ModelProto, path: Path) -> onnx.GraphProto:
    """The graph at ``path`` (the main graph for ``()``)."""
    graph = model.graph
    for position, name in path:
        graph = next(a.g for a in graph.node[position].attribute if a.name == name)
    return graph


def expose(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """Make each of ``names`` that an ``If`` branch computes an output of the main graph of ``model`` (a probe
    copy: the branches are edited), under its own name; returns those names (module doc). A run that takes the
    other branch returns an empty tensor for it."""
    where = {out: path for path, branch in if_branches(model.graph) for node in branch.node for out in node.output}
    types = _elem_types(model)
    exposed = [name for name in dict.fromkeys(names) if name in where]
    for name in exposed:
        path, elem = where[name], types.get(name, TensorProto.FLOAT)
        inner, graph = f"{name}{_PROBE}", graph_at(model, path)
        _rename_definition(graph, name, inner)
        graph.node.append(helper.make_node("Identity", [inner], [f"{inner}::returned"]))  # a branch output once
        inner = f"{inner}::returned"
        for depth in range(len(path), 0, -1):
            owner, (position, branch) = graph_at(model, path[: depth - 1]), path[depth - 1]
            outer = name if depth == 1 else f"{name}{_PROBE}{depth - 1}"
            _return_through(owner.node[position], branch, inner, outer, elem)
            inner = outer
        model.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    return exposed


def _return_through(node: Any, branch: str, inner: str, outer: str, elem: int) -> None:
    """``inner``, computed in ``branch`` of the ``If`` ``node``, becomes the node's output ``outer``; the other
    branch returns an empty tensor of the same type in its place."""
    for attribute in node.attribute:
        if attribute.name not in _BRANCHES:
            continue
        graph = attribute.g
        returned = inner
        if attribute.name != branch:
            returned = f"{outer}::empty"
            empty = helper.make_tensor(returned, elem, [0], [])
            graph.node.append(helper.make_node("Constant", [], [returned], value=empty))
        graph.output.append(helper.make_tensor_value_info(returned, elem, None))
    node.output.append(outer)


def _rename_definition(graph: onnx.GraphProto, name: str, new: str) -> None:
    """``name``, defined in ``graph``, is called ``new`` there and in the reads of the graphs inside it."""
    from qdq.graphs.onnx import all_nodes

    for node in graph.node:
        node.output[:] = [new if out == name else out for out in node.output]
    for node in all_nodes(graph):
        node.input[:] = [new if read == name else read for read in node.input]
    for value in graph.output:
        if value.name == name:
            value.name = new


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> element type, from the value_info, inputs and outputs of every graph of ``model``."""
    found: dict[str, int] = {}
    for graph in [model.graph, *(branch for _, branch in if_branches(model.graph))]:
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.type.tensor_type.elem_type:
                found[value.name] = value.type.tensor_type.elem_type
    return found
