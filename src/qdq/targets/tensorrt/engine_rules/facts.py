"""What every TensorRT rule reads: the graph's facts (:class:`GraphFacts`), and what a rule is and reports.

The facts hold the model's main graph as ``onnx_ir`` (read, never edited) and its tensor types; the rules walk its
nodes and follow values to their producers and readers. A rule (:class:`Rule`) is a function of a
:class:`GraphFacts` yielding :class:`Violation` s; the rule families (:mod:`.qdq_nodes`, :mod:`.schemes`,
:mod:`.fusion`, :mod:`.strong_typing`) each list theirs in ``RULES``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.ir_graph import attr, const, graph_readers, holders, source
from qdq.graphs.onnx_types import TensorTypes, default_opset

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["DQ", "FP32_NODES_KEY", "LAYOUT", "WEIGHTED", "GraphFacts", "Q", "Rule", "Violation", "brief", "same_values"]

#: Model metadata key: JSON ``{node name: reason}`` of the nodes a low-precision export kept in FP32.
FP32_NODES_KEY = "qdq.float.fp32_nodes"

Q, DQ = "QuantizeLinear", "DequantizeLinear"
#: The ops TensorRT runs in int8 when their data and weight inputs are dequantized.
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Ops TensorRT moves a DequantizeLinear forward across (shape only): a weight may reach its op through them.
LAYOUT = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


@dataclass(frozen=True)
class Violation:
    """One broken rule: the node (or tensor) where it breaks, the rule's id and what is wrong."""

    rule: str
    node: str
    message: str


@dataclass(frozen=True)
class Rule:
    """A registered rule: its id, one line saying what it requires, its source, and its check."""

    id: str
    summary: str
    source: str
    check: Callable[[GraphFacts], Iterable[Violation]] = field(repr=False, compare=False)


@dataclass
class GraphFacts:
    """What every rule reads: the main graph (``onnx_ir``), tensor types, the opset and the FP32 allow-list.

    Types, ranks and shapes are ONNX inference's on the model (:class:`TensorTypes`, by value name).
    """

    graph: ir.Graph
    types: TensorTypes
    opset: int
    fp32_ops: frozenset[str]
    fp32_nodes: dict[str, str]

    @classmethod
    def of(cls, model: Any, fp32_ops: Iterable[str]) -> GraphFacts:
        """The facts of ``model`` (an ``onnx.ModelProto``, read once into onnx_ir, its tensors shared)."""
        import onnx_ir

        meta = {p.key: p.value for p in model.metadata_props}
        try:
            recorded = json.loads(meta.get(FP32_NODES_KEY, "{}"))
        except json.JSONDecodeError:
            recorded = {}
        graph = onnx_ir.serde.deserialize_model(model).graph
        return cls(graph, TensorTypes.of(model), default_opset(model), frozenset(fp32_ops),
                   {str(k): str(v) for k, v in dict(recorded).items()})  # fmt: skip

    @property
    def nodes(self) -> ir.Graph:
        """The main graph, whose iteration gives its nodes in order."""
        return self.graph

    def name(self, node: ir.Node) -> str:
        return node.name or f"{node.op_type}({', '.join(v.name or '' for v in node.outputs)})"

    def type_of(self, value: ir.Value | None) -> int | None:
        """The element type of ``value`` (None when unknown or absent)."""
        return self.types.get(value.name) if value is not None and value.name else None

    def dims(self, value: ir.Value | None) -> list[int | None] | None:
        """The dimensions of ``value`` (None where one is unknown); None without a known shape."""
        return self.types.dims.get(value.name) if value is not None and value.name else None

    def value(self, value: ir.Value | None) -> np.ndarray | None:
        """The array of a constant (an initializer or Constant, possibly behind Identity nodes)."""
        while value is not None and value.const_value is None:
            node = value.producer()
            if node is None or node.op_type != "Identity" or not node.inputs:
                break
            value = node.inputs[0]
        return const(value)

    def scale(self, node: ir.Node) -> np.ndarray | None:
        return self.value(node.inputs[1]) if len(node.inputs) > 1 else None

    def zero_point(self, node: ir.Node) -> np.ndarray | None:
        return self.value(node.inputs[2]) if len(node.inputs) > 2 else None

    def axis(self, node: ir.Node) -> int:
        value = attr(node, "axis", 1)
        dims = self.dims(node.inputs[0])
        return value + len(dims) if value < 0 and dims is not None else value

    def is_constant(self, value: ir.Value | None) -> bool:
        """Is ``value`` known when TensorRT builds the engine (a constant, or computed from constants only)?

        TensorRT folds such subgraphs at build time: a weight clipped by ``Min``/``Max`` before its Q (qdq's
        sub-8-bit weights) is still a weight.
        """
        pending, seen = [value], set()
        while pending:
            current = pending.pop()
            if current in seen or (current is not None and current.const_value is not None):
                continue
            seen.add(current)
            producer = source(current)
            if producer is None or producer.op_type in (Q, DQ):
                return False
            pending.extend(v for v in producer.inputs if v is not None)
        return True

    def q_of(self, dq: ir.Node) -> ir.Node | None:
        producer = source(dq.inputs[0])
        return producer if producer is not None and producer.op_type == Q else None

    def quantized_source(
        self, value: ir.Value | None, through: frozenset[str] = LAYOUT
    ) -> tuple[ir.Node | None, list[ir.Node]]:
        """The DequantizeLinear ``value`` comes from, looking back through ``through``, and the ops passed."""
        passed: list[ir.Node] = []
        node = source(value)
        while node is not None and node.op_type in through and node.inputs:
            passed.append(node)
            node = source(node.inputs[0])
        return (node, passed) if node is not None and node.op_type == DQ else (None, passed)

    def readers(self, value: ir.Value) -> list[ir.Node]:
        """The main-graph nodes reading ``value``, once per input slot; a node whose subgraphs (an ``If``'s
        branches, a ``Loop``'s body) read it counts once for them, unless it reads it itself."""
        return graph_readers(value, self._holders)

    def is_output(self, value: ir.Value) -> bool:
        """Is ``value`` an output of the main graph?"""
        return value.is_graph_output() and value.graph is self.graph

    def read_once(self, value: ir.Value) -> bool:
        """Does exactly one main-graph node read ``value``, once, ``value`` not a graph output?"""
        return len(self.readers(value)) == 1 and not self.is_output(value)

    def per_channel(self, scale: np.ndarray | None) -> bool:
        return scale is not None and scale.ndim == 1 and scale.size > 1

    @cached_property
    def _holders(self) -> dict[int, ir.Node]:
        """Each subgraph of the model, nested ones included, by ``id`` -> the main-graph node holding it."""
        return holders(self.graph)


def same_values(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return bool(
            np.array_equal(
                np.broadcast_to(a.astype(np.float64), np.broadcast_shapes(a.shape, b.shape)),
                np.broadcast_to(b.astype(np.float64), np.broadcast_shapes(a.shape, b.shape)),
            )
        )
    except ValueError:
        return False


def brief(array: np.ndarray | None) -> str:
    if array is None:
        return "none"
    flat = array.astype(np.float64).ravel()
    shown = ", ".join(f"{v:.6g}" for v in flat[:3])
    return f"[{shown}{', ...' if flat.size > 3 else ''}]" if array.ndim else f"{flat[0]:.6g}"
