"""What ONNX Runtime's CPU provider made of a Q/DQ graph, read from its optimized graph.

ORT replaces a group ``DequantizeLinear -> op -> QuantizeLinear`` by an int8 kernel (QLinearConv,
QGemm, QLinearAdd...) when every data input of the op is dequantized and its output is quantized. A
Conv without a QuantizeLinear on its output stays a float Conv between Q/DQ conversions. This module
compares the source graph with the optimized one saved by ORT (``optimized_model_filepath``) and
says, per weighted op, whether it runs as an int8 kernel, and per leftover Q/DQ node, why it stayed.
Which groups ORT fuses is recorded as the :class:`~qdq.targets.FusionFacts` of the target made for ONNX Runtime
(:attr:`qdq.targets.Target.fusion` of the ``"native"`` target, the ``"onnxruntime"`` one), which placement and the
export read too. A weighted op left in a float kernel is a :class:`~qdq.runtime.coverage.FloatLayer` with its
reason (:attr:`FusionReport.float_layers`: ONNX Runtime's int8 coverage).

:func:`analyse_fusion` works on two ``onnx.ModelProto``; :func:`qdq.runtime.ort.fusion_report` makes
the optimized graph with an ONNX Runtime session and calls it. The subgraphs of control flow (an ``If``'s
branches, a ``Loop``'s body) are read too, each as a graph of its own: their kernels are counted with the main
graph's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qdq.errors import QdqConfigError
from qdq.graphs.ir_graph import attr, const, graph_readers, graphs_of, holders, name_of, readers_through, subgraphs
from qdq.graphs.onnx import all_nodes
from qdq.runtime._text import markdown_table
from qdq.runtime.coverage import Coverage, FloatLayer
from qdq.runtime_registry import ORT_RUNTIME
from qdq.targets import FusionFacts
from qdq.targets.registry import native_fact

if TYPE_CHECKING:
    import numpy as np
    import onnx
    import onnx_ir as ir

__all__ = ["WEIGHTED_OPS", "FusionReport", "UnfusedQdq", "analyse_fusion", "ort_fusion_facts"]

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
"""Ops of the source graph counted as weighted (the ones quantization is meant to speed up)."""

_Q, _DQ = "QuantizeLinear", "DequantizeLinear"
#: ops a sub-8-bit quantizer's export clamps with before its 8-bit QuantizeLinear (``qdq.export.mode``)
_CLAMPS = ("Clip", "Min", "Max")


def ort_fusion_facts() -> FusionFacts:
    """The fusion facts of the first registered target made for ONNX Runtime (``"native"``) that records any.

    Raises:
        QdqConfigError: no registered target made for ONNX Runtime records fusion facts.
    """
    found = native_fact(ORT_RUNTIME, lambda target: target.fusion)
    if found is None:
        raise QdqConfigError("no registered target made for ONNX Runtime records its fusion facts (Target.fusion).")
    return found


@dataclass(frozen=True)
class UnfusedQdq:
    """A QuantizeLinear or DequantizeLinear left in the optimized graph, and why.

    ``boundary`` is True for the conversions expected at the model's edges: a Q on a graph input,
    a DQ producing a graph output. ``feeds_int8`` is True for a Q whose readers (through layout ops and ops
    that move int8 data) are all int8 kernels: it quantizes an activation for them, which an int8 model must
    do somewhere (ORT's dynamic quantizer does it inside ``DynamicQuantizeMatMul``).
    """

    name: str
    op_type: str
    tensor: str
    reason: str
    boundary: bool = False
    feeds_int8: bool = False


@dataclass(frozen=True)
class FusionReport:
    """Op types of ORT's optimized graph against the source graph, and the Q/DQ left unfused.

    Op counts are keyed ``"domain:op_type"`` with ``ai.onnx`` for the default domain; ``facts`` are the
    fusion facts the report was read with (:func:`ort_fusion_facts`); ``float_layers`` the weighted ops of the
    optimized graph left in float kernels, each with the reason.
    """

    model: str
    optimization_level: str
    source_ops: dict[str, int]
    optimized_ops: dict[str, int]
    unfused: tuple[UnfusedQdq, ...]
    facts: FusionFacts = field(repr=False, compare=False)
    float_layers: tuple[FloatLayer, ...] = ()

    def count(self, op_type: str) -> int:
        """Number of ``op_type`` nodes in the optimized graph, over all domains."""
        return sum(n for key, n in self.optimized_ops.items() if key.rpartition(":")[2] == op_type)

    @property
    def source_weighted(self) -> dict[str, int]:
        """Weighted ops of the source graph (Conv, ConvTranspose, Gemm, MatMul) by type."""
        return {op: self.source_ops[op] for op in WEIGHTED_OPS if self.source_ops.get(op)}

    @property
    def int8_kernels(self) -> dict[str, int]:
        """Integer compute kernels of the optimized graph (QLinearConv, QGemm...) by ``domain:op``."""
        return {k: n for k, n in self.optimized_ops.items() if k.rpartition(":")[2] in self.facts.int8_kernels}

    @property
    def float_kernels(self) -> dict[str, int]:
        """Float Conv/Gemm/MatMul kernels of the optimized graph by ``domain:op``."""
        return {k: n for k, n in self.optimized_ops.items() if k.rpartition(":")[2] in self.facts.float_kernels}

    @property
    def n_int8(self) -> int:
        """How many weighted ops run as int8 kernels."""
        return sum(self.int8_kernels.values())

    @property
    def n_float(self) -> int:
        """How many weighted ops run as float kernels."""
        return sum(self.float_kernels.values())

    @property
    def problems(self) -> tuple[UnfusedQdq, ...]:
        """Leftover Q/DQ that cost time: those not at the model's boundary."""
        return tuple(u for u in self.unfused if not u.boundary)

    @property
    def idle(self) -> tuple[UnfusedQdq, ...]:
        """Leftover Q/DQ with no int8 kernel behind them (a DQ read by a float op, a Q not feeding int8
        kernels only): pure conversion cost."""
        return tuple(u for u in self.problems if not u.feeds_int8)

    def reasons(self) -> dict[str, int]:
        """How many leftover Q/DQ nodes each reason explains."""
        return dict(Counter(u.reason for u in self.unfused))

    def coverage(self) -> Coverage:
        """ONNX Runtime's int8 coverage of the model: its weighted ops in int8 kernels, those in float kernels with
        the reason, and the Q/DQ conversions left away from the model's boundary as the float work between."""
        between = "QuantizeLinear/DequantizeLinear conversions left between the kernels"
        return Coverage(runtime=ORT_RUNTIME.name, model=self.model, int8=self.n_int8, float_layers=self.float_layers,
                        float_between=len(self.problems), float_between_what=between)  # fmt: skip

    def to_markdown(self) -> str:
        """The report as Markdown: a summary line, a kernel table and a table of unfused Q/DQ."""
        source = ", ".join(f"{n} {op}" for op, n in self.source_weighted.items()) or "no weighted ops"
        lines = [
            f"ONNX Runtime fusion report: {self.model} (optimization level {self.optimization_level})",
            "",
            f"source graph: {source}; {self.source_ops.get(_Q, 0)} QuantizeLinear, "
            f"{self.source_ops.get(_DQ, 0)} DequantizeLinear",
            f"optimized graph: {self.n_int8} weighted ops in int8 kernels, {self.n_float} in float kernels; "
            f"{self.count(_Q)} QuantizeLinear and {self.count(_DQ)} DequantizeLinear left "
            f"({len(self.problems)} away from the model's boundary)",
            "",
            markdown_table(["kernel", "count", "precision"], self._kernel_rows()),
        ]
        if self.unfused:
            lines += ["", markdown_table(["op", "reason", "count", "nodes"], self._unfused_rows())]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def _kernel_rows(self) -> list[list[object]]:
        rows: list[list[object]] = [[k, n, "int8"] for k, n in sorted(self.int8_kernels.items())]
        rows += [[k, n, "float"] for k, n in sorted(self.float_kernels.items())]
        return rows or [["(none)", 0, None]]

    def _unfused_rows(self) -> list[list[object]]:
        groups: dict[tuple[str, str], list[str]] = {}
        for u in self.unfused:
            groups.setdefault((u.op_type, u.reason), []).append(u.name or u.tensor)
        rows: list[list[object]] = []
        for (op, reason), names in groups.items():
            shown = ", ".join(names[:3]) + (f", … (+{len(names) - 3})" if len(names) > 3 else "")
            rows.append([op, reason, len(names), shown])
        return rows


def analyse_fusion(
    source: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    model: str = "",
    optimization_level: str = "",
    facts: FusionFacts | None = None,
) -> FusionReport:
    """Compare ORT's ``optimized`` graph of a model with its ``source`` graph (``facts``: ORT's fusion facts,
    by default :func:`ort_fusion_facts`)."""
    import onnx_ir as ir

    facts = facts or ort_fusion_facts()
    graph = ir.serde.deserialize_model(optimized).graph
    explainers = [_Explainer(part, facts) for part in _graphs(graph)]
    unfused = tuple(e.explain(node) for e in explainers for node in e.graph if node.op_type in (_Q, _DQ))
    floats = tuple(
        FloatLayer(node.name or "", node.op_type, e.float_cause(node))
        for e in explainers
        for node in e.graph
        if node.op_type in facts.float_kernels
    )
    return FusionReport(
        model=model,
        optimization_level=optimization_level,
        source_ops=dict(Counter(node.op_type for node in all_nodes(source.graph))),
        optimized_ops=dict(Counter(_key(node) for node in _all_nodes(graph))),
        unfused=unfused,
        facts=facts,
        float_layers=floats,
    )


def _all_nodes(graph: ir.Graph) -> list[ir.Node]:
    """Every node of ``graph`` and of the subgraphs of its control flow, a graph's nodes before its subgraphs'."""
    return [node for part in graphs_of(graph) for node in part]


def _graphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and each subgraph of its control flow (an ``If``'s branches, a ``Loop``'s body), the subgraphs of a
    graph's nodes after those of the graphs before it."""
    return [graph, *(inner for part in graphs_of(graph) for node in part for inner in subgraphs(node))]


def _key(node: ir.Node) -> str:
    return f"{node.domain or 'ai.onnx'}:{node.op_type}"


def _mode(node: ir.Node) -> str:
    """``node``'s ``mode`` attribute (Resize's default, ``nearest``, where it has none)."""
    attr = node.attributes.get("mode")
    value = attr.value if attr is not None else "nearest"
    return value.decode() if isinstance(value, bytes) else str(value)


def _label(node: ir.Node) -> str:
    return f"{node.op_type} (NCHWc)" if node.domain == "com.microsoft.nchwc" else node.op_type


def _fused_activation(node: ir.Node) -> str | None:
    """The activation ORT folded into a FusedConv/FusedGemm after Q/DQ fusion had run, if any."""
    return attr(node, "activation") or None


class _Explainer:
    """Says why a Q/DQ node of one graph of ORT's optimized model was not folded into an int8 kernel.

    The graph is read apart, as a model of its own: what it reads from an enclosing graph is an input there (no
    producer, not a constant), and a read inside one of its nodes' subgraphs is that node's (once per node).
    """

    def __init__(self, graph: ir.Graph, facts: FusionFacts) -> None:
        self.graph = graph
        self.facts = facts
        #: id of each graph nested in ``graph`` -> the node of ``graph`` holding it
        self.holder = holders(graph)

    # -- the graph read apart ----------------------------------------------------------------------

    def producer(self, value: ir.Value | None) -> ir.Node | None:
        """The node of this graph producing ``value`` (None: an input, a constant or an enclosing graph's value)."""
        node = value.producer() if value is not None else None
        return node if node is not None and node.graph is self.graph else None

    def const(self, value: ir.Value | None) -> np.ndarray | None:
        """``value`` as a numpy array when it is an initializer or a ``Constant`` node's output of this graph."""
        return const(value) if value is not None and value.graph is self.graph else None

    def is_output(self, value: ir.Value) -> bool:
        return value.is_graph_output() and value.graph is self.graph

    def readers(self, value: ir.Value) -> list[ir.Node]:
        """The nodes of this graph reading ``value``, once per input slot; a node whose subgraphs read it counts
        once when it does not read it itself."""
        return graph_readers(value, self.holder)

    def single_reader(self, value: ir.Value | None) -> ir.Node | None:
        found = self.readers(value) if value is not None and not self.is_output(value) else []
        return found[0] if len(found) == 1 else None

    def next_ops(self, value: ir.Value, through: frozenset[str] | None = None) -> list[ir.Node | None]:
        """Ops reading ``value``, looking through ``through`` (layout ops by default); ``None`` stands for a graph
        output."""
        skip = self.facts.layout_ops if through is None else through
        return readers_through(value, skip, lambda v: [*([None] if self.is_output(v) else []), *self.readers(v)])

    def prev_op(self, value: ir.Value | None) -> ir.Node | None:
        """The op producing ``value``, looking through layout ops (None: input or constant)."""
        node = self.producer(value)
        while node is not None and node.op_type in self.facts.layout_ops and node.inputs:
            node = self.producer(node.inputs[0])
        return node

    def zero_point_type(self, node: ir.Node) -> str | None:
        """Element type name of a Q/DQ node's zero point ("uint8", "int8"...), if it is a constant."""
        if len(node.inputs) < 3 or node.inputs[2] is None:
            return "uint8" if node.op_type == _Q else None
        value = self.const(node.inputs[2])
        return None if value is None else value.dtype.name

    # -- explaining ---------------------------------------------------------------------------------

    def explain(self, node: ir.Node) -> UnfusedQdq:
        """Say why the Q or DQ ``node`` was not folded into an int8 kernel."""
        if node.op_type == _DQ:
            reason, boundary = self._explain_dq(node)
            tensor = node.inputs[0]
        else:
            reason, boundary = self._explain_q(node)
            tensor = node.outputs[0]
        return UnfusedQdq(node.name or "", node.op_type, name_of(tensor, ""), reason, boundary, self._feeds_int8(node))

    def _feeds_int8(self, node: ir.Node) -> bool:
        if node.op_type != _Q:
            return False
        readers = self.next_ops(node.outputs[0], self.facts.layout_ops | self.facts.int8_data_movers)
        values = [r for r in readers if r is None or r.op_type != "Shape"]  # a Shape reads no value
        return bool(values) and all(r is not None and r.op_type in self.facts.int8_kernels for r in values)

    def _explain_dq(self, node: ir.Node) -> tuple[str, bool]:
        readers = self.next_ops(node.outputs[0])
        ops = [r for r in readers if r is not None]
        if not ops:
            return "dequantizes a graph output (expected at the model's boundary)", True
        reasons = _unique(self.why_float(op) for op in ops)
        return "; ".join(reasons), False

    def _explain_q(self, node: ir.Node) -> tuple[str, bool]:
        source = self.prev_op(node.inputs[0])
        if source is None:
            if self.const(node.inputs[0]) is not None:
                return "quantizes a float constant (weights stored in float)", False
            return "quantizes a graph input (expected at the model's boundary)", True
        if source.op_type == _DQ:
            return "requantizes: a DQ→Q pair with no op between (scale or type change)", False
        return f"quantizes the output of {self.why_float(source)}", False

    def why_float(self, op: ir.Node) -> str:
        """Explain why ``op`` (a reader of a DQ, or the source of a Q) runs in float: ``"float <op>: <cause>"``."""
        return f"float {_label(op)}: {self.float_cause(op)}"

    def float_cause(self, op: ir.Node) -> str:
        """Why ``op`` runs in float (one sentence, without the op's name)."""
        if op.op_type in self.facts.folded_activations:
            return ("ORT folds it into the int8 op before it only when the next Q's zero point is the type's minimum "
                    "(asymmetric activations)")  # fmt: skip
        if op.op_type in self.facts.int8_data_movers:
            mode, data = _mode(op), op.inputs[0]
            if data is not None and not self._is_dequantized(data):
                return f"input {name_of(data, '')} is not dequantized from int8"
            if not self.facts.moves_int8(op.op_type, mode):
                allowed = " or ".join(sorted(self.facts.mover_modes.get(op.op_type, ())))
                return f"ONNX Runtime runs {op.op_type} on int8 data only in {allowed} mode (this one: {mode})"
            return "no Q with the same scale and zero point around it, so it cannot run on int8"
        if not self.facts.fuses(op.op_type):
            return "ONNX Runtime's CPU provider has no int8 kernel for it"
        return self._why_not_fused(op)

    def _why_not_fused(self, op: ir.Node) -> str:
        kernel = self.facts.int8_forms[op.op_type][0]
        data = [x for i in self.facts.dequantized_inputs(op.op_type, len(op.inputs)) if (x := op.inputs[i]) is not None]
        not_dq = [name_of(x, "") for x in data if not self._is_dequantized(x)]
        if not_dq:
            return f"input {', '.join(not_dq)} is not dequantized from int8"
        quantizers = [n for n in self.next_ops(op.outputs[0]) if n is not None and n.op_type == _Q]
        if not quantizers:
            bits = self._clamp_bits(op.outputs[0])
            if bits is not None:
                return f"ONNX Runtime has no int{bits} kernel (its output is clamped to {bits} bits before its Q)"
            return "no QuantizeLinear on its output"
        activation = _fused_activation(op)
        if activation is not None:
            return (
                f"a {activation} sat between the {op.op_type.removeprefix('Fused')} and its QuantizeLinear; ORT "
                "drops it only when the Q's zero point is the type's minimum (asymmetric activations)"
            )
        source = self.prev_op(data[0])  # a DQ: every data input is dequantized (above)
        in_type = self.zero_point_type(source) if source is not None else None
        out_type = self.zero_point_type(quantizers[0])
        if in_type and out_type and in_type != out_type:
            return (f"its input is {in_type} but its output Q is {out_type}; {kernel} needs one type "
                    "(use uint8 activations)")  # fmt: skip
        return f"DQ→{op.op_type}→Q was not fused into {kernel} (unsupported attributes or types)"

    def _clamp_bits(self, value: ir.Value) -> int | None:
        """The bits (< 8) of the grid a chain of clamps (Clip/Min/Max with constant bounds, after at most a constant
        Add, the bias ORT moved out of the op, and a Relu) gives ``value`` before the QuantizeLinear that reads it,
        or None when no such chain leads to a Q."""
        node = self.single_reader(value)
        if node is not None and node.op_type == "Add" and any(self.const(x) is not None for x in node.inputs):
            node = self.single_reader(node.outputs[0])
        if node is not None and node.op_type == "Relu":
            node = self.single_reader(node.outputs[0])
        bounds: dict[str, float] = {}
        while node is not None and node.op_type in _CLAMPS:
            slots = {"Clip": (("low", 1), ("high", 2)), "Max": (("low", 1),), "Min": (("high", 1),)}[node.op_type]
            for bound, index in slots:
                found = self.const(node.inputs[index]) if len(node.inputs) > index else None
                if found is not None and found.size == 1:
                    bounds[bound] = float(found.reshape(()))
            node = self.single_reader(node.outputs[0])
        if node is None or node.op_type != _Q:
            return None
        scale = self.const(node.inputs[1])
        if "high" not in bounds or scale is None or scale.size != 1 or float(scale.reshape(())) <= 0:
            return None
        step = float(scale.reshape(()))
        lowest = -128 if self.zero_point_type(node) == "int8" else 0
        levels = round(bounds["high"] / step) - (round(bounds["low"] / step) if "low" in bounds else lowest) + 1
        bits = math.ceil(math.log2(levels)) if levels > 1 else None
        return bits if bits is not None and bits < 8 else None  # a full-range clamp (Relu6) is not a smaller grid

    def _is_dequantized(self, value: ir.Value) -> bool:
        source = self.prev_op(value)
        return source is not None and source.op_type == _DQ


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
