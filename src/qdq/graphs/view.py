"""The placement language: a front-end-neutral view of a model's graph, and the decisions rules make on it.

A front end (PyTorch's ``torch.fx`` graph, a Keras layer graph, an ONNX file) builds a :class:`GraphView` of its
model: operations named in the ONNX op vocabulary (:mod:`qdq.graphs.ops`), the values they read and write,
which inputs are weights, and the quantizers the model already has (a quantized conv's input and weight).
A placement rule (:class:`qdq.targets.PlacementRule`) reads the view with its questions (does this value follow
a weighted op? is every reader quantizing it? is it >= 0 by construction?) and makes decisions:

* :meth:`GraphView.quantize_input`: quantize a value as one op reads it (a *site*: value, reader, position);
* :meth:`GraphView.quantize_output`: quantize a value for every reader (a value-level site);
* :meth:`GraphView.share_range`: give several quantizers one range (one scale in the file);
* :meth:`GraphView.keep_float`: an op stays float (its quantizers go), with the reason;
* :meth:`GraphView.set_unsigned`: a quantizer of non-negative values uses the uint8 grid;
* :meth:`GraphView.annotate`: facts a front end passes on to an op (the target's attention facts).

The front end then materializes the decisions in its own form (quantizer modules and fx edits; Keras wrapper
plans; Q/DQ nodes). A :class:`Quantizer` is one range: the sites it quantizes, the front end's object for it
when the model already had one (``handles``), its grid.

A value that is not a *boundary* (inside one front-end operation: a Keras conv's activation, the sigmoid of a
PyTorch ``nn.SiLU``) can be decided on like any other: its front end splits the operation to reach it.

This module imports nothing beyond the standard library and :mod:`qdq.graphs.ops`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qdq.graphs import ops as vocab

__all__ = ["GraphView", "Op", "Quantizer", "Site", "Value"]


@dataclass(eq=False)
class Value:
    """A tensor of the graph.

    Attributes:
        name: unique in its view.
        producer: the op writing it (None: a graph input or a constant).
        readers: ``(op, input position)`` for every read, in graph order.
        constant: a weight or other constant (never an activation).
        graph_output: the model returns it.
        boundary: its front end can quantize it without splitting the op that writes it.
        real: it holds real numbers (float types); integer and boolean tensors (shapes, indices, masks) are
            never quantized.
    """

    name: str
    producer: Op | None = None
    readers: list[tuple[Op, int]] = field(default_factory=list)
    constant: bool = False
    graph_output: bool = False
    boundary: bool = True
    real: bool = True

    def __repr__(self) -> str:
        return f"Value({self.name!r})"


def may_weigh(op: Op) -> bool:
    """Does ``op`` run an int8 kernel of its own or may it hide one: a weighted op, attention, or a call the front end
    cannot see into that holds parameters (attrs ``holds_weights``: a PyTorch module torch.fx keeps as a call)?"""
    return op.type in vocab.WEIGHTED or op.type == vocab.ATTENTION or bool(op.attrs.get("holds_weights"))


@dataclass(eq=False)
class Op:
    """One operation, in the ONNX op vocabulary.

    Attributes:
        name: unique in its view (the front end's name: a module path, a layer name, a node name).
        type: the ONNX op type (:mod:`qdq.graphs.ops`).
        inputs: the values it reads, in ONNX input order (weights included, as constant values).
        outputs: the values it writes.
        attrs: ONNX-style attributes placement reads (``Clip``'s ``min``, ``Resize``'s ``mode``...).
        weights: input positions of the weights the op multiplies (a bias is a constant input, not one).
        inner: values computed inside the op, by name (``Silu``: ``"sigmoid"``; ``Attention``: ``"probs"``).
        ref: the front end's handle for the op (an fx node, a Keras layer, an ONNX node...).
    """

    name: str
    type: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    weights: frozenset[int] = frozenset()
    inner: dict[str, Value] = field(default_factory=dict)
    ref: Any = None

    def __repr__(self) -> str:
        return f"Op({self.name!r}, {self.type})"

    @property
    def data_inputs(self) -> list[tuple[int, Value]]:
        """``(position, value)`` of the inputs that are not weights or constants, and hold real numbers: an integer
        input computed at run time (a ``Resize``'s sizes, a ``Pad``'s amounts, a ``Gather``'s indices, all from
        ``Shape`` arithmetic or token ids) is never quantized, and says nothing of the sign of the op's output."""
        return [(i, v) for i, v in enumerate(self.inputs) if i not in self.weights and not v.constant and v.real]


@dataclass(frozen=True, eq=True)
class Site:
    """Where a quantizer applies: ``value`` as ``reader`` reads it at ``index``, or (``reader`` None) ``value``
    for every reader."""

    value: Value
    reader: Op | None = None
    index: int = 0

    def __str__(self) -> str:
        return self.value.name if self.reader is None else f"{self.reader.name}[{self.index}]"

    @property
    def input_reader(self) -> Op:
        """The reader of an input site (a weight's, an operation input's); a value-wide site has none."""
        if self.reader is None:
            raise ValueError(f"{self} quantizes a value for every reader, not one operation's input")
        return self.reader


@dataclass(eq=False)
class Quantizer:
    """One range and the sites it quantizes.

    Attributes:
        sites: where it applies, in the order they joined.
        handles: the front end's existing quantizer objects for it (the model had them before placement); one
            after :meth:`GraphView.share_range` merged quantizers the model held apart.
        per_channel: a weight's per-channel quantizer.
        unsigned: uint8 grid over ``[0, amax]``.
        stem: the name a front end gives a quantizer it adds (``"output_quantizer"``...).
    """

    sites: list[Site] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    per_channel: bool = False
    unsigned: bool = False
    stem: str = "input_quantizer"

    @property
    def new(self) -> bool:
        """Placement adds it (no front-end object yet)."""
        return not self.handles


class GraphView:
    """A model's graph in the placement language, and the quantization decided on it so far.

    Args:
        frontend: who built it (``"torch"``, ``"keras"``, ``"onnx"``).
        target: the :class:`qdq.targets.Target` being placed for (rules read its facts), or None.
    """

    def __init__(self, frontend: str, target: Any = None) -> None:
        self.frontend, self.target = frontend, target
        self.ops: list[Op] = []
        self.values: dict[str, Value] = {}
        self.float_ops: dict[str, str] = {}
        self.notes: dict[str, dict[str, Any]] = {}
        self.changes: list[str] = []
        self.dropped: list[Any] = []  # handles of quantizers keep_float removed
        self._sites: dict[Site, Quantizer] = {}
        self._existing: dict[Site, Any] = {}  # site -> the front end's quantizer object there
        self._memo: dict[str, dict[Any, Any]] = {}
        self.non_negative_data: set[str] = set()  # graph inputs the calibration data shows are >= 0
        #: the graph's outputs are the model's (False: a submodule traced alone, read by code the view cannot see)
        self.whole_model = True

    # --- building (front ends) ---------------------------------------------------------------------------------
    def value(self, name: str, *, constant: bool = False, boundary: bool = True, real: bool = True) -> Value:
        """The value called ``name``, created on first use."""
        found = self.values.get(name)
        if found is None:
            found = self.values[name] = Value(name, constant=constant, boundary=boundary, real=real)
        return found

    def add_op(
        self,
        name: str,
        op_type: str,
        inputs: Sequence[Value],
        outputs: Sequence[Value],
        *,
        attrs: Mapping[str, Any] | None = None,
        weights: Iterable[int] = (),
        inner: Mapping[str, Value] | None = None,
        ref: Any = None,
    ) -> Op:
        """Append an op (front ends add them in a topological order). The inner values its type has
        (:data:`qdq.graphs.ops.INNER_VALUES`) and ``inner`` does not give are added, inside the op (not a boundary:
        ``"<name>:<inner>"``)."""
        inner = dict(inner or {})
        for key in vocab.INNER_VALUES.get(op_type, ()):
            inner.setdefault(key, self.value(f"{name}:{key}", boundary=False))
        op = Op(name, op_type, list(inputs), list(outputs), dict(attrs or {}), frozenset(weights), inner, ref)
        for index, value in enumerate(op.inputs):
            value.readers.append((op, index))
        for value in [*op.outputs, *op.inner.values()]:
            value.producer = op
        self.ops.append(op)
        return op

    def existing(self, site: Site, handle: Any, *, per_channel: bool = False, unsigned: bool = False) -> Quantizer:
        """Record a quantizer the model already has at ``site`` (the same ``handle`` at several sites: one
        quantizer). A site keeps the first quantizer recorded for it."""
        if site in self._sites:
            return self._sites[site]
        quantizer = next((q for q in self.quantizers() if any(h is handle for h in q.handles)), None)
        if quantizer is None:
            quantizer = Quantizer(handles=[handle], per_channel=per_channel, unsigned=unsigned)
        quantizer.sites.append(site)
        self._sites[site] = quantizer
        self._existing[site] = handle
        return quantizer

    # --- questions ---------------------------------------------------------------------------------------------
    def ops_of(self, *types: str) -> list[Op]:
        """The ops of these types, in graph order."""
        return [op for op in self.ops if op.type in types]

    def op(self, name: str) -> Op:
        return next(op for op in self.ops if op.name == name)

    @staticmethod
    def single_reader(value: Value) -> Op | None:
        """The one op reading ``value`` once (None: several reads, none, or a graph output)."""
        if len(value.readers) != 1 or value.graph_output:
            return None
        return value.readers[0][0]

    def site_quantizer(self, site: Site) -> Quantizer | None:
        """The quantizer placed at exactly ``site`` (None: none there; an op's read may still go through its value's
        quantizer: :meth:`quantizer_at`)."""
        return self._sites.get(site)

    def quantizer_at(self, op: Op, index: int) -> Quantizer | None:
        """The quantizer ``op`` reads input ``index`` through (its own site's, else the value's)."""
        value = op.inputs[index]
        return self._sites.get(Site(value, op, index)) or self._sites.get(Site(value))

    def reads_quantized(self, op: Op, index: int) -> bool:
        return self.quantizer_at(op, index) is not None

    def output_quantizer(self, value: Value) -> Quantizer | None:
        """The quantizer every reader of ``value`` reads it through (a value-level site), or None."""
        return self._sites.get(Site(value))

    def readers_quantize(self, value: Value) -> bool:
        """Does every reader of ``value`` read it quantized (looking through single-reader identities)?"""
        while (reader := self.single_reader(value)) is not None and reader.type in vocab.IDENTITIES:
            if self.output_quantizer(value) is not None or self.reads_quantized(reader, 0):
                return True
            value = reader.outputs[0]
        if self.output_quantizer(value) is not None:
            return True
        return bool(value.readers) and not value.graph_output and all(self.reads_quantized(o, i)
                                                                      for o, i in value.readers)  # fmt: skip

    def is_quantized(self, op: Op) -> bool:
        """Does ``op`` read every data input and weight quantized (an int8 op, e.g. a quantized conv)?"""
        positions = [i for i, _ in op.data_inputs] + sorted(op.weights)
        return bool(positions) and all(self.reads_quantized(op, i) for i in positions)

    def follows_weighted(self, value: Value, hops: int = 8) -> bool:
        """``value`` is a weighted op's output, possibly through a BatchNorm, a bias add, activations and identities,
        and each value on the way (``value`` included) has one reader: what a runtime fuses into one kernel."""
        for _ in range(hops):
            producer = value.producer
            if self.single_reader(value) is None or producer is None:
                return False
            if producer.type in vocab.WEIGHTED:
                return True
            passthrough = vocab.NORMS | vocab.ACTIVATIONS | vocab.IDENTITIES
            if (producer.type not in passthrough and not self.is_bias_add(producer)) or not producer.data_inputs:
                return False
            value = producer.data_inputs[0][1]
        return False

    @staticmethod
    def is_bias_add(op: Op) -> bool:
        """Is ``op`` an ``Add`` of one computed value and a constant: a bias written apart from its weighted op (a
        linear exported as ``MatMul`` + ``Add``)? It fuses into that op as a BatchNorm does; it is no residual add."""
        return op.type == "Add" and len(op.inputs) == 2 and len(op.data_inputs) == 1 and any(
            v.constant for v in op.inputs)  # fmt: skip

    def weighted_depth(self, value: Value) -> int:
        """How many weighted ops the longest path from a graph input to ``value`` goes through."""
        depth = self._memo.setdefault("depth", {})
        stack = [value]
        while stack:  # iterative: a deep network would overflow Python's recursion
            top = stack[-1]
            op = top.producer
            pending = [v for _, v in op.data_inputs if v.name not in depth] if op is not None else []
            if pending:
                stack += pending
                continue
            stack.pop()
            before = max((depth[v.name] for _, v in op.data_inputs), default=0) if op is not None else 0
            depth[top.name] = before + int(op is not None and op.type in vocab.WEIGHTED)
        return depth[value.name]

    def feeds_weighted(self, value: Value) -> bool:
        """Does some path from ``value`` reach a weighted op (Conv, Gemm, MatMul: :data:`qdq.graphs.ops.WEIGHTED`)?"""
        memo = self._memo.setdefault("feeds", {})
        stack, entered = [value], set()
        while stack:  # iterative, post-order: a deep network would overflow Python's recursion
            top = stack[-1]
            readers = [op for op, _ in top.readers]
            pending = [v for op in readers if not may_weigh(op) for v in op.outputs if v.name not in memo]
            if pending and top.name not in entered:
                entered.add(top.name)
                stack += pending
                continue
            stack.pop()
            memo[top.name] = any(may_weigh(op) or any(memo.get(v.name, False) for v in op.outputs)
                                 for op in readers)  # fmt: skip
        return bool(memo[value.name])

    def in_output_tail(self, op: Op) -> bool:
        """Is ``op`` part of the model's output tail: not a weighted op, and what it computes reaches the model's
        outputs without passing through another weighted op (box decoding, score sigmoids, the concatenation of
        coordinates with scores, a state output)? Never in the graph of a submodule traced alone
        (:attr:`whole_model` False): what reads its outputs is not in the view."""
        if not self.whole_model or may_weigh(op) or not op.outputs:
            return False
        return not any(self.feeds_weighted(v) for v in op.outputs)

    def non_negative(self, value: Value) -> bool:
        """Is ``value`` >= 0 by construction (ReLU, Sigmoid, Softmax..., possibly pooled, moved, added)?"""
        memo = self._memo.setdefault("nonneg", {})
        if value.name not in memo:
            memo[value.name] = False  # a cycle guard; graphs are acyclic
            op = value.producer
            if op is None and value.name in self.non_negative_data and not value.constant:
                memo[value.name] = True
                return True
            if op is None or value.constant:
                return False
            if value is op.inner.get("sigmoid") or vocab.is_non_negative_op(op.type, op.attrs):
                memo[value.name] = True
            elif vocab.keeps_sign(op.type, op.attrs):
                inputs = [v for _, v in op.data_inputs]
                memo[value.name] = bool(inputs) and all(self.non_negative(v) for v in inputs)
        return memo[value.name]

    def quantizers(self) -> list[Quantizer]:
        """Every quantizer (each once), in the order their first site joined."""
        found: dict[int, Quantizer] = {}
        for quantizer in self._sites.values():
            found.setdefault(id(quantizer), quantizer)
        return list(found.values())

    def is_existing(self, site: Site) -> bool:
        """Did the model hold this site's quantizer before placement?"""
        return site in self._existing

    def handle_of(self, site: Site) -> Any:
        """The front end's quantizer object the model had at ``site`` (None: placement adds the site)."""
        return self._existing.get(site)

    # --- decisions ---------------------------------------------------------------------------------------------
    def quantize_input(
        self, op: Op, index: int, why: str, *, like: Quantizer | None = None, stem: str = "input_quantizer"
    ) -> Quantizer | None:
        """Quantize input ``index`` of ``op`` (with ``like``'s range when given); nothing when it already is. A
        value that is not real (an integer shape, a mask) is never quantized: None."""
        found = self.quantizer_at(op, index)
        if found is not None:
            return found
        value = op.inputs[index]
        if not value.real or (value.constant and (like is None or not like.per_channel)):
            return None
        return self._add(Site(value, op, index), like, stem, why)

    def quantize_output(self, value: Value, why: str, *, stem: str = "output_quantizer") -> Quantizer | None:
        """Quantize ``value`` for every reader (nothing when it already is; None for a value that is not real)."""
        found = self.output_quantizer(value)
        if found is not None or not value.real or value.constant:
            return found
        return self._add(Site(value), None, stem, why)

    def share_range(self, quantizers: Sequence[Quantizer | None], why: str) -> Quantizer:
        """One range for all of ``quantizers`` (their sites get one quantizer: the first; None entries, values that
        are not quantized, are skipped); returns it."""
        present = [q for q in quantizers if q is not None]
        survivor = present[0]
        for other in present[1:]:
            if other is survivor:
                continue
            for site in other.sites:
                self._sites[site] = survivor
                survivor.sites.append(site)
            survivor.handles += [h for h in other.handles if all(h is not k for k in survivor.handles)]
            survivor.unsigned = survivor.unsigned and other.unsigned
            other.sites.clear()
        self.changes.append(f"one range for {', '.join(str(s) for s in survivor.sites)}: {why}")
        return survivor

    def keep_float(self, op: Op, why: str) -> None:
        """``op`` stays float: the quantizers it reads its inputs and weights through (its own sites) go."""
        for index, value in enumerate(op.inputs):
            quantizer = self._sites.pop(Site(value, op, index), None)
            if quantizer is not None:
                quantizer.sites = [s for s in quantizer.sites if not (s.reader is op and s.index == index)]
                if not quantizer.sites:
                    self.dropped += quantizer.handles
        self.float_ops[op.name] = why
        self.changes.append(f"{op.name}: float ({why})")

    def keep_value_float(self, value: Value, why: str) -> None:
        """``value`` stays float for every reader: the quantizer over it goes (with all its sites), and each op
        that read it quantized stays float (:meth:`keep_float`)."""
        quantizers = {id(q): q for site, q in self._sites.items() if site.value is value}
        for quantizer in quantizers.values():
            for site in list(quantizer.sites):
                if site.reader is not None and site.value is value:
                    self.keep_float(site.reader, why)
            for site in [s for s in quantizer.sites if s.value is value]:
                self._sites.pop(site, None)
            quantizer.sites = [s for s in quantizer.sites if s.value is not value]
            if not quantizer.sites:
                self.dropped += quantizer.handles
        self.changes.append(f"{value.name}: float ({why})")

    def set_unsigned(self, quantizer: Quantizer, why: str) -> None:
        if not quantizer.unsigned:
            quantizer.unsigned = True
            self.changes.append(f"unsigned quantizer on {', '.join(str(s) for s in quantizer.sites)}: {why}")

    def annotate(self, op: Op, key: str, value: Any) -> None:
        """Pass ``value`` to ``op``'s front end under ``key`` (facts the op's front-end object applies)."""
        self.notes.setdefault(op.name, {})[key] = value

    def _add(self, site: Site, like: Quantizer | None, stem: str, why: str) -> Quantizer:
        quantizer = like if like is not None else Quantizer(stem=stem)
        quantizer.sites.append(site)
        self._sites[site] = quantizer
        self.changes.append(f"quantize {site}: {why}")
        return quantizer
