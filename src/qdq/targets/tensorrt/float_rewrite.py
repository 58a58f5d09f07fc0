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

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute, subgraphs, tidy
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

__all__ = ["TypeRewrite"]

_FLOAT32 = 1


class TypeRewrite:
    """One pass over the nodes in order, giving each float tensor its final type and adding Casts.

    Args:
        model: the float32 graph, its steps already rounded and its weights folded (:mod:`.float_scales`).
        low: ``TensorProto.FLOAT16`` or ``BFLOAT16``.
        reasons: node name -> why it stays FP32 (:func:`~.float_ranges.keep_fp32_reasons`); nodes reading an
            unrepresentable quantizer are added with their reason.
        fp32_sites: quantizers whose steps have no low-precision value: their Q/DQ stay FP32.
    """

    def __init__(self, model: Any, low: int, reasons: dict[str, str], fp32_sites: set[str]) -> None:
        self.model, self.low = model, low
        self.reasons = dict(reasons)
        self.fp32_sites = fp32_sites
        self.index = GraphIndex(model)
        self.types = TensorTypes.of(model)
        self.opset = default_opset(model)
        self.dtype: dict[str, int] = {}
        self.variants: dict[tuple[str, int], str] = {}  # (tensor, type) -> a tensor of that type, same values
        self.nodes: list[Any] = []
        self.converted = self.casts = 0
        self._precisions: dict[int, int | None] = {}
        # main-graph tensors a subgraph reads from the enclosing scope (the index lists them as its node's reads)
        self.outer_reads = {name for name, readers in self.index.consumers.items()
                            if any(subgraphs(r) and name not in r.input for r in readers)}  # fmt: skip
        for node in model.graph.node:
            if subgraphs(node):
                self.reasons.setdefault(node.name, f"{node.op_type}: its subgraphs compute in float32 as written")
            elif any(name in self.outer_reads for name in node.output):
                self.reasons.setdefault(node.name, "its output is read inside a subgraph, which stays float32")

    # --- precision of each node
    def precision(self, node: Any) -> int | None:
        """The float type ``node`` computes in after conversion; None for a node without float outputs."""
        if id(node) not in self._precisions:
            self._precisions[id(node)] = self._decide(node)
        return self._precisions[id(node)]

    def _decide(self, node: Any) -> int | None:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant"):
            return None
        if node.op_type == "Cast":
            return None if attribute(node, "to", 0) != _FLOAT32 else self._cast_target(node)
        slots = float_slots(node, self.opset)
        if not slots.outputs or all(self.types.get(node.output[i]) != _FLOAT32 for i in slots.outputs):
            return None
        if node.name in self.reasons or self._reads_fp32_site(node):
            return _FLOAT32
        return self.low

    def _reads_fp32_site(self, node: Any) -> bool:
        for name in node.input:
            producer = self.index.producer.get(name)
            owner = ",".join(quantizer_names(producer)) if producer is not None else ""
            if producer is not None and producer.op_type == "DequantizeLinear" and owner in self.fp32_sites:
                self.reasons[node.name] = f"reads quantizer {owner}, whose step has no {type_name(self.low)} value"
                return True
        return False

    def _cast_target(self, node: Any) -> int:
        readers = self.index.consumers.get(node.output[0], [])
        wanted = {self.precision(r) for r in readers} - {None}
        return self.low if wanted == {self.low} and node.output[0] not in self.index.outputs else _FLOAT32

    # --- tensors of the right type
    def as_type(self, tensor: str, wanted: int) -> str:
        if not tensor or (tensor, wanted) in self.variants:
            return self.variants.get((tensor, wanted), tensor)
        constant = self.index.array(tensor) if self.types.get(tensor) == _FLOAT32 else None
        if constant is not None:
            return self._constant(tensor, constant, wanted)
        current = self.dtype.get(tensor, self.types.get(tensor))
        if current is None or current == wanted or current not in (_FLOAT32, self.low):
            return tensor
        from onnx import helper

        name = self.index.unique(f"{tensor}_{type_name(wanted)}")
        self.nodes.append(helper.make_node("Cast", [tensor], [name], to=wanted, name=f"{name}/Cast"))
        self.casts += 1
        self.dtype[name] = wanted
        self.variants[(tensor, wanted)] = name
        return name

    def _constant(self, tensor: str, values: np.ndarray, wanted: int) -> str:
        if wanted == _FLOAT32:
            return tensor
        name = self.index.add_const(f"{tensor}_{type_name(wanted)}", _to_type(values, wanted))
        self.variants[(tensor, wanted)] = name
        return name

    # --- the pass
    def run(self, keep_io: bool) -> None:
        for value in self.model.graph.input:
            if value.type.tensor_type.elem_type == _FLOAT32 and not keep_io:
                value.type.tensor_type.elem_type = self.low
            self.dtype[value.name] = value.type.tensor_type.elem_type
        for node in list(self.model.graph.node):
            handler = {"QuantizeLinear": self._quantize, "DequantizeLinear": self._dequantize}.get(node.op_type)
            (handler or self._compute)(node)
        self._finish_outputs(keep_io)
        del self.model.graph.node[:]
        self.model.graph.node.extend(self.nodes)
        del self.model.graph.value_info[:]
        tidy(self.model)

    def _quantize(self, node: Any) -> None:
        x = node.input[0]
        owner = ",".join(quantizer_names(node))
        wanted = _FLOAT32 if owner in self.fp32_sites else self.dtype.get(x, self.types.get(x) or _FLOAT32)
        node.input[0] = self.as_type(x, wanted)
        node.input[1] = self._scale(node.input[1], wanted)
        self.nodes.append(node)

    def _scale(self, name: str, wanted: int) -> str:
        values = self.index.array(name)
        return name if values is None else self._constant(name, values.astype(np.float32), wanted)

    def _dequantize(self, node: Any) -> None:
        import onnx

        owner = ",".join(quantizer_names(node))
        wanted = [self._wanted_by(r, node.output[0]) for r in self.index.consumers.get(node.output[0], [])]
        kinds = {_FLOAT32} if owner in self.fp32_sites else ({w for w in wanted if w is not None} or {self.low})
        if node.output[0] in self.index.outputs:
            kinds.add(self.low if owner not in self.fp32_sites else _FLOAT32)
        if node.output[0] in self.outer_reads:  # the tensor's own name stays float32 for the subgraph
            kinds.add(_FLOAT32)
        first = _FLOAT32 if node.output[0] in self.outer_reads else self.low if self.low in kinds else _FLOAT32
        scale = node.input[1]
        for kind in sorted(kinds, key=lambda k: k != first):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[1] = self._scale(scale, kind)
            if kind != first:
                copy.name = f"{node.name}_{type_name(kind)}"
                copy.output[0] = self.index.unique(f"{node.output[0]}_{type_name(kind)}")
                self.variants[(node.output[0], kind)] = copy.output[0]
            self.dtype[copy.output[0]] = kind
            self.nodes.append(copy)

    def _wanted_by(self, reader: Any, tensor: str) -> int | None:
        precision = self.precision(reader)
        if precision is not None:
            return precision
        if reader.op_type == "QuantizeLinear":
            return None
        slots = float_slots(reader, self.opset)
        return None if slots.allows(self.low) else _FLOAT32

    def _compute(self, node: Any) -> None:
        precision = self.precision(node)
        slots = float_slots(node, self.opset)
        options = input_types(node, self.opset)
        shared = self._shared_input_type(node, slots) if precision is None else None
        for i, name in enumerate(node.input):
            if not name:
                continue
            if precision is not None and i in slots.inputs:
                node.input[i] = self.as_type(name, precision)
            elif shared is not None and i in slots.inputs:
                node.input[i] = self.as_type(name, shared)
            elif precision == self.low and self.low in options[i] and self.index.array(name) is not None:
                node.input[i] = self.as_type(name, self.low)  # a constant of another parameter (BN's scale...)
            elif i in slots.inputs and slots.allows(self.dtype.get(name, self.types.get(name) or 0)):
                continue
            elif self.types.get(name) is not None:
                node.input[i] = self.as_type(name, self.types.get(name) or _FLOAT32)
        if node.op_type == "Cast" and precision is not None:
            for attr in node.attribute:
                if attr.name == "to":
                    attr.i = precision
        if node.op_type == "ConstantOfShape" and precision is not None:
            _retype_fill(node, precision)
        for i, name in enumerate(node.output):
            original = self.types.get(name)
            self.dtype[name] = precision if precision is not None and i in slots.outputs else (original or 0)
        if node.op_type == "Cast" and precision is not None:
            self.dtype[node.output[0]] = precision
        self.converted += precision == self.low and node.op_type != "Cast"
        self.nodes.append(node)

    def _shared_input_type(self, node: Any, slots: Any) -> int | None:
        """The one float type the inputs of a node without float outputs read (a comparison: ``Greater(x, 0.5)``
        reads ``x`` in float16 and its constant must follow): the type of its computed inputs when they agree, else
        float32; None for a node with fewer than two such inputs."""
        if len(slots.inputs) < 2:
            return None
        computed = {self.dtype.get(node.input[i], self.types.get(node.input[i])) for i in slots.inputs
                    if i < len(node.input) and node.input[i] and self.index.array(node.input[i]) is None}  # fmt: skip
        return computed.pop() if len(computed) == 1 and computed <= {_FLOAT32, self.low} else _FLOAT32

    def _finish_outputs(self, keep_io: bool) -> None:
        from onnx import helper

        for value in self.model.graph.output:
            current = self.dtype.get(value.name)
            if value.type.tensor_type.elem_type != _FLOAT32 or current in (None, _FLOAT32):
                continue
            if not keep_io:
                value.type.tensor_type.elem_type = current
                continue
            inner = self.index.unique(f"{value.name}_{type_name(current)}")
            for node in self.nodes:
                node.output[:] = [inner if o == value.name else o for o in node.output]
                node.input[:] = [inner if i == value.name else i for i in node.input]
            self.nodes.append(helper.make_node("Cast", [inner], [value.name], to=_FLOAT32, name=f"{value.name}/Cast"))
            self.casts += 1


def _retype_fill(node: Any, elem_type: int) -> None:
    """A ``ConstantOfShape``'s fill value in ``elem_type`` (its output type is its ``value``'s type)."""
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value" and attr.t.data_type == _FLOAT32:
            attr.t.CopyFrom(numpy_helper.from_array(_to_type(numpy_helper.to_array(attr.t), elem_type), attr.t.name))
            return
    if not any(attr.name == "value" for attr in node.attribute):  # no value: float32 zeros by the ONNX spec
        from onnx import helper

        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(_to_type(np.zeros(1, np.float32),
                                                                                              elem_type))))


def _to_type(values: np.ndarray, elem_type: int) -> np.ndarray:
    kind = numpy_float_type("float16" if elem_type == LOW_PRECISION["float16"] else "bfloat16")
    return values.astype(np.float32).astype(kind)
