"""The ONNX front end's edits: each quantizer of the view written as Q/DQ nodes with its range.

Every quantizer becomes one step (``amax / 127``, or ``/ 255`` unsigned: :func:`qdq.tensor_quant.quant_step`, the
PyTorch path's arithmetic) and one zero point (0, int8 or uint8), shared by all of its sites:

* a value quantized for every reader: ``Q -> DQ`` after its producer, every reader reading the DQ (a model output
  keeps its name: the DQ writes it);
* a value quantized as one op reads it: ``Q -> DQ`` before that op, read by it alone (one pair for the readers
  that quantize the same value on the same grid: the same step and zero point);
* a weight: its integers stored as an int8 initializer, per channel, read through a ``DequantizeLinear``.

Each Q and DQ node carries its quantizer's name (node metadata ``qdq.quantizer``, :mod:`qdq.graphs.onnx_tags`), as
the PyTorch export writes them, so the targets' rewrites and :func:`~qdq.graphs.onnx_tags.qdq_sites` read both
alike. New nodes keep the graph's topological order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.onnx_tags import QUANTIZER_KEY
from qdq.graphs.view import GraphView, Quantizer, Site
from qdq.onnx_in.view import weight_axis
from qdq.tensor_quant import quant_step

__all__ = ["quantizer_names", "write_qdq"]

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
    writer = _Writer(model, view)
    names = quantizer_names(view)
    for quantizer in view.quantizers():
        writer.write(quantizer, names[id(quantizer)], np.asarray(ranges[id(quantizer)], np.float32))
    writer.finish()
    return writer.pairs


class _Writer:
    def __init__(self, model: onnx.ModelProto, view: GraphView) -> None:
        self.model, self.view, self.graph = model, view, model.graph
        self.nodes = list(model.graph.node)  # an op's ref is its position here (the view's model, or a copy)
        self.position = {id(node): index for index, node in enumerate(self.nodes)}  # stable: the list holds them
        self.before: dict[int, list[Any]] = {}  # node position -> Q/DQ nodes to put before it
        self.after: dict[int, list[Any]] = {}  # node position -> Q/DQ nodes to put after it (-1: the graph's start)
        self.inits = {t.name: t for t in self.graph.initializer}
        self.shared: dict[tuple[str, bytes, int], tuple[str, tuple[Any, Any], int]] = {}  # grid -> its pair
        self.pairs = 0

    def write(self, quantizer: Quantizer, name: str, amax: np.ndarray) -> None:
        for number, site in enumerate(quantizer.sites):
            suffix = f"_{number}" if number else ""
            if quantizer.per_channel and site.reader is not None:
                self._weight(site, f"{name}{suffix}", amax)
            else:
                scale, zero = self._grid(name, amax, quantizer.unsigned)
                self._activation(site, f"{name}{suffix}", name, scale, zero)

    def _grid(self, name: str, amax: np.ndarray, unsigned: bool) -> tuple[str, str]:
        """The step and zero-point initializers of an activation quantizer (made once, shared by its sites)."""
        scale, zero = f"{name}.step", f"{name}.zero_point"
        if scale not in self.inits:
            step = _step(amax, unsigned)
            self._add_init(numpy_helper.from_array(step.astype(np.float32), scale))
            self._add_init(numpy_helper.from_array(np.zeros((), np.uint8 if unsigned else np.int8), zero))
        return scale, zero

    def _activation(self, site: Site, node_name: str, tag: str, scale: str, zero: str) -> None:
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
        """``Q -> DQ`` after the value's producer, read by every reader (a model output keeps its name)."""
        name, output = site.value.name, site.value.graph_output
        source = self._rename_output(name) if output else name
        q, dq = _pair(source, name if output else f"{node_name}.dq", node_name, tag, scale, zero)
        producer = self._producer_node(site.value)
        self.after.setdefault(self.position[id(producer)] if producer is not None else -1, []).extend([q, dq])
        if not output:
            self._rewire_all(name, dq.output[0], skip=q)
        self.pairs += 1

    def _weight(self, site: Site, name: str, amax: np.ndarray) -> None:
        weight = numpy_helper.to_array(self.inits[site.value.name]).astype(np.float32)
        axis = weight_axis(site.input_reader, site.index) % weight.ndim
        step = _step(amax.reshape(-1), False)
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
        reader = self.nodes[site.input_reader.ref]
        self.before.setdefault(site.input_reader.ref, []).append(dq)
        reader.input[site.index] = f"{name}.dq"

    def _producer_node(self, value: Any) -> Any:
        op = value.producer
        if op is None:
            return None
        if isinstance(op.ref, tuple):  # a SiLU: its sigmoid (the inner value) or its product
            return self.nodes[op.ref[0] if value is op.inner.get("sigmoid") else op.ref[1]]
        return self.nodes[op.ref]

    def _reader_slots(self, site: Site) -> list[tuple[Any, int]]:
        """``(node, input position)`` where the site's reader reads its value (a SiLU: in its sigmoid and its
        product); positions count the node's empty optional inputs, which the view leaves out."""
        ref = site.input_reader.ref
        if isinstance(ref, tuple):
            nodes = [self.nodes[i] for i in ref]
            return [(node, list(node.input).index(site.value.name)) for node in nodes if site.value.name in node.input]
        node = self.nodes[ref]
        present = [i for i, name in enumerate(node.input) if name]
        return [(node, present[site.index])]

    def _rewire_all(self, old: str, new: str, skip: Any) -> None:
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new
        for nodes in (*self.before.values(), *self.after.values()):
            for node in nodes:
                if node is not skip and node.op_type == "QuantizeLinear" and node.input[0] == old:
                    node.input[0] = new  # a site-level Q written earlier reads the value-level DQ: Q(DQ(Q(x)))

    def _rename_output(self, name: str) -> str:
        """The producer of model output ``name`` writes ``<name>.float`` instead; the DQ then writes ``name``, which
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
            ordered.append(node)
            ordered += self.after.get(index, [])
        copies = []
        for node in ordered:  # copied out before the repeated field is cleared (it owns the node messages)
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copies.append(copy)
        del self.graph.node[:]
        self.graph.node.extend(copies)


def _step(amax: np.ndarray, unsigned: bool) -> np.ndarray:
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
