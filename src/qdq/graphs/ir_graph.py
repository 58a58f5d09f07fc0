"""Reading and editing an ``onnx_ir`` graph: what every qdq pass on the IR needs beyond onnx_ir's own methods.

onnx_ir keeps producers and uses current through every edit (``Value.producer()``, ``Value.uses()``,
``Value.replace_all_uses_with``, ``Node.replace_input_with``, ``Graph.insert_before`` / ``remove``); reads inside
the subgraphs of control flow are uses like any other. This module adds the questions qdq's passes ask of it, in
qdq's terms: a value's constant as numpy, a node's attribute with its ONNX default, the single reader of a value,
a producer looked for through data movement, fresh names, constants added, nodes removed with their reads.

Imports neither torch nor (at import time) onnx_ir.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "add_const",
    "attr",
    "const",
    "const_input",
    "fresh_name",
    "graph_readers",
    "graphs_of",
    "hand_over",
    "holders",
    "inferred_dims",
    "make_node",
    "mark_main",
    "name_of",
    "only_readers",
    "readers",
    "readers_through",
    "remove",
    "run_on_graph",
    "single_reader",
    "source",
    "subgraphs",
    "take_place",
    "tidy",
]

_NAMES_KEY = "qdq.names"
_MAIN_KEY = "qdq.main_graph"


def const(value: ir.Value | None) -> np.ndarray | None:
    """The value of ``value`` as a numpy array when it is an initializer or a ``Constant`` node's output (its
    ``value`` attribute); None otherwise."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    tensor = node.attributes.get("value")
    return None if tensor is None else tensor.as_tensor().numpy()


def const_input(node: ir.Node, index: int) -> np.ndarray | None:
    """Constant input ``index`` of ``node``; None when absent or not a constant."""
    return const(node.inputs[index]) if len(node.inputs) > index else None


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (an int, float, string, list, tensor, graph), or ``default``."""
    found = node.attributes.get(name)
    if found is None:
        return default
    return list(found.value) if isinstance(found.value, tuple) else found.value


def name_of(value: ir.Value | None, default: str = "value") -> str:
    """``value``'s name, or ``default`` when it has none (a stem for the names of what a pass derives from it)."""
    return (value.name if value is not None else None) or default


def readers(value: ir.Value) -> list[ir.Node]:
    """The nodes reading ``value``, once per input slot (a node reading it twice appears twice); a read inside a
    subgraph is its inner node's."""
    return [use.node for use in value.uses()]


def single_reader(value: ir.Value | None) -> ir.Node | None:
    """The only node reading ``value``, when there is exactly one read and ``value`` is not a graph output."""
    if value is None or value.is_graph_output():
        return None
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def only_readers(value: ir.Value, op_types: Iterable[str]) -> list[ir.Node] | None:
    """The nodes reading ``value`` when there are some, each of one of ``op_types``, and ``value`` is not a graph
    output; else None."""
    found, allowed = readers(value), frozenset(op_types)
    ok = found and not value.is_graph_output() and all(node.op_type in allowed for node in found)
    return found if ok else None


def source(value: ir.Value | None, through: Iterable[str] = ()) -> ir.Node | None:
    """The node producing ``value``, looking back through ops in ``through`` along their first input (None: a graph
    input or an initializer)."""
    skip = frozenset(through)
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in skip and node.inputs and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    return node


def readers_through(
    value: ir.Value, through: Iterable[str], reads: Callable[[ir.Value], list[ir.Node | None]] | None = None
) -> list[ir.Node | None]:
    """The nodes reading ``value``, looking through ops in ``through``; None stands for a graph output. ``reads``:
    the readers of one value, None for a graph output (default: every node reading it, in subgraphs too)."""
    skip, read = frozenset(through), reads or _reads
    found: list[ir.Node | None] = []
    pending, seen = [value], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for node in read(current):
            if node is not None and node.op_type in skip:
                pending.extend(node.outputs)
            else:
                found.append(node)
    return found


def _reads(value: ir.Value) -> list[ir.Node | None]:
    return [*([None] if value.is_graph_output() else []), *readers(value)]


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs of ``node``'s attributes (an ``If``'s branches, a ``Loop``'s body); empty for other nodes."""
    import onnx_ir as ir

    found: list[ir.Graph] = []
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.GRAPH:
            found.append(attribute.value)
        elif attribute.type == ir.AttributeType.GRAPHS:
            found.extend(attribute.value)
    return found


def graphs_of(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and the subgraphs of its control flow, outer first."""
    yield graph
    for node in graph:
        for sub in subgraphs(node):
            yield from graphs_of(sub)


def holders(graph: ir.Graph) -> dict[int, ir.Node]:
    """``id`` of each subgraph under ``graph``'s nodes (an ``If``'s branches, a ``Loop``'s body, nested ones
    included) -> the node of ``graph`` holding it: the arguments of :func:`graph_readers`."""
    return {id(inner): node for node in graph for sub in subgraphs(node) for inner in graphs_of(sub)}


def graph_readers(value: ir.Value, held: Mapping[int, ir.Node]) -> list[ir.Node]:
    """The nodes of one graph reading ``value``, once per input slot, as a runtime sees that graph: a read inside a
    subgraph is the read of the node holding it (``held``: :func:`holders` of the graph), counted once, and not at
    all when that node reads ``value`` itself."""
    found: list[ir.Node] = []
    for use in value.uses():
        node = held.get(id(use.node.graph), use.node)
        if node is use.node or (not any(n is node for n in found) and all(v is not value for v in node.inputs)):
            found.append(node)
    return found


def take_place(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` for every reader and as a graph output, with ``old``'s name, type and shape (a node
    that computes ``old`` another way; ``old`` is read by nothing after)."""
    name, kind, shape = old.name, old.type, old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name, new.type, new.shape = name, kind, shape


def hand_over(value: ir.Value, node: ir.Node, index: int = 0) -> ir.Value:
    """``node``, put after what writes ``value``, reads it at ``index``, and its first output takes ``value``'s place:
    every other reader, a graph output slot, the name, type and shape (``value`` takes the output's former name).
    Returns that output."""
    out = node.outputs[0]
    value.replace_all_uses_with(out, replace_graph_outputs=True)
    node.replace_input_with(index, value)
    value.name, out.name = out.name, value.name
    out.type, out.shape = value.type, value.shape
    return out


def fresh_name(graph: ir.Graph, stem: str) -> str:
    """A value name starting with ``stem`` (``<stem>__<n>``) that no value of the model ``graph`` belongs to has
    (its main graph and every subgraph, when :func:`mark_main` ran: :func:`qdq.graphs.onnx.on_ir` runs it; else
    ``graph`` and its subgraphs). The names in use are listed at the first call and every fresh name is added."""
    main = graph.meta.get(_MAIN_KEY, graph)
    if _NAMES_KEY not in main.meta:
        main.meta[_NAMES_KEY] = _names(main)
    taken: set[str] = main.meta[_NAMES_KEY]
    n = len(taken)
    name = f"{stem}__{n}"
    while name in taken:
        n += 1
        name = f"{stem}__{n}"
    taken.add(name)
    return name


def mark_main(model: ir.Model) -> None:
    """Point every subgraph of ``model`` at its main graph, whose names :func:`fresh_name` keeps for all of them."""
    for graph in graphs_of(model.graph):
        graph.meta[_MAIN_KEY] = model.graph


def _names(graph: ir.Graph) -> set[str]:
    names: set[str] = set()
    for g in graphs_of(graph):
        names.update(v.name for v in (*g.inputs, *g.outputs, *g.initializers.values()) if v.name)
        names.update(v.name for node in g for v in (*node.outputs, *node.inputs) if v is not None and v.name)
    return names


def add_const(graph: ir.Graph, stem: str, array: np.ndarray) -> ir.Value:
    """A new initializer of ``graph`` holding ``array`` (copied), named from ``stem``."""
    import onnx_ir as ir

    name = fresh_name(graph, stem)
    data = np.array(array, copy=True, order="C")
    tensor = ir.Tensor(data, name=name)  # not ir.tensor: its protocol checks cost more than the rest of a Q/DQ write
    value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=ir.Shape(data.shape))
    graph.register_initializer(value)
    return value


def make_node(
    graph: ir.Graph, op_type: str, inputs: list[ir.Value | None], stem: str, *, name: str = "", **attributes: Any
) -> ir.Node:
    """A node of ``op_type`` (not yet in ``graph``) reading ``inputs``, its one output named from ``stem``."""
    import onnx_ir as ir

    node = ir.node(op_type, inputs, attributes or None, name=name or None)
    node.outputs[0].name = fresh_name(graph, stem)
    return node


def remove(graph: ir.Graph, nodes: Iterable[ir.Node]) -> None:
    """Remove ``nodes`` (each once, whichever graph of the model holds it) with their reads; what they write
    must be unread by the nodes kept."""
    doomed = list({id(n): n for n in nodes}.values())
    by_graph: dict[int, tuple[ir.Graph, list[ir.Node]]] = {}
    for node in doomed:
        owner = node.graph if node.graph is not None else graph
        by_graph.setdefault(id(owner), (owner, []))[1].append(node)
    for owner, owned in by_graph.values():
        owner.remove(owned, safe=True)


def inferred_dims(model: ir.Model) -> dict[str, list[int | None]]:
    """The dimensions of every value ONNX shape inference can tell (None for a symbolic one), inferred on a
    serialized copy (the model keeps its recorded types); empty when inference fails."""
    import onnx
    import onnx_ir as ir

    from qdq.graphs.onnx_types import recorded_dims

    try:
        inferred = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model)).graph
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return {}
    return recorded_dims((*inferred.input, *inferred.output, *inferred.value_info))


def tidy(model: ir.Model) -> None:
    """Exact clean-ups: an ``Identity`` of an initializer (not a graph output) is bypassed, then onnx_ir's
    ``RemoveUnusedNodesPass`` removes what nothing reads, and the initializers nothing reads in subgraphs (an ``If``
    branch's; the pass clears the main graph's only). (onnx_ir 1.1's ``IdentityEliminationPass`` raises on a
    branch that returns an outer value through an ``Identity``: silero's decoder.)"""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    for node in list(model.graph):
        x = node.inputs[0] if node.op_type == "Identity" and node.inputs else None
        if x is not None and x.const_value is not None and not node.outputs[0].is_graph_output():
            node.outputs[0].replace_all_uses_with(x)
            model.graph.remove(node, safe=True)
    RemoveUnusedNodesPass()(model)
    for graph in graphs_of(model.graph):
        for value in list(graph.initializers.values()):
            if not value.uses() and not value.is_graph_output() and not value.is_graph_input():
                graph.initializers.pop(str(value.name))


def run_on_graph(model: onnx.ModelProto, edit: Callable[..., Any], *args: Any) -> Any:
    """Run ``edit(graph, *args)`` on ``model``'s main graph as onnx_ir, ``model`` updated in place (one round
    trip, :func:`qdq.graphs.onnx.on_ir`); what ``edit`` returned. Tests and one-pass callers use it."""
    from qdq.graphs.onnx import on_ir

    return on_ir(model, lambda ir_model: edit(ir_model.graph, *args))[0]
