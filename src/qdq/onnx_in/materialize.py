"""The ONNX front end's edits: each quantizer of the view written as Q/DQ nodes with its range.

Every quantizer becomes one step (``amax / 127``, or ``/ 255`` unsigned: :func:`qdq.tensor_quant.quant_step`, the
PyTorch path's arithmetic) and one zero point (0, int8 or uint8), shared by all of its sites:

* a value quantized for every reader: ``Q -> DQ`` after its producer, every reader reading the DQ (a model output
  keeps its name: the DQ writes it);
* a value quantized as one op reads it: ``Q -> DQ`` before that op, read by it alone (one pair for the readers
  that quantize the same value on the same grid: the same step and zero point);
* a weight: its integers stored as an int8 initializer, per channel, read through a ``DequantizeLinear``.

Where an ``Attention`` op's facts put the softmax scale on the query (``scale_query``: ONNX Runtime), the graph's
``Div`` or ``Mul`` of the scores becomes a ``Mul`` of the query before its quantizer, ``Mul -> Q -> DQ -> MatMul``,
as qdq's attention module exports it: the query's range, measured on the query, is multiplied by the factor (what
max calibration measures on the scaled query, to float rounding).

Each Q and DQ node carries its quantizer's name (node metadata ``qdq.quantizer``, :mod:`qdq.graphs.onnx_tags`), as
the PyTorch export writes them, so the targets' rewrites and :func:`~qdq.graphs.onnx_tags.qdq_sites` read both
alike. New nodes keep the graph's topological order. A site inside an ``If`` branch is written there, with its
constants (:mod:`qdq.onnx_in.subgraphs`), the pair whole (TensorRT reads a Q only through its DQ) even where it
quantizes a tensor of an enclosing graph; a value-level site's readers in the branches read its DQ too.

The edit runs on onnx_ir in one round trip (:func:`qdq.graphs.onnx.on_ir`). An op's ``ref`` (its nodes' positions in
its graph, a branch found by its path: :mod:`qdq.onnx_in.view`) names the nodes as they were before the edit. New
values are named after their quantizer (``<quantizer>.step__<n>``: :func:`qdq.graphs.ir_graph.fresh_name`, unique
across the model's graphs), new nodes ``<quantizer>/QuantizeLinear`` and ``<quantizer>/DequantizeLinear``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qdq.graphs.ir_graph import add_const, const, fresh_name, make_node, remove
from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_tags import QUANTIZER_KEY
from qdq.graphs.ops import ATTENTION
from qdq.graphs.view import GraphView, Op, Site
from qdq.onnx_in.attention import AttentionNodes
from qdq.onnx_in.subgraphs import Nested, Path
from qdq.onnx_in.view import weight_axis
from qdq.tensor_quant import quant_step

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = ["activation_step", "qdq_edit", "quantizer_names", "write_qdq"]

_TINY = 2.0**-24  # qdq.tensor_quant.AMAX_EPSILON: a range this small quantizes everything to 0 (step 1)


def quantizer_names(view: GraphView) -> dict[int, str]:
    """A name for every quantizer of ``view`` (by ``id``), after its first site: ``<op>.input_<i>``,
    ``<op>.weight``, ``<tensor>.output``."""
    names: dict[int, str] = {}
    used: set[str] = set()
    for quantizer in view.quantizers():
        site = quantizer.sites[0]
        if site.reader is None:
            base = f"{site.value.name}.output"
        elif quantizer.per_channel:
            base = f"{site.reader.name}.weight"
        else:
            base = f"{site.reader.name}.input_{site.index}"
        name, n = base, 1
        while name in used:
            name, n = f"{base}_{n}", n + 1
        used.add(name)
        names[id(quantizer)] = name
    return names


def write_qdq(model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray]) -> int:
    """Insert the Q/DQ nodes of ``view``'s quantizers into ``model`` (in place), with ``ranges[id(quantizer)]``
    (float32 amax: 0-d for an activation, ``[C]`` for a weight); returns how many Q/DQ pairs were written."""
    return int(on_ir(model, qdq_edit(view, ranges))[0])


def qdq_edit(view: GraphView, ranges: Mapping[int, np.ndarray]) -> Callable[[ir.Model], int]:
    """:func:`write_qdq` as an edit of an onnx_ir model (to run in a round trip made anyway): returns how many Q/DQ
    pairs it wrote."""
    names = quantizer_names(view)
    return lambda ir_model: _Writer(ir_model.graph).write(view, names, ranges)


class _Writer:
    """The model's graphs as onnx_ir: the main graph and each ``If`` branch, by path, with their nodes at the positions
    the view's refs name (listed before the edit), and what is written into them."""

    def __init__(self, graph: ir.Graph) -> None:
        import onnx_ir

        self.graphs = _graphs(graph, ())
        self.position = {node: index for _, nodes in self.graphs.values() for index, node in enumerate(nodes)}
        self.values = onnx_ir.convenience.create_value_mapping(graph)  # every graph's, by name (unique once prepared)
        self.grids: dict[tuple[ir.Graph, str], tuple[ir.Value, ir.Value]] = {}  # (graph, quantizer) -> step, zero
        self.shared: dict[tuple[Any, ...], list[ir.Node]] = {}  # (graph, source, grid) -> its Q, DQ, first reader
        self.tails: dict[ir.Node | ir.Graph, ir.Node] = {}  # producer (graph: its start) -> last node put after it
        self.pairs = 0

    def _at(self, op: Op) -> tuple[ir.Graph, list[ir.Node], Any]:
        """The graph ``op`` is in, its nodes, and the op's ``ref`` there."""
        path, ref = (op.ref.path, op.ref.ref) if isinstance(op.ref, Nested) else ((), op.ref)
        return (*self.graphs[path], ref)

    def write(self, view: GraphView, names: dict[int, str], ranges: Mapping[int, np.ndarray]) -> int:
        """Every quantizer of ``view`` written (:func:`write_qdq`); how many Q/DQ pairs."""
        ranges = self.scale_queries(view, ranges)
        for quantizer in view.quantizers():
            name, amax = names[id(quantizer)], np.asarray(ranges[id(quantizer)], np.float32)
            for number, site in enumerate(quantizer.sites):
                node_name = f"{name}_{number}" if number else name
                if quantizer.per_channel and site.reader is not None:
                    self.weight(site, node_name, amax)
                else:
                    self.activation(site, node_name, name, amax, quantizer.unsigned)
        # the branches' types, inferred for placing, go: a rewrite may retype their tensors
        for branch in (graph for path, (graph, _) in self.graphs.items() if path):
            for value in (v for node in branch for v in node.outputs if not v.is_graph_output()):
                value.type, value.shape = None, None
        return self.pairs

    def scale_queries(self, view: GraphView, ranges: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The softmax scale of each ``Attention`` op whose facts say ``scale_query`` moved onto its query, where the
        query has a quantizer of its own; ``ranges`` with those queries' ranges multiplied by the factor."""
        scaled = dict(ranges)
        for op in view.ops_of(ATTENTION):
            facts = view.notes.get(op.name, {}).get("attention")
            quantizer, (graph, nodes, found) = view.quantizer_at(op, 0), self._at(op)
            if (facts is None or not facts.scale_query or quantizer is None or found.scale is None
                    or quantizer.sites != [Site(op.inputs[0], op, 0)]):  # fmt: skip
                continue
            factor = _scale_query(graph, nodes[found.scores], nodes[found.scale], op.name)
            scaled[id(quantizer)] = (np.asarray(ranges[id(quantizer)], np.float32) * factor).astype(np.float32)
        return scaled

    def grid(self, graph: ir.Graph, name: str, amax: np.ndarray, unsigned: bool) -> tuple[ir.Value, ir.Value]:
        """The step and zero-point initializers of an activation quantizer (made once per graph, shared by its
        sites there)."""
        if (graph, name) not in self.grids:
            step = add_const(graph, f"{name}.step", activation_step(amax, unsigned))
            zero = add_const(graph, f"{name}.zero_point", np.zeros((), np.uint8 if unsigned else np.int8))
            self.grids[graph, name] = (step, zero)
        return self.grids[graph, name]

    def activation(self, site: Site, node_name: str, tag: str, amax: np.ndarray, unsigned: bool) -> None:
        if site.reader is None:
            self._value_level(self.values[site.value.name], node_name, tag, amax, unsigned)
            return
        graph, slots = self._reader_slots(site)
        first = min((node for node, _ in slots), key=self.position.__getitem__)
        source = slots[0][0].inputs[slots[0][1]]  # the value, or a value-level DQ written before
        scale, zero = self.grid(graph, tag, amax, unsigned)
        grid = (graph, source, np.asarray(const(scale)).tobytes(), unsigned)
        if grid in self.shared:  # the same value on the same grid read by another op: one Q/DQ pair for both
            q, dq, at = self.shared[grid]
            if self.position[first] < self.position[at]:  # an earlier reader: the pair moves before it
                graph.remove([q, dq])
                graph.insert_before(first, [q, dq])
                self.shared[grid][2] = first
        else:
            q, dq = _pair(graph, source, f"{node_name}.dq", node_name, tag, scale, zero)
            graph.insert_before(first, [q, dq])
            self.shared[grid] = [q, dq, first]
            self.pairs += 1
        for node, index in slots:
            node.replace_input_with(index, dq.outputs[0])

    def _value_level(self, value: ir.Value, node_name: str, tag: str, amax: np.ndarray, unsigned: bool) -> None:
        """``Q -> DQ`` after the value's producer, read by every reader (a graph output keeps its name: the DQ writes
        it, the producer writes ``<name>.float``)."""
        graph = value.graph
        assert graph is not None
        q, dq = _pair(graph, value, f"{node_name}.dq", node_name, tag, *self.grid(graph, tag, amax, unsigned))
        restored = dq.outputs[0]
        value.replace_all_uses_with(restored, replace_graph_outputs=True)  # Q nodes written before too: Q(DQ(Q(x)))
        q.replace_input_with(0, value)
        if restored.is_graph_output():  # its name and type move to the DQ
            restored.type, restored.shape, value.type, value.shape = value.type, value.shape, None, None
            restored.name, value.name = value.name, fresh_name(graph, f"{value.name}.float")
        producer = value.producer()
        where = producer if producer is not None else graph  # a graph input or a constant: the graph's start
        anchor = self.tails.get(where, producer)  # after the pairs put there before (in the order written)
        if anchor is not None:
            graph.insert_after(anchor, [q, dq])
        else:
            graph.insert_before(next(iter(graph)), [q, dq])
        self.tails[where] = dq
        self.pairs += 1

    def weight(self, site: Site, name: str, amax: np.ndarray) -> None:
        graph, ((node, index),) = self._reader_slots(site)
        weight = const(node.inputs[index])
        assert weight is not None
        weight = weight.astype(np.float32)
        axis = weight_axis(site.input_reader, site.index) % weight.ndim
        step = activation_step(amax.reshape(-1), False)
        shape = [1] * weight.ndim
        shape[axis] = -1
        integers = np.clip(np.rint(weight / step.reshape(shape)), -128, 127).astype(np.int8)
        arrays = {"int8": integers, "step": step, "zero_point": np.zeros(step.shape, np.int8)}
        inputs: list[ir.Value | None] = [add_const(graph, f"{name}.{stem}", array) for stem, array in arrays.items()]
        dq = make_node(graph, "DequantizeLinear", inputs, f"{name}.dq", name=f"{name}/DequantizeLinear", axis=axis)
        dq.metadata_props[QUANTIZER_KEY] = name
        graph.insert_before(node, dq)
        node.replace_input_with(index, dq.outputs[0])
        self.pairs += 1

    def _reader_slots(self, site: Site) -> tuple[ir.Graph, list[tuple[ir.Node, int]]]:
        """The reader's graph, and ``(node, input position)`` where the site's reader reads its value (a SiLU: in its
        sigmoid and its product; an attention: where :meth:`AttentionNodes.reads` says); positions count the node's
        empty optional inputs, which the view leaves out."""
        graph, nodes, ref = self._at(site.input_reader)
        if isinstance(ref, AttentionNodes):
            return graph, [(nodes[position], slot) for position, slot in ref.reads(site.index)]
        if isinstance(ref, tuple):
            value = self.values[site.value.name]
            return graph, [(nodes[i], nodes[i].inputs.index(value)) for i in ref if value in nodes[i].inputs]
        present = [i for i, value in enumerate(nodes[ref].inputs) if value is not None]
        return graph, [(nodes[ref], present[site.index])]


def _graphs(graph: ir.Graph, path: Path) -> dict[Path, tuple[ir.Graph, list[ir.Node]]]:
    """``graph`` (at ``path``) and its ``If`` branches, nested ones included, each with its nodes as they are now."""
    nodes = list(graph)
    found = {path: (graph, nodes)}
    for position, node in enumerate(nodes):
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            for name in ("then_branch", "else_branch"):
                found.update(_graphs(node.attributes[name].value, (*path, (position, name))))
    return found


def _scale_query(graph: ir.Graph, scores: ir.Node, scale: ir.Node, name: str) -> np.float32:
    """``query * factor -> Q·Kᵀ`` instead of ``Q·Kᵀ`` divided or multiplied by the scale (its node ``scale`` removed,
    its reader reading ``Q·Kᵀ``); returns the factor (float32)."""
    data = scale.inputs.index(scores.outputs[0])
    constant = float(np.asarray(const(scale.inputs[1 - data])).reshape(-1)[0])
    factor = np.float32(1.0 / constant if scale.op_type == "Div" else constant)
    inputs = [scores.inputs[0], add_const(graph, f"{name}.query_scale", np.array(factor, np.float32))]
    mul = make_node(graph, "Mul", inputs, f"{name}.query_scaled", name=f"{name}/query_scale")
    graph.insert_before(scores, mul)
    scores.replace_input_with(0, mul.outputs[0])
    scale.outputs[0].replace_all_uses_with(scores.outputs[0])
    remove(graph, [scale])
    return factor


def activation_step(amax: np.ndarray, unsigned: bool) -> np.ndarray:
    """``amax / max_bound`` in float32 as the PyTorch path computes it (a range <= 2**-24: step 1)."""
    amax = np.asarray(amax, np.float32)
    step = quant_step(torch.from_numpy(np.array(amax)), 8, unsigned).numpy()
    return np.where(amax <= _TINY, np.float32(1.0), step).astype(np.float32)


def _pair(graph: ir.Graph, source: ir.Value | None, output: str, name: str, tag: str, scale: ir.Value,
          zero: ir.Value) -> tuple[ir.Node, ir.Node]:  # fmt: skip
    q = make_node(graph, "QuantizeLinear", [source, scale, zero], f"{name}.q", name=f"{name}/QuantizeLinear")
    dq = make_node(graph, "DequantizeLinear", [q.outputs[0], scale, zero], output, name=f"{name}/DequantizeLinear")
    for node in (q, dq):
        node.metadata_props[QUANTIZER_KEY] = tag
    return q, dq
