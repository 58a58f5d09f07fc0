"""The one index of an ONNX graph, and tidying an exported graph.

:class:`GraphIndex` maps each tensor to the node producing it and the nodes reading it, and knows the
graph's constants, inputs and outputs; its edits (remove nodes, rewire readers, insert a node, add a
constant) keep the maps current. Every pass over an ONNX graph in qdq uses it: the onnxruntime rewrite,
the calibration cache, the exporter's clean-ups and the runtime fusion report. :func:`remove_nodes` is the one
node removal. :func:`on_ir` runs onnx_ir passes and onnxscript rules on a model (one round trip).

The Q/DQ nodes qdq exported, tagged with their quantizers, are read back by :mod:`qdq.graphs.onnx_tags`.

Imports neither torch nor (at import time) onnx or onnx_ir.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.atomic import write_bytes_atomic
from qdq.graphs import onnx_types

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "GraphIndex",
    "all_nodes",
    "atomic_save",
    "attribute",
    "clear_output_shapes",
    "declare_computed_output_shapes",
    "initializer_map",
    "name_nodes",
    "on_ir",
    "remove_nodes",
    "rename_io",
    "restore_output_shapes",
    "rewrite_branches",
    "set_axis",
    "set_metadata",
    "sort_nodes",
    "subgraphs",
    "tidy",
    "unique_value_names",
    "unique_value_names_ir",
]


def initializer_map(model: onnx.ModelProto) -> dict[str, Any]:
    """Name -> TensorProto of initializers and of the outputs of Constant nodes."""
    table: dict[str, Any] = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            table[node.output[0]] = node.attribute[0].t
    return table


def _read_list(node: Any) -> list[str]:
    """The names ``node`` reads as the consumer map lists them: its inputs, then what its subgraphs read."""
    inputs = [name for name in node.input if name]
    return inputs + sorted(set(_reads(node)) - set(inputs))


def remove_nodes(model: onnx.ModelProto, nodes: Iterable[Any]) -> None:
    """Remove ``nodes`` (identified by object) from the model's top-level graph, keeping the others' order and the
    objects that stand for them (deleted in place: a rebuilt list would copy every node kept)."""
    doomed = {id(n) for n in nodes}
    graph_nodes = model.graph.node
    for position in reversed([i for i, node in enumerate(graph_nodes) if id(node) in doomed] if doomed else []):
        del graph_nodes[position]


def _reads(node: Any) -> list[str]:
    """Every tensor name ``node`` reads: its inputs and, for control flow, what its subgraphs read."""
    return [n for n in node.input if n] + [n for g in subgraphs(node) for inner in g.node for n in _reads(inner)]


def subgraphs(node: Any) -> list[Any]:
    """The graphs of ``node``'s attributes (an ``If``'s branches, a ``Loop``'s body)."""
    return [g for attr in node.attribute for g in ([attr.g] if attr.HasField("g") else attr.graphs)]


def sort_nodes(model: onnx.ModelProto) -> None:
    """Order the top-level graph's nodes topologically (as ONNX requires), keeping the present order wherever it
    already is one: a node moves only behind the producers it reads. In place: the node objects stay the graph's."""
    nodes = list(model.graph.node)
    at = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    order: list[int] = []
    placed = [False] * len(nodes)
    for start in range(len(nodes)):
        stack = [start]
        while stack:
            i = stack[-1]
            if placed[i]:
                stack.pop()
                continue
            pending = [at[name] for name in _reads(nodes[i]) if name in at and not placed[at[name]] and at[name] != i]
            if pending:
                stack += pending[::-1]
                continue
            placed[i] = True
            order.append(i)
            stack.pop()
    if order != list(range(len(nodes))):
        rank = {id(nodes[i]): k for k, i in enumerate(order)}
        model.graph.node.sort(key=lambda node: rank[id(node)])


class GraphIndex:
    """Producer / consumer maps, constants, inputs and outputs of a model's top-level graph.

    Attributes:
        model: the ``onnx.ModelProto`` (edited in place by the methods below).
        producer: tensor name -> the node writing it.
        consumers: tensor name -> the nodes reading it (a node reading a tensor twice appears twice).
        constants: tensor name -> ``TensorProto`` of initializers and ``Constant`` node outputs.
        inputs, outputs: names of the graph's inputs and outputs.

    The editing methods keep the maps current, each at the cost of what it changes: :meth:`remove`,
    :meth:`insert`, :meth:`rewire`, :meth:`set_input`, :meth:`add_const`. A node's inputs edited in place
    (``node.input[i] = name``) are not seen until :meth:`refresh`, which rebuilds every map from the graph.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self._counter = 0
        self._order: tuple[list[int], list[Any]] = ([], [])  # the node list's ids and nodes, for :meth:`insert`
        self.refresh()

    @property
    def graph(self) -> Any:
        return self.model.graph

    @property
    def nodes(self) -> Any:
        return self.model.graph.node

    def refresh(self) -> None:
        """Rebuild every map from the graph."""
        self.constants = initializer_map(self.model)
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for node in self.graph.node:
            for name in _read_list(node):
                self.consumers[name].append(node)
        self.producer = {out: node for node in self.graph.node for out in node.output if out}
        self.inputs = {v.name for v in self.graph.input}
        self.outputs = {v.name for v in self.graph.output}

    # --- reading
    def array(self, name: str) -> np.ndarray | None:
        """The value of constant ``name`` as a numpy array, or None when it is not a constant."""
        from onnx import numpy_helper

        proto = self.constants.get(name) if name else None
        return None if proto is None else numpy_helper.to_array(proto)

    def const_input(self, node: Any, index: int) -> np.ndarray | None:
        """Constant input ``index`` of ``node``; None when absent or not a constant."""
        return self.array(node.input[index]) if len(node.input) > index and node.input[index] else None

    def single_reader(self, tensor: str) -> Any | None:
        """The only node reading ``tensor``, when there is exactly one and ``tensor`` is not a graph output."""
        readers = self.consumers.get(tensor, [])
        return readers[0] if len(readers) == 1 and tensor not in self.outputs else None

    def is_single_reader(self, node: Any, tensor: str) -> bool:
        """Whether ``node`` is the :meth:`single_reader` of ``tensor`` (a test that, unlike ``single_reader(tensor)
        is node``, does not make a type checker read ``node`` as possibly None)."""
        return self.single_reader(tensor) is node

    def only_readers(self, tensor: str, op_types: Iterable[str]) -> list[Any] | None:
        """The nodes reading ``tensor`` when there are some, each of one of ``op_types``, and ``tensor`` is not a
        graph output; else None."""
        readers, allowed = self.consumers.get(tensor, []), frozenset(op_types)
        ok = readers and tensor not in self.outputs and all(r.op_type in allowed for r in readers)
        return readers if ok else None

    def source(self, tensor: str, through: frozenset[str] | set[str] = frozenset()) -> Any | None:
        """The node producing ``tensor``, looking back through ops in ``through`` (None: an input or constant)."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in through and node.input:
            node = self.producer.get(node.input[0])
        return node

    def readers(self, tensor: str, through: frozenset[str] | set[str] = frozenset()) -> list[Any | None]:
        """The nodes reading ``tensor``, looking through ops in ``through``; None stands for a graph output."""
        found: list[Any | None] = []
        pending, seen = [tensor], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.outputs:
                found.append(None)
            for node in self.consumers.get(name, []):
                if node.op_type in through:
                    pending.extend(node.output)
                else:
                    found.append(node)
        return found

    # --- editing
    def unique(self, stem: str) -> str:
        """A new tensor name starting with ``stem``."""
        self._counter += 1
        name = f"{stem}__{self._counter}"
        while name in self.producer or name in self.constants or name in self.consumers:
            self._counter += 1
            name = f"{stem}__{self._counter}"
        return name

    def add_const(self, stem: str, value: np.ndarray) -> str:
        """Add an initializer holding ``value`` under a new name starting with ``stem``; return the name."""
        from onnx import numpy_helper

        name = self.unique(stem)
        tensor = numpy_helper.from_array(np.array(value, copy=True, order="C"), name)
        self.graph.initializer.append(tensor)
        self.constants[name] = tensor
        return name

    def rewire(self, old: str, new: str) -> None:
        """Make every reader of tensor ``old`` read ``new`` instead (inside the subgraphs of control flow too)."""
        for node in self.consumers.pop(old, []):
            for inner in all_nodes_of(node):
                for i, name in enumerate(inner.input):
                    if name == old:
                        inner.input[i] = new
            self.consumers.setdefault(new, []).append(node)

    def set_input(self, node: Any, index: int, name: str | None) -> None:
        """Make input ``index`` of ``node`` read ``name`` (``index`` one past the last input: appended; None: that
        input and those after it dropped)."""
        self._forget_reads(node)
        if name is None:
            del node.input[index:]
        elif index == len(node.input):
            node.input.append(name)
        else:
            node.input[index] = name
        for read in _read_list(node):
            self.consumers.setdefault(read, []).append(node)

    def set_output(self, node: Any, index: int, name: str) -> None:
        """Make ``node`` write ``name`` as its output ``index``."""
        old = node.output[index]
        if self.producer.get(old) is node:
            del self.producer[old]
        node.output[index] = name
        self.producer[name] = node

    def remove(self, nodes: Iterable[Any]) -> None:
        """Remove ``nodes`` from the graph and from the maps (what they write, what they read)."""
        doomed = list({id(n): n for n in nodes}.values())
        remove_nodes(self.model, doomed)
        for node in doomed:
            self._forget_reads(node)
            for out in node.output:
                if self.producer.get(out) is node:
                    del self.producer[out]
                if node.op_type == "Constant":
                    self.constants.pop(out, None)

    def insert(self, anchor: Any, node: Any, *, after: bool = False) -> None:
        """Insert ``node`` right before (or after) ``anchor`` in the node list."""
        index = self._position(anchor) + int(after)
        self.graph.node.insert(index, node)
        node = self.graph.node[index]  # the graph holds a copy of the node given
        self._order[1].insert(index, node)
        self._order[0].insert(index, id(node))
        self.producer.update((out, node) for out in node.output if out)
        for read in _read_list(node):
            self.consumers.setdefault(read, []).append(node)

    def _position(self, node: Any) -> int:
        """Where ``node`` is in the node list: a scan in C of the nodes' ids, kept across inserts (read again when
        the list changed otherwise)."""
        nodes = self.graph.node
        index = self._order[0].index(id(node)) if id(node) in self._order[0] else -1
        if not 0 <= index < len(nodes) or nodes[index] is not node:
            held = list(nodes)  # held: the objects, and so their ids, stay
            self._order = ([id(n) for n in held], held)
            index = self._order[0].index(id(node))
        return index

    def _forget_reads(self, node: Any) -> None:
        for read in set(_read_list(node)):
            kept = [reader for reader in self.consumers.get(read, []) if reader is not node]
            if kept:
                self.consumers[read] = kept
            else:
                self.consumers.pop(read, None)


def attribute(node: Any, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (ints, floats, lists...), or ``default``."""
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def set_axis(node: Any, axis: int | None) -> None:
    """Set (or, with None, remove) ``node``'s ``axis`` attribute."""
    kept = [a for a in node.attribute if a.name != "axis"]
    del node.attribute[:]
    node.attribute.extend(kept)
    if axis is not None:
        from onnx import helper

        node.attribute.append(helper.make_attribute("axis", axis))


def tidy(model: onnx.ModelProto) -> None:
    """Exact clean-ups: ``Identity`` of an initializer is bypassed; unused Constants and initializers go. What the
    subgraphs of control flow read from the main graph counts as used, and is renamed with it. (On protobuf: see
    ARCHITECTURE.md, ONNX graphs.)"""
    constants = {t.name for t in model.graph.initializer}
    outputs = {v.name for v in model.graph.output}
    rename = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Identity" and n.input[0] in constants and n.output[0] not in outputs
    }
    remove_nodes(model, [n for n in model.graph.node if n.op_type == "Identity" and n.output[0] in rename])
    for node in all_nodes(model.graph):
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    used = {name for node in model.graph.node for name in _reads(node)} | outputs
    remove_nodes(model, [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] not in used])
    initializers = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)


def on_ir(model: onnx.ModelProto, *edits: Callable[[ir.Model], Any]) -> list[Any]:
    """Run ``edits`` (functions of an ``onnx_ir.Model``: its passes, a rule set's ``apply_to_model``) on ``model`` in
    place, in one round trip through onnx_ir; what each returned. What a round trip alone changes is undone (a
    ``value_info`` entry per initializer, the metadata's order)."""
    import onnx_ir

    ir_model = onnx_ir.serde.deserialize_model(model)  # its tensors shared, not copied
    results = []
    for edit in edits:  # a loop, not a comprehension: the edits' warnings keep their stack level on every Python
        results.append(edit(ir_model))
    proto = onnx_ir.serde.serialize_model(ir_model)
    declared = {value.name for graph in _graphs(model.graph) for value in graph.value_info}
    constants = {tensor.name for graph in _graphs(proto.graph) for tensor in graph.initializer}
    for graph in _graphs(proto.graph):
        kept = [value for value in graph.value_info if value.name in declared or value.name not in constants]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    del proto.metadata_props[:]
    proto.metadata_props.extend(model.metadata_props)
    model.CopyFrom(proto)
    return results


def all_nodes_of(node: Any) -> list[Any]:
    """``node`` and every node of its subgraphs (an ``If``'s branches, a ``Loop``'s body)."""
    return [node, *(n for inner in subgraphs(node) for n in all_nodes(inner))]


def all_nodes(graph: Any) -> list[Any]:
    """Every node of ``graph`` (an ``onnx.GraphProto``) and of the subgraphs of its control flow, outer first."""
    return [*graph.node, *(n for node in graph.node for inner in subgraphs(node) for n in all_nodes(inner))]


def unique_value_names(model: onnx.ModelProto) -> int:
    """Make every tensor name the model defines defined once: a name a subgraph (an ``If`` branch, a ``Loop`` body)
    defines (its inputs, initializers, node outputs) that an enclosing or earlier graph defines too is renamed
    ``<name>__<n>`` in that subgraph, reads of nested subgraphs included (an onnx_ir value renamed). ONNX allows
    sibling branches to reuse a name; qdq reads every graph of a model as one (the ONNX front end's view,
    calibration's outputs, constants moved to the main graph). Returns how many names changed."""
    return int(on_ir(model, unique_value_names_ir)[0])


def unique_value_names_ir(model: ir.Model) -> int:
    """:func:`unique_value_names` on an ``onnx_ir.Model``."""
    import onnx_ir

    nodes = list(onnx_ir.traversal.RecursiveGraphIterator(model.graph))
    every: set[str | None] = {v.name for node in nodes for v in (*node.inputs, *node.outputs) if v is not None}
    every |= {v.name for graph in model.graphs() for v in _defined(graph)}
    defined, changed = {v.name for v in _defined(model.graph)}, 0
    for graph in model.graph.subgraphs():  # outer first, each before the graphs inside it
        for value in (v for v in _defined(graph) if v.name in defined):
            number = 1
            while f"{value.name}__{number}" in every:
                number += 1
            value.name = f"{value.name}__{number}"
            every.add(value.name)
            changed += 1
        defined.update(v.name for v in _defined(graph))
    return changed


def _defined(graph: ir.Graph) -> list[ir.Value]:
    """The values ``graph`` itself defines: its inputs, initializers and node outputs."""
    return [*graph.inputs, *graph.initializers.values(), *(v for node in graph for v in node.outputs if v.name)]


def _graphs(graph: Any) -> list[Any]:
    return [graph, *(g for node in graph.node for inner in subgraphs(node) for g in _graphs(inner))]


def rewrite_branches(model: onnx.ModelProto, rewrite: Callable[[onnx.ModelProto], object]) -> int:
    """Run ``rewrite`` on every ``If`` branch of the main graph as a model of its own (the model's IR version and
    opsets; what it reads from the main graph are names it does not define, as a model's inputs are) and put each
    result back, its new names made unique in the model (:func:`unique_value_names`). A branch's own ``If`` nodes
    are ``rewrite``'s to walk. Returns how many branches were rewritten."""
    import onnx

    count = 0
    for node in model.graph.node:
        for attr in node.attribute if node.op_type == "If" else ():
            branch = onnx.ModelProto(ir_version=model.ir_version)
            branch.opset_import.extend(model.opset_import)
            branch.graph.CopyFrom(attr.g)
            rewrite(branch)
            attr.g.CopyFrom(branch.graph)
            count += 1
    if count:
        unique_value_names(model)
    return count


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every node of the model (subgraphs included) a name of its own: an unnamed node ``<op type>_<n>``, a
    name used before ``<name>_<n>`` (ONNX Runtime refuses two nodes of one name; old exporters leave nodes
    unnamed). Returns how many nodes were named."""
    nodes = all_nodes(model.graph)
    taken = {node.name for node in nodes if node.name}
    seen: set[str] = set()
    named = 0
    for node in nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        stem, number = node.name or node.op_type, 0
        while f"{stem}_{number}" in taken:
            number += 1
        node.name = f"{stem}_{number}"
        taken.add(node.name)
        seen.add(node.name)
        named += 1
    return named


def rename_io(model: onnx.ModelProto, inputs: Iterable[str], outputs: Iterable[str]) -> None:
    """Rename the graph's inputs and outputs (in order) and every reference to them."""
    mapping: dict[str, str] = {}
    for value, new in zip(model.graph.input, inputs):
        mapping[value.name] = new
    for value, new in zip(model.graph.output, outputs):
        mapping[value.name] = new
    mapping = {old: new for old, new in mapping.items() if old != new}
    if not mapping:
        return
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        value.name = mapping.get(value.name, value.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = mapping.get(name, name)


def clear_output_shapes(model: onnx.ModelProto) -> dict[str, Any]:
    """The main graph outputs' declared shapes (by name, those that declare one), cleared from ``model``: shape
    inference then says what the graph computes for them instead of failing on a declaration it contradicts."""
    import onnx

    declared = {}
    for value in model.graph.output:
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            declared[value.name] = onnx.TensorShapeProto()
            declared[value.name].CopyFrom(tensor.shape)
            tensor.ClearField("shape")
    return declared


def restore_output_shapes(model: onnx.ModelProto, declared: dict[str, Any], inferred: onnx.ModelProto | None) -> int:
    """Each output's ``declared`` shape (:func:`clear_output_shapes`) back, except where ``inferred`` (``model`` after
    shape inference) computes another rank: there the computed shape (an exporter's stale declaration, or one a
    rewrite made stale: ONNX's strict shape inference, which ``onnx.checker`` runs, refuses it). Returns how many
    outputs took the computed shape."""
    computed = {v.name: v.type.tensor_type for v in inferred.graph.output} if inferred is not None else {}
    changed = 0
    for value in model.graph.output:
        if value.name not in declared:
            continue
        found = computed.get(value.name)
        if found is not None and found.HasField("shape") and len(found.shape.dim) != len(declared[value.name].dim):
            value.type.tensor_type.shape.CopyFrom(found.shape)
            changed += 1
        else:
            value.type.tensor_type.shape.CopyFrom(declared[value.name])
    return changed


def declare_computed_output_shapes(model: onnx.ModelProto) -> int:
    """:func:`restore_output_shapes` after ONNX shape inference of ``model`` (in place; 0 where inference fails)."""
    import onnx

    declared = clear_output_shapes(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph ONNX cannot infer keeps its declarations
        inferred = None
    return restore_output_shapes(model, declared, inferred)


def set_metadata(proto: Any, key: str, value: str) -> None:
    """Set the metadata entry ``key`` (``metadata_props``) of a model or node to ``value``, replacing an earlier
    one. An onnx_ir model or node (its ``metadata_props`` a dict) too."""
    if isinstance(proto.metadata_props, dict):
        proto.metadata_props[key] = value
        return
    for prop in proto.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    prop = proto.metadata_props.add()
    prop.key, prop.value = key, value


#: tensors of at least this many bytes go to the external-data file of a model over
#: :data:`~qdq.graphs.onnx_types.PROTOBUF_LIMIT` (smaller ones stay inline)
EXTERNAL_TENSOR_BYTES = 1024


#: the inputs of these ops that shape inference reads (sizes, scales, axes, pads): ONNX Runtime cannot read them
#: from an external-data file when it loads a model, so they stay inline whatever their size
_SHAPE_INPUTS = {"Resize": (1, 2, 3), "Upsample": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,),
                 "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "ConstantOfShape": (0,), "Squeeze": (1,),
                 "Unsqueeze": (1,), "Split": (1,), "TopK": (1,), "Range": (0, 1, 2), "OneHot": (1,),
                 "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,)}  # fmt: skip


def _keep_shape_tensors_inline(model: onnx.ModelProto) -> None:
    """Undo the external-data mark of the initializers read where shape inference needs their values."""
    from onnx import TensorProto

    read = {node.input[i] for node in model.graph.node for i in _SHAPE_INPUTS.get(node.op_type, ())
            if i < len(node.input) and node.input[i]}  # fmt: skip
    for tensor in model.graph.initializer:
        if tensor.name in read and tensor.data_location == TensorProto.EXTERNAL:
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]


def atomic_save(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` atomically: one self-contained file (a temporary file in the same folder, then
    ``os.replace``), or, over :data:`~qdq.graphs.onnx_types.PROTOBUF_LIMIT`, the model file with its tensors in
    ``<name>.data`` beside it (each written to a temporary name first, the data before the model)."""
    if model.ByteSize() < onnx_types.PROTOBUF_LIMIT:
        write_bytes_atomic(path, model.SerializeToString())
        return
    import os
    import tempfile

    import onnx

    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as folder:
        staged = Path(folder) / path.name
        onnx.external_data_helper.convert_model_to_external_data(
            model, all_tensors_to_one_file=True, location=f"{path.name}.data", size_threshold=EXTERNAL_TENSOR_BYTES)
        _keep_shape_tensors_inline(model)
        onnx.save(model, str(staged))
        data = Path(folder) / f"{path.name}.data"
        if data.exists():  # no tensor over the threshold: the model file alone
            os.replace(data, path.parent / f"{path.name}.data")
        os.replace(staged, path)
    # onnx.save moved the tensors' bytes out of ``model``: put them back, the caller's model is left as it was
    onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
