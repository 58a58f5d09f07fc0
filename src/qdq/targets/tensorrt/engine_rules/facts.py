"""What every TensorRT rule reads: the graph's facts (:class:`GraphFacts`), and what a rule is and reports.

A rule (:class:`Rule`) is a function of a :class:`GraphFacts` yielding :class:`Violation` s; the rule families
(:mod:`.qdq_nodes`, :mod:`.schemes`, :mod:`.fusion`, :mod:`.strong_typing`) each list theirs in ``RULES``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex
from qdq.graphs.onnx_types import TensorTypes, default_opset

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
    """What every rule reads: the graph index, tensor types, the opset and the FP32 allow-list."""

    index: GraphIndex
    types: TensorTypes
    opset: int
    fp32_ops: frozenset[str]
    fp32_nodes: dict[str, str]

    @classmethod
    def of(cls, model: Any, fp32_ops: Iterable[str]) -> GraphFacts:
        meta = {p.key: p.value for p in model.metadata_props}
        try:
            recorded = json.loads(meta.get(FP32_NODES_KEY, "{}"))
        except json.JSONDecodeError:
            recorded = {}
        return cls(GraphIndex(model), TensorTypes.of(model), default_opset(model), frozenset(fp32_ops),
                   {str(k): str(v) for k, v in dict(recorded).items()})  # fmt: skip

    @property
    def nodes(self) -> Any:
        return self.index.nodes

    def name(self, node: Any) -> str:
        return node.name or f"{node.op_type}({', '.join(node.output)})"

    def value(self, tensor: str) -> np.ndarray | None:
        """The value of a constant tensor (an initializer or Constant, possibly behind Identity nodes)."""
        node = self.index.producer.get(tensor)
        while node is not None and node.op_type == "Identity" and tensor not in self.index.constants:
            tensor, node = node.input[0], self.index.producer.get(node.input[0])
        return self.index.array(tensor)

    def scale(self, node: Any) -> np.ndarray | None:
        return self.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None

    def zero_point(self, node: Any) -> np.ndarray | None:
        return self.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None

    def axis(self, node: Any) -> int:
        value = next((a.i for a in node.attribute if a.name == "axis"), 1)
        rank = self.types.ranks.get(node.input[0])
        return value + rank if value < 0 and rank is not None else value

    def is_constant(self, tensor: str) -> bool:
        """Is ``tensor`` known when TensorRT builds the engine (a constant, or computed from constants only)?

        TensorRT folds such subgraphs at build time: a weight clipped by ``Min``/``Max`` before its Q (qdq's
        sub-8-bit weights) is still a weight.
        """
        pending, seen = [tensor], set()
        while pending:
            name = pending.pop()
            if name in seen or name in self.index.constants:
                continue
            seen.add(name)
            producer = self.index.producer.get(name)
            if producer is None or producer.op_type in (Q, DQ):
                return False
            pending.extend(i for i in producer.input if i)
        return True

    def q_of(self, dq: Any) -> Any | None:
        producer = self.index.producer.get(dq.input[0])
        return producer if producer is not None and producer.op_type == Q else None

    def quantized_source(self, tensor: str, through: frozenset[str] = LAYOUT) -> tuple[Any | None, list[Any]]:
        """The DequantizeLinear ``tensor`` comes from, looking back through ``through``, and the ops passed."""
        passed: list[Any] = []
        node = self.index.producer.get(tensor)
        while node is not None and node.op_type in through and node.input:
            passed.append(node)
            node = self.index.producer.get(node.input[0])
        return (node, passed) if node is not None and node.op_type == DQ else (None, passed)

    def per_channel(self, scale: np.ndarray | None) -> bool:
        return scale is not None and scale.ndim == 1 and scale.size > 1


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
