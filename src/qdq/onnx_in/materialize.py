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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.onnx import all_nodes, unique_value_names
from qdq.graphs.onnx_tags import QUANTIZER_KEY
from qdq.graphs.ops import ATTENTION
from qdq.graphs.view import GraphView, Op, Quantizer, Site
from qdq.onnx_in.attention import AttentionNodes
from qdq.onnx_in.subgraphs import Nested, Path, graph_at, if_branches
from qdq.onnx_in.view import weight_axis
from qdq.tensor_quant import quant_step

__all__ = ["activation_step", "quantizer_names", "write_qdq"]

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
    writers = _Writers(model)
    names = quantizer_names(view)
    ranges = writers.scale_queries(view, ranges)
    for quantizer in view.quantizers():
        writers.write(quantizer, names[id(quantizer)], np.asarray(ranges[id(quantizer)], np.float32))
    writers.finish()
    return writers.pairs


def _split(ref: Any) -> tuple[Path, Any]:
    """The graph an op's ``ref`` points into (``()``: the main graph) and the ref there."""
    return (ref.path, ref.ref) if isinstance(ref, Nested) else ((), ref)


class _Writers:
    """One writer per graph holding sites: the main graph's, and each ``If`` branch's (its Q/DQ nodes and their
    constants inside the branch, named apart from the main graph's at the end)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.main = {t.name: t for t in model.graph.initializer}
        self.writers: dict[Path, _Writer] = {}
        self.readers: dict[int, dict[str, list[tuple[Any, int]]]] = {}  # graph id -> value -> (node, input) reads

    def at(self, op: Op | None) -> _Writer:
        path = _split(op.ref)[0] if op is not None else ()
        if path not in self.writers:
            self.writers[path] = _Writer(graph_at(self.model, path), self)
        return self.writers[path]

    def write(self, quantizer: Quantizer, name: str, amax: np.ndarray) -> None:
        for number, site in enumerate(quantizer.sites):
            node_name = f"{name}_{number}" if number else name
            if quantizer.per_channel and site.reader is not None:
                self.at(site.reader).weight(site, node_name, amax)
            else:
                writer = self.at(site.reader if site.reader is not None else site.value.producer)
                writer.activation(site, node_name, name, *writer.grid(name, amax, quantizer.unsigned))

    def scale_queries(self, view: GraphView, ranges: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The softmax scale of each ``Attention`` op whose facts say ``scale_query`` moved onto its query, where the
        query has a quantizer of its own; ``ranges`` with those queries' ranges multiplied by the factor."""
        scaled = dict(ranges)
        for op in view.ops_of(ATTENTION):
            facts = view.notes.get(op.name, {}).get("attention")
            quantizer, nodes = view.quantizer_at(op, 0), _split(op.ref)[1]
            if (facts is None or not facts.scale_query or quantizer is None or nodes.scale is None
                    or quantizer.sites != [Site(op.inputs[0], op, 0)]):  # fmt: skip
                continue
            factor = self.at(op).scale_query(nodes, nodes.scale, op.name)
            scaled[id(quantizer)] = (np.asarray(ranges[id(quantizer)], np.float32) * factor).astype(np.float32)
        return scaled

    def constant(self, name: str, writer: _Writer) -> TensorProto:
        """The constant ``name`` as ``writer``'s graph reads it (its own, else the main graph's)."""
        return writer.inits.get(name) or self.main[name]

    def rewire(self, old: str, new: str, skip: Any, graph: onnx.GraphProto) -> None:
        """Every read of ``old`` in ``graph`` and the graphs inside it, and every QuantizeLinear written so far,
        reads ``new``."""
        readers = self.readers.get(id(graph))
        if readers is None:  # built once per graph: a scan of every node per rewired value is quadratic
            readers = self.readers[id(graph)] = {}
            for node in all_nodes(graph):
                for i, name in enumerate(node.input):
                    readers.setdefault(name, []).append((node, i))
        for node, i in readers.pop(old, []):
            if node.input[i] == old:  # a read another site has moved to its own pair since is left alone
                node.input[i] = new
                readers.setdefault(new, []).append((node, i))
        for writer in self.writers.values():
            for nodes in (*writer.before.values(), *writer.after.values()):
                for node in nodes:
                    if node is not skip and node.op_type == "QuantizeLinear" and node.input[0] == old:
                        node.input[0] = new  # a site-level Q written earlier reads the value-level DQ: Q(DQ(Q(x)))

    def finish(self) -> None:
        """Every graph's nodes with its Q/DQ nodes in place, the innermost branches first (an outer graph's nodes
        are copied with their branches); then the branches' constants named apart from the main graph's, and the types
recorded in the branches while placing dropped."""
        for path in sorted(self.writers, key=len, reverse=True):
            self.writers[path].finish()
        if any(path for path in self.writers):
            unique_value_names(self.model)
        for _, branch in if_branches(self.model.graph):  # types inferred to place: a rewrite may retype tensors
            del branch.value_info[:]

    @property
    def pairs(self) -> int:
        return sum(writer.pairs for writer in self.writers.values())


class _Writer:
    def __init__(self, graph: onnx.GraphProto, owner: _Writers) -> None:
        self.graph, self.owner = graph, owner
        self.nodes = list(graph.node)  # an op's ref is its position here (the view's model, or a copy)
        self.position = {id(node): index for index, node in enumerate(self.nodes)}  # stable: the list holds them
        self.before: dict[int, list[Any]] = {}  # node position -> Q/DQ nodes to put before it
        self.after: dict[int, list[Any]] = {}  # node position -> Q/DQ nodes to put after it (-1: the graph's start)
        self.inits = {t.name: t for t in graph.initializer}
        self.removed: set[int] = set()  # positions of nodes left out (a softmax scale moved onto the query)
        self.shared: dict[tuple[str, bytes, int], tuple[str, tuple[Any, Any], int]] = {}  # grid -> its pair
        self.pairs = 0

    def grid(self, name: str, amax: np.ndarray, unsigned: bool) -> tuple[str, str]:
        """The step and zero-point initializers of an activation quantizer (made once per graph, shared by its
        sites there)."""
        scale, zero = f"{name}.step", f"{name}.zero_point"
        if scale not in self.inits:
            step = activation_step(amax, unsigned)
            self._add_init(numpy_helper.from_array(step.astype(np.float32), scale))
            self._add_init(numpy_helper.from_array(np.zeros((), np.uint8 if unsigned else np.int8), zero))
        return scale, zero

    def activation(self, site: Site, node_name: str, tag: str, scale: str, zero: str) -> None:
        if site.reader is None:
            self._value_level(site, node_name, tag, scale, zero)
            return
        slots = self._reader_slots(site)
        source = slots[0][0].input[slots[0][1]]  # the value, or a value-level DQ written before
        position = min(self.position[id(node)] for node, _ in slots)
        grid = (source, numpy_helper.to_array(self.inits[scale]).tobytes(), self.inits[zero].data_type)
        if grid in self.shared:  # the same value on the same grid read by another op: one Q/DQ pair for both
            restored, pair, at = self.shared[grid]
            if position < at:  # an earlier reader: the pair moves before it (topological order)
                for node in pair:
                    self.before[at].remove(node)
                self.before.setdefault(position, []).extend(pair)
                self.shared[grid] = (restored, pair, position)
        else:
            restored = f"{node_name}.dq"
            q, dq = _pair(source, restored, node_name, tag, scale, zero)
            self.before.setdefault(position, []).extend([q, dq])
            self.shared[grid] = (restored, (q, dq), position)
            self.pairs += 1
        for node, index in slots:
            node.input[index] = restored

    def _value_level(self, site: Site, node_name: str, tag: str, scale: str, zero: str) -> None:
        """``Q -> DQ`` after the value's producer, read by every reader (a graph output keeps its name)."""
        name, output = site.value.name, site.value.graph_output
        producer = self._producer_node(site.value)
        source = self._rename_output(name) if output else name
        q, dq = _pair(source, name if output else f"{node_name}.dq", node_name, tag, scale, zero)
        self.after.setdefault(self.position[id(producer)] if producer is not None else -1, []).extend([q, dq])
        if not output:
            self.owner.rewire(name, dq.output[0], q, self.graph)
        self.pairs += 1

    def weight(self, site: Site, name: str, amax: np.ndarray) -> None:
        weight = numpy_helper.to_array(self.owner.constant(site.value.name, self)).astype(np.float32)
        axis = weight_axis(site.input_reader, site.index) % weight.ndim
        step = activation_step(amax.reshape(-1), False)
        shape = [1] * weight.ndim
        shape[axis] = -1
        integers = np.clip(np.rint(weight / step.reshape(shape)), -128, 127).astype(np.int8)
        self._add_init(numpy_helper.from_array(integers, f"{name}.int8"))
        self._add_init(numpy_helper.from_array(step.astype(np.float32), f"{name}.step"))
        self._add_init(numpy_helper.from_array(np.zeros(step.shape, np.int8), f"{name}.zero_point"))
        dq = helper.make_node("DequantizeLinear", [f"{name}.int8", f"{name}.step", f"{name}.zero_point"],
                              [f"{name}.dq"], name=f"{name}/DequantizeLinear", axis=axis)  # fmt: skip
        _tag(dq, name)
        self.pairs += 1
        ref = _split(site.input_reader.ref)[1]
        self.before.setdefault(ref, []).append(dq)
        self.nodes[ref].input[site.index] = f"{name}.dq"

    def scale_query(self, nodes: AttentionNodes, position: int, name: str) -> np.float32:
        """``query * factor -> Q·Kᵀ`` instead of ``Q·Kᵀ`` divided or multiplied by the scale (its node, at
        ``position``, left out: its reader reads ``Q·Kᵀ``); returns the factor (float32)."""
        scores, scale = self.nodes[nodes.scores], self.nodes[position]
        data = list(scale.input).index(scores.output[0])
        constant = float(numpy_helper.to_array(self.owner.constant(scale.input[1 - data], self)).reshape(-1)[0])
        factor = np.float32(1.0 / constant if scale.op_type == "Div" else constant)
        self._add_init(numpy_helper.from_array(np.array(factor, np.float32), f"{name}.query_scale"))
        mul = helper.make_node("Mul", [scores.input[0], f"{name}.query_scale"], [f"{name}.query_scaled"],
                               name=f"{name}/query_scale")  # fmt: skip
        self.before.setdefault(nodes.scores, []).append(mul)
        scores.input[0] = mul.output[0]
        reader = next(self.nodes[p] for p in nodes.nodes if scale.output[0] in self.nodes[p].input)
        reader.input[list(reader.input).index(scale.output[0])] = scores.output[0]
        self.removed.add(position)
        return factor

    def _producer_node(self, value: Any) -> Any:
        """The node writing ``value`` (in an op of several nodes, the one among them that writes it)."""
        op = value.producer
        if op is None:
            return None
        ref = _split(op.ref)[1]
        positions = ref.nodes if isinstance(ref, AttentionNodes) else ref if isinstance(ref, tuple) else (ref,)
        return next(self.nodes[p] for p in positions if value.name in self.nodes[p].output)

    def _reader_slots(self, site: Site) -> list[tuple[Any, int]]:
        """``(node, input position)`` where the site's reader reads its value (a SiLU: in its sigmoid and its
        product; an attention: where :meth:`AttentionNodes.reads` says); positions count the node's empty optional
        inputs, which the view leaves out."""
        ref = _split(site.input_reader.ref)[1]
        if isinstance(ref, AttentionNodes):
            return [(self.nodes[position], slot) for position, slot in ref.reads(site.index)]
        if isinstance(ref, tuple):
            nodes = [self.nodes[i] for i in ref]
            return [(node, list(node.input).index(site.value.name)) for node in nodes if site.value.name in node.input]
        node = self.nodes[ref]
        present = [i for i, name in enumerate(node.input) if name]
        return [(node, present[site.index])]

    def _rename_output(self, name: str) -> str:
        """The producer of graph output ``name`` writes ``<name>.float`` instead; the DQ then writes ``name``, which
        its readers keep reading (quantized, as a value-level site says)."""
        renamed = f"{name}.float"
        for node in self.nodes:
            node.output[:] = [renamed if o == name else o for o in node.output]
        return renamed

    def _add_init(self, tensor: TensorProto) -> None:
        self.graph.initializer.append(tensor)
        self.inits[tensor.name] = tensor

    def finish(self) -> None:
        """The graph's nodes with the Q/DQ nodes in place (topological order kept)."""
        ordered = list(self.after.get(-1, []))
        for index, node in enumerate(self.nodes):
            ordered += self.before.get(index, [])
            ordered += [] if index in self.removed else [node]
            ordered += self.after.get(index, [])
        copies = []
        for node in ordered:  # copied out before the repeated field is cleared (it owns the node messages)
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copies.append(copy)
        del self.graph.node[:]
        self.graph.node.extend(copies)


def activation_step(amax: np.ndarray, unsigned: bool) -> np.ndarray:
    """``amax / max_bound`` in float32 as the PyTorch path computes it (a range <= 2**-24: step 1)."""
    amax = np.asarray(amax, np.float32)
    step = quant_step(torch.from_numpy(np.array(amax)), 8, unsigned).numpy()
    return np.where(amax <= _TINY, np.float32(1.0), step).astype(np.float32)


def _pair(source: str, output: str, name: str, tag: str, scale: str, zero: str) -> tuple[Any, Any]:
    q = helper.make_node("QuantizeLinear", [source, scale, zero], [f"{name}.q"], name=f"{name}/QuantizeLinear")
    dq = helper.make_node("DequantizeLinear", [f"{name}.q", scale, zero], [output], name=f"{name}/DequantizeLinear")
    for node in (q, dq):
        _tag(node, tag)
    return q, dq


def _tag(node: Any, quantizer: str) -> None:
    entry = node.metadata_props.add()
    entry.key, entry.value = QUANTIZER_KEY, quantizer
