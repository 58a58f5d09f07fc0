"""ONNX models as protobuf: the one round trip to onnx_ir, and what qdq does on the protobuf itself.

:func:`on_ir` runs edits on a model as an ``onnx_ir.Model`` (onnx_ir passes, onnxscript rule sets, qdq's passes
written on onnx_ir with :mod:`qdq.graphs.ir_graph`) in one round trip, the model updated in place: every graph
edit in qdq goes through it. What stays on protobuf here is what wraps a model rather than edits its graph:
names (:func:`name_nodes`, :func:`rename_io`; :func:`unique_value_names` is an onnx_ir edit), declared output shapes,
metadata, atomic saving with external data, and the walk of every node (:func:`all_nodes`) for protobuf readers.

The Q/DQ nodes qdq exported, tagged with their quantizers, are read back by :mod:`qdq.graphs.onnx_tags`.

Imports neither torch nor (at import time) onnx or onnx_ir.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdq.atomic import write_bytes_atomic
from qdq.graphs import onnx_types

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "all_nodes",
    "atomic_save",
    "clear_output_shapes",
    "declare_computed_output_shapes",
    "initializer_map",
    "name_nodes",
    "on_ir",
    "rename_io",
    "restore_output_shapes",
    "set_metadata",
    "subgraphs",
    "unique_value_names",
]


def feed_inputs(model: onnx.ModelProto) -> list[Any]:
    """The main graph's inputs a batch feeds, in order (their ``ValueInfoProto``): every input that is not an
    initializer (an old export lists its initializers among its inputs)."""
    constants = {t.name for t in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in constants]


def initializer_map(model: onnx.ModelProto) -> dict[str, Any]:
    """Name -> TensorProto of initializers and of the outputs of Constant nodes."""
    table: dict[str, Any] = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            table[node.output[0]] = node.attribute[0].t
    return table


def subgraphs(node: Any) -> list[Any]:
    """The graphs of ``node``'s attributes (an ``If``'s branches, a ``Loop``'s body)."""
    return [g for attr in node.attribute for g in ([attr.g] if attr.HasField("g") else attr.graphs)]


def on_ir(model: onnx.ModelProto, *edits: Callable[[ir.Model], Any]) -> list[Any]:
    """Run ``edits`` (functions of an ``onnx_ir.Model``: its passes, a rule set's ``apply_to_model``) on ``model`` in
    place, in one round trip through onnx_ir; what each returned. What a round trip alone changes is undone (a
    ``value_info`` entry per initializer, the metadata's order)."""
    import onnx_ir

    from qdq.graphs.ir_graph import mark_main

    ir_model = onnx_ir.serde.deserialize_model(model)  # its tensors shared, not copied
    mark_main(ir_model)  # fresh names unique across the model's graphs
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


def all_nodes(graph: Any) -> list[Any]:
    """Every node of ``graph`` (an ``onnx.GraphProto``) and of the subgraphs of its control flow, outer first."""
    return [*graph.node, *(n for node in graph.node for inner in subgraphs(node) for n in all_nodes(inner))]


def unique_value_names(model: ir.Model) -> int:
    """Make every value name the model defines defined once: a name a subgraph (an ``If`` branch, a ``Loop`` body)
    defines (its inputs, initializers, node outputs) that an enclosing or earlier graph defines too is renamed
    ``<name>__<n>`` in that subgraph, wherever it is read. ONNX allows sibling branches to reuse a name; qdq reads
    every graph of a model as one (the ONNX front end's view, calibration's outputs, constants moved to the main
    graph). Returns how many names changed."""
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
            model, all_tensors_to_one_file=True, location=f"{path.name}.data", size_threshold=EXTERNAL_TENSOR_BYTES
        )
        _keep_shape_tensors_inline(model)
        onnx.save(model, str(staged))
        data = Path(folder) / f"{path.name}.data"
        if data.exists():  # no tensor over the threshold: the model file alone
            os.replace(data, path.parent / f"{path.name}.data")
        os.replace(staged, path)
    # onnx.save moved the tensors' bytes out of ``model``: put them back, the caller's model is left as it was
    onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
