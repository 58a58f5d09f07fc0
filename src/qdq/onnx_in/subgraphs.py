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
* calibration (:func:`expose`, on onnx_ir): ONNX Runtime returns only the main graph's outputs, so each tensor a
  branch computes is returned by its branch, by the ``If`` (the other branch returns an empty tensor in its place),
  and so on up to the main graph, under its own name. A branch the calibration data takes is calibrated on the values
  it computes when it runs; an empty tensor is no data, and a quantizer that only ever saw empty tensors (a branch
  the data never took) goes, its ops left float.

``Loop`` and ``Scan`` bodies are not walked: they run many times per call and their values leave the loop only as
its outputs, so their ops stay float and the report says so.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["Nested", "Path", "branch_graphs", "expose", "graph_at", "if_branches"]

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
    copy: the branches are edited, on onnx_ir), under its own name; returns those names (module doc). A run that
    takes the other branch returns an empty tensor for it."""
    if not any(node.op_type == "If" for node in model.graph.node):
        return []
    from qdq.graphs.onnx import on_ir

    (exposed,) = on_ir(model, lambda ir_model: _expose(ir_model, names))
    return exposed


def _expose(model: ir.Model, names: list[str]) -> list[str]:
    """:func:`expose` on ``model``, in place."""
    where = {value.name: (value, chain) for chain, branch in _ir_branches(model.graph, ())
             for node in branch for value in node.outputs if value.name}  # fmt: skip
    exposed = [name for name in dict.fromkeys(names) if name in where]
    for name in exposed:
        value, chain = where[name]
        dtype = value.dtype or ir.DataType.FLOAT
        value.name = f"{name}{_PROBE}"  # its reads follow: they hold the value, not its name
        branch = chain[-1][2]
        returned = ir.node("Identity", [value], name=f"{name}{_PROBE}::identity")  # a branch output once
        returned.outputs[0].name = f"{name}{_PROBE}::returned"
        branch.append(returned)
        inner = returned.outputs[0]
        for depth in range(len(chain), 0, -1):
            owner, taken, _ = chain[depth - 1]
            inner = _return_through(owner, taken, inner, name if depth == 1 else f"{name}{_PROBE}{depth - 1}", dtype)
        inner.dtype = dtype
        model.graph.outputs.append(inner)
    return exposed


_Chain = tuple[tuple[ir.Node, str, ir.Graph], ...]  # from the main graph down: (If node, branch name, branch)


def branch_graphs(graph: ir.Graph) -> list[ir.Graph]:
    """Every ``If`` branch under ``graph`` (onnx_ir), nested ones included, each before those inside it."""
    return [branch for _, branch in _ir_branches(graph, ())]


def _ir_branches(graph: ir.Graph, chain: _Chain) -> list[tuple[_Chain, ir.Graph]]:
    """Every ``If`` branch under ``graph``, nested ones included, each with its chain of ``If`` nodes."""
    found: list[tuple[_Chain, ir.Graph]] = []
    for node in graph:
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        for name, attribute in node.attributes.items():
            if name in _BRANCHES:
                inner = (*chain, (node, name, attribute.as_graph()))
                found += [(inner, inner[-1][2]), *_ir_branches(inner[-1][2], inner)]
    return found


def _return_through(node: ir.Node, taken: str, inner: ir.Value, outer: str, dtype: ir.DataType) -> ir.Value:
    """``inner``, computed in branch ``taken`` of the ``If`` ``node``, becomes the node's new output ``outer``; the
    other branch returns an empty tensor of ``dtype`` in its place. Returns that output."""
    for name, attribute in node.attributes.items():
        if name not in _BRANCHES:
            continue
        branch = attribute.as_graph()
        if name == taken:
            branch.outputs.append(inner)
            continue
        empty = ir.node("Constant", [], attributes={"value": ir.tensor(np.zeros(0, dtype.numpy()))},
                        name=f"{outer}::empty")  # fmt: skip
        empty.outputs[0].name = f"{outer}::empty"
        branch.append(empty)
        branch.outputs.append(empty.outputs[0])
    node.resize_outputs(len(node.outputs) + 1)
    node.outputs[-1].name = outer
    return node.outputs[-1]
