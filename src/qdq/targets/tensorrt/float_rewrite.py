"""The type rewrite of the low-precision export: each node of a float32 Q/DQ graph gets its final float type.

:class:`TypeRewrite` walks the nodes in order (a topological order, as ONNX requires) and decides, per node:

* a compute node computes in the low type unless a reason keeps it in FP32 (its float initializers are
  converted once; other inputs of another type get a Cast, one per tensor and type);
* a node with float inputs but no float output (``Greater``, ``Equal``...) reads them all in one type: that of
  its computed inputs when they agree (its constants follow), else float32;
* a QuantizeLinear takes its input in its producer's type, with a scale of that type;
* a DequantizeLinear outputs the type its readers compute in (its scale has that type), and is duplicated
  when its readers compute in two types: no Cast ever stands between a DQ and its reader;
* a Cast to float32 in the graph becomes a Cast to the low type when all its readers compute in it;
* the graph's float outputs get a Cast back to float32 when the edges keep their types;
* control flow (``If``, ``Loop``, ``Scan``) stays float32, branches and bodies as written (the rewrite does not
  enter subgraphs), and so does every main-graph tensor a subgraph reads from the enclosing scope (a branch's
  declared types would contradict a float16 tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.ir_graph import (
    add_const,
    attr,
    const,
    graph_readers,
    holders,
    make_node,
    readers,
    subgraphs,
    tidy,
)
from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_tags import quantizer_names
from qdq.graphs.onnx_types import (
    LOW_PRECISION,
    TensorTypes,
    default_opset,
    float_slots,
    input_types,
    numpy_float_type,
    type_name,
)

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["TypeRewrite"]

_FLOAT32 = 1


class TypeRewrite:
    """One pass over the nodes in order, giving each float tensor its final type and adding Casts.

    Args:
        model: the float32 graph (an ``onnx.ModelProto``, rewritten in place by :meth:`run`: one onnx_ir round
            trip), its steps already rounded and its weights folded (:mod:`.float_scales`).
        low: ``TensorProto.FLOAT16`` or ``BFLOAT16``.
        reasons: node name -> why it stays FP32 (:func:`~.float_ranges.keep_fp32_reasons`); :meth:`run` adds control
            flow, the nodes whose output a subgraph reads and those reading an unrepresentable quantizer.
        fp32_sites: quantizers whose steps have no low-precision value: their Q/DQ stay FP32.
    """

    graph: ir.Graph  # the model's graph as onnx_ir, during :meth:`run`
    _at: ir.Node  # the node being rewritten: the Casts it needs go before it

    def __init__(self, model: Any, low: int, reasons: dict[str, str], fp32_sites: set[str]) -> None:
        self.model, self.low = model, low
        self.reasons = dict(reasons)
        self.fp32_sites = fp32_sites
        self.types = TensorTypes.of(model)  # tensor name -> type as exported
        self.opset = default_opset(model)
        self.dtype: dict[ir.Value, int] = {}
        self.variants: dict[tuple[ir.Value, int], ir.Value] = {}  # (value, type) -> a value of that type, same values
        self.converted = self.casts = 0
        self._precisions: dict[ir.Node, int | None] = {}
        self.outer_reads: set[ir.Value] = set()  # main-graph values a subgraph reads from the enclosing scope
        self._holder: dict[int, ir.Node] = {}  # a subgraph's id -> the main-graph node holding it

    def run(self, keep_io: bool) -> None:
        on_ir(self.model, lambda model: self._run(model, keep_io))
        del self.model.graph.value_info[:]  # the exporter's types are stale

    def _scan(self, graph: ir.Graph) -> None:
        """Control flow and what its subgraphs read from the main graph stay FP32."""
        self._holder = holders(graph)
        self.outer_reads = {v for node in graph for v in node.outputs if any(r.graph is not graph for r in readers(v))}
        for node in graph:
            if subgraphs(node):
                self.reasons.setdefault(node.name or "", f"{node.op_type}: its subgraphs compute in float32 as written")
            elif any(v in self.outer_reads for v in node.outputs):
                self.reasons.setdefault(node.name or "", "its output is read inside a subgraph, which stays float32")

    def _readers(self, value: ir.Value) -> list[ir.Node]:
        """The main-graph nodes reading ``value`` (a read inside a subgraph is its control-flow node's)."""
        return graph_readers(value, self._holder)

    # --- precision of each node
    def precision(self, node: ir.Node) -> int | None:
        """The float type ``node`` computes in after conversion; None for a node without float outputs."""
        if node not in self._precisions:
            self._precisions[node] = self._decide(node)
        return self._precisions[node]

    def _decide(self, node: ir.Node) -> int | None:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant"):
            return None
        if node.op_type == "Cast":
            return None if attr(node, "to", 0) != _FLOAT32 else self._cast_target(node)
        slots = float_slots(node, self.opset)
        if not slots.outputs or all(self._type(node.outputs[i]) != _FLOAT32 for i in slots.outputs):
            return None
        if (node.name or "") in self.reasons or self._reads_fp32_site(node):
            return _FLOAT32
        return self.low

    def _reads_fp32_site(self, node: ir.Node) -> bool:
        for producer in [v.producer() for v in node.inputs if v is not None]:
            owner = ",".join(quantizer_names(producer)) if producer is not None else ""
            if producer is not None and producer.op_type == "DequantizeLinear" and owner in self.fp32_sites:
                why = f"reads quantizer {owner}, whose step has no {type_name(self.low)} value"
                self.reasons[node.name or ""] = why
                return True
        return False

    def _cast_target(self, node: ir.Node) -> int:
        wanted = {self.precision(r) for r in self._readers(node.outputs[0])} - {None}
        return self.low if wanted == {self.low} and not node.outputs[0].is_graph_output() else _FLOAT32

    # --- values of the right type
    def _type(self, value: ir.Value) -> int | None:
        """``value``'s type as exported (None: unknown, or a value the rewrite added)."""
        return self.types.get(value.name or "")

    def _current(self, value: ir.Value) -> int | None:
        return self.dtype.get(value, self._type(value))

    def as_type(self, value: ir.Value, wanted: int) -> ir.Value:
        """``value`` in type ``wanted``: itself, a converted constant, or a Cast before the node being rewritten."""
        if (value, wanted) in self.variants:
            return self.variants[(value, wanted)]
        constant = const(value) if self._type(value) == _FLOAT32 else None
        if constant is not None:
            return self._constant(value, constant, wanted)
        current = self._current(value)
        if current is None or current == wanted or current not in (_FLOAT32, self.low):
            return value
        cast = make_node(self.graph, "Cast", [value], f"{value.name}_{type_name(wanted)}", to=wanted)
        cast.name = f"{cast.outputs[0].name}/Cast"
        self.graph.insert_before(self._at, cast)
        self.casts += 1
        self.dtype[cast.outputs[0]] = wanted
        self.variants[(value, wanted)] = cast.outputs[0]
        return cast.outputs[0]

    def _constant(self, value: ir.Value, values: np.ndarray, wanted: int) -> ir.Value:
        if wanted == _FLOAT32:
            return value
        converted = add_const(self.graph, f"{value.name}_{type_name(wanted)}", _to_type(values, wanted))
        self.variants[(value, wanted)] = converted
        return converted

    # --- the pass
    def _run(self, model: ir.Model, keep_io: bool) -> None:
        import onnx_ir as ir

        self.graph = model.graph
        self._scan(model.graph)
        for value in model.graph.inputs:
            if value.dtype == _FLOAT32 and not keep_io:
                value.type = ir.TensorType(ir.DataType(self.low))
            self.dtype[value] = int(value.dtype or 0)
        for node in list(model.graph):
            self._at = node
            handler = {"QuantizeLinear": self._quantize, "DequantizeLinear": self._dequantize}.get(node.op_type)
            (handler or self._compute)(node)
        self._finish_outputs(keep_io)
        tidy(model)

    def _quantize(self, node: ir.Node) -> None:
        x, scale = node.inputs[0], node.inputs[1]
        owner = ",".join(quantizer_names(node))
        wanted = _FLOAT32 if owner in self.fp32_sites or x is None else self.dtype.get(x, self._type(x) or _FLOAT32)
        if x is not None:
            node.replace_input_with(0, self.as_type(x, wanted))
        node.replace_input_with(1, self._scale(scale, wanted))

    def _scale(self, value: ir.Value | None, wanted: int) -> ir.Value | None:
        values = const(value)
        return value if value is None or values is None else self._constant(value, values.astype(np.float32), wanted)

    def _dequantize(self, node: ir.Node) -> None:
        out, scale, last = node.outputs[0], node.inputs[1], node
        owner = ",".join(quantizer_names(node))
        wanted = [self._wanted_by(r) for r in self._readers(out)]
        kinds = {_FLOAT32} if owner in self.fp32_sites else ({w for w in wanted if w is not None} or {self.low})
        if out.is_graph_output():
            kinds.add(self.low if owner not in self.fp32_sites else _FLOAT32)
        if out in self.outer_reads:  # the value's own name stays float32 for the subgraph
            kinds.add(_FLOAT32)
        first = _FLOAT32 if out in self.outer_reads else self.low if self.low in kinds else _FLOAT32
        for kind in sorted(kinds, key=lambda k: k != first):
            copy = node
            if kind != first:  # a copy of the DQ writing a value of its own, after the last one
                copy = make_node(self.graph, node.op_type, list(node.inputs), f"{out.name}_{type_name(kind)}",
                                 name=f"{node.name}_{type_name(kind)}", **node.attributes)  # fmt: skip
                copy.metadata_props.update(node.metadata_props)
                copy.doc_string = node.doc_string
                self.graph.insert_after(last, copy)
                self.variants[(out, kind)], last = copy.outputs[0], copy
            copy.replace_input_with(1, self._scale(scale, kind))
            self.dtype[copy.outputs[0]] = kind

    def _wanted_by(self, reader: ir.Node) -> int | None:
        precision = self.precision(reader)
        if precision is not None:
            return precision
        if reader.op_type == "QuantizeLinear":
            return None
        slots = float_slots(reader, self.opset)
        return None if slots.allows(self.low) else _FLOAT32

    def _compute(self, node: ir.Node) -> None:
        import onnx_ir as ir

        precision = self.precision(node)
        slots = float_slots(node, self.opset)
        options = input_types(node, self.opset)
        shared = self._shared_input_type(node, slots) if precision is None else None
        for i, value in enumerate(node.inputs):
            if value is None:
                continue
            if precision is not None and i in slots.inputs:
                node.replace_input_with(i, self.as_type(value, precision))
            elif shared is not None and i in slots.inputs:
                node.replace_input_with(i, self.as_type(value, shared))
            elif precision == self.low and self.low in options[i] and const(value) is not None:
                node.replace_input_with(i, self.as_type(value, self.low))  # a constant of another parameter (BN's)
            elif i in slots.inputs and slots.allows(self._current(value) or 0):
                continue
            elif self._type(value) is not None:
                node.replace_input_with(i, self.as_type(value, self._type(value) or _FLOAT32))
        if node.op_type == "Cast" and precision is not None:
            node.attributes["to"] = ir.AttrInt64("to", precision)
        if node.op_type == "ConstantOfShape" and precision is not None:
            _retype_fill(node, precision)
        for i, value in enumerate(node.outputs):
            original = self._type(value)
            self.dtype[value] = precision if precision is not None and i in slots.outputs else (original or 0)
        if node.op_type == "Cast" and precision is not None:
            self.dtype[node.outputs[0]] = precision
        self.converted += precision == self.low and node.op_type != "Cast"

    def _shared_input_type(self, node: ir.Node, slots: Any) -> int | None:
        """The one float type the inputs of a node without float outputs read (a comparison: ``Greater(x, 0.5)``
        reads ``x`` in float16 and its constant must follow): the type of its computed inputs when they agree, else
        float32; None for a node with fewer than two such inputs."""
        if len(slots.inputs) < 2:
            return None
        values = [node.inputs[i] for i in slots.inputs if i < len(node.inputs)]
        computed = {self._current(v) for v in values if v is not None and const(v) is None}
        return computed.pop() if len(computed) == 1 and computed <= {_FLOAT32, self.low} else _FLOAT32

    def _finish_outputs(self, keep_io: bool) -> None:
        import onnx_ir as ir

        for i, value in enumerate(self.graph.outputs):
            current = self.dtype.get(value)
            if value.dtype != _FLOAT32 or current in (None, _FLOAT32):
                continue
            if not keep_io:
                value.type = ir.TensorType(ir.DataType(current))
                continue
            cast = make_node(self.graph, "Cast", [value], f"{value.name}_{type_name(current)}",
                             name=f"{value.name}/Cast", to=_FLOAT32)  # fmt: skip
            output = cast.outputs[0]  # the graph's output as declared: its name, float32, shape and annotations
            value.name, output.name = output.name, value.name
            output.type, output.shape = ir.TensorType(ir.DataType.FLOAT), value.shape
            output.doc_string = value.doc_string
            output.metadata_props.update(value.metadata_props)
            self.graph.outputs[i] = output
            self.graph.append(cast)
            self.casts += 1


def _retype_fill(node: ir.Node, elem_type: int) -> None:
    """A ``ConstantOfShape``'s fill value in ``elem_type`` (its output type is its ``value``'s type)."""
    import onnx_ir as ir

    fill = node.attributes.get("value")
    if fill is not None and fill.as_tensor().dtype != ir.DataType.FLOAT:
        return
    values = fill.as_tensor().numpy() if fill is not None else np.zeros(1, np.float32)  # none: float32 zeros (spec)
    name = fill.as_tensor().name if fill is not None else None
    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(_to_type(values, elem_type), name=name))


def _to_type(values: np.ndarray, elem_type: int) -> np.ndarray:
    kind = numpy_float_type("float16" if elem_type == LOW_PRECISION["float16"] else "bfloat16")
    return values.astype(np.float32).astype(kind)
