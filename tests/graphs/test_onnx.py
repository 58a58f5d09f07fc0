"""The ONNX graph index (qdq.graphs.onnx.GraphIndex) and node removal, on a small hand-built graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.onnx import GraphIndex, remove_nodes, sort_nodes, tidy, unique_value_names


def graph() -> onnx.ModelProto:
    """x -> Transpose -> Relu -> (Add with itself) -> y, plus a Constant c read by Mul."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "r"], ["a"], name="add"),
        helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(np.float32(2.0))),
        helper.make_node("Mul", ["a", "c"], ["y"], name="mul"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])],
        initializer=[numpy_helper.from_array(np.ones(3, np.float32), "unused")],
    )
    return helper.make_model(g)


def names(nodes) -> list[str | None]:
    return [None if n is None else n.name for n in nodes]


def test_maps():
    index = GraphIndex(graph())
    assert index.producer["r"].name == "relu" and "x" not in index.producer
    assert names(index.consumers["r"]) == ["add", "add"]  # read twice by one node
    assert set(index.constants) == {"unused", "c"}  # initializers and Constant outputs
    assert index.array("c") == np.float32(2.0) and index.array("x") is None
    assert (index.inputs, index.outputs) == ({"x"}, {"y"})
    assert index.single_reader("t").name == "relu"
    assert index.single_reader("r") is None  # two reads
    assert index.single_reader("y") is None  # a graph output
    assert names(index.only_readers("r", ("Add", "Mul"))) == ["add", "add"]  # every reader of an allowed type
    assert index.only_readers("r", ("Mul",)) is None  # a reader of another type
    assert index.only_readers("y", ("Mul",)) is None and index.only_readers("nothing", ("Mul",)) is None
    assert index.const_input(index.producer["y"], 1) == np.float32(2.0)
    assert index.const_input(index.producer["y"], 0) is None and index.const_input(index.producer["y"], 5) is None


def test_walks_look_through_the_given_ops():
    index = GraphIndex(graph())
    assert index.source("r").name == "relu"
    assert index.source("t", through={"Transpose"}) is None  # back to the graph input
    assert names(index.readers("x")) == ["transpose"]
    assert names(index.readers("x", through={"Transpose"})) == ["relu"]
    assert names(index.readers("a")) == ["mul"] and names(index.readers("y")) == [None]


def test_edits_keep_the_maps_current():
    model = graph()
    index = GraphIndex(model)
    name = index.add_const("scale", np.array([3.0], np.float32))
    assert name.startswith("scale") and index.array(name).tolist() == [3.0] and name != index.add_const("scale", [1])
    index.rewire("a", "r")  # Mul now reads the Relu's output
    assert list(index.producer["y"].input) == ["r", "c"] and "a" not in index.consumers
    assert names(index.consumers["r"]) == ["add", "add", "mul"]
    index.remove([index.producer["a"]])
    assert [n.name for n in model.graph.node] == ["transpose", "relu", "const", "mul"]
    assert names(index.consumers["r"]) == ["mul"]
    identity = helper.make_node("Identity", ["r"], ["i"], name="identity")
    index.insert(index.producer["y"], identity)
    index.insert(index.producer["r"], helper.make_node("Identity", ["t"], ["j"], name="after"), after=True)
    index.refresh()
    assert [n.name for n in model.graph.node] == ["transpose", "relu", "after", "const", "identity", "mul"]
    assert index.producer["i"].name == "identity"


def test_remove_nodes_and_tidy():
    model = graph()
    remove_nodes(model, [model.graph.node[1], model.graph.node[2]])
    assert [n.name for n in model.graph.node] == ["transpose", "const", "mul"]
    remove_nodes(model, [])
    assert len(model.graph.node) == 3
    tidy(model)  # the unused initializer goes; the Constant is read by Mul and stays
    assert [t.name for t in model.graph.initializer] == [] and "const" in [n.name for n in model.graph.node]


def test_sort_nodes_moves_a_node_only_behind_what_it_reads():
    model = graph()
    nodes = model.graph.node
    relu = nodes[1]
    nodes.remove(relu)
    nodes.append(relu)  # transpose, add, const, mul, relu: add and (through it) mul read relu before it runs
    sort_nodes(model)
    assert [n.name for n in model.graph.node] == ["transpose", "relu", "add", "const", "mul"]
    sort_nodes(model)  # already an order: unchanged
    assert [n.name for n in model.graph.node] == ["transpose", "relu", "add", "const", "mul"]


def maps(index: GraphIndex) -> tuple[dict[str, str], dict[str, list[str]], set[str]]:
    producer = {name: node.name for name, node in index.producer.items()}
    readers = {name: sorted(n.name for n in nodes) for name, nodes in index.consumers.items() if nodes}
    return producer, readers, set(index.constants)


def test_edits_leave_the_maps_a_fresh_index_builds_and_the_nodes_in_place():
    model = graph()
    index = GraphIndex(model)
    relu, mul = index.producer["r"], index.producer["y"]
    index.set_input(mul, 1, index.add_const("two", np.array([2.0], np.float32)))  # Mul reads a new constant
    index.set_output(relu, 0, "r2")
    index.set_input(index.producer["a"], 0, "r2")
    index.set_input(index.producer["a"], 1, None)  # Add now reads one input
    index.set_input(index.producer["a"], 1, "r2")  # appended
    index.remove([index.producer["c"]])  # the Constant nobody reads any more
    assert maps(index) == maps(GraphIndex(model))
    assert mul is model.graph.node[-1] and relu is model.graph.node[1]  # the objects held stay the graph's nodes
    assert "c" not in index.constants and "c" not in index.producer


def test_unique_value_names_renames_what_branches_define_again_on_onnx_ir():
    """Both branches define ``c``, as the main graph does: each branch's ``c`` is renamed, with its reads and its
    value_info; the main graph's ``c`` and the branch's read of the main graph's weight stay; the round trip leaves the
    value_info and the metadata as they were."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["c"]), helper.make_node("Neg", ["c"], ["t"])],
                             "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])  # fmt: skip
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])  # fmt: skip
    then.value_info.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [2]))
    nodes = [helper.make_node("Relu", ["x"], ["c"], name="relu"),
             helper.make_node("If", ["flag"], ["y"], name="if", then_branch=then, else_branch=other)]  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(
        np.ones(2, np.float32), "w")], value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])]))
    helper.set_model_props(model, {"b": "2", "a": "1"})
    assert unique_value_names(model) == 2
    branches = {a.name: a.g for a in model.graph.node[1].attribute}
    assert [list(n.output) for n in branches["then_branch"].node] == [["c__2"], ["t"]]  # else_branch comes first
    assert list(branches["then_branch"].node[1].input) == ["c__2"] and list(branches["then_branch"].node[0].input) == [
        "x", "w"]  # fmt: skip
    assert [v.name for v in branches["then_branch"].value_info] == ["c__2"]
    assert [o.name for o in branches["else_branch"].output] == ["c__1"]
    assert list(model.graph.node[0].output) == ["c"] and [v.name for v in model.graph.value_info] == ["c"]
    assert [p.key for p in model.metadata_props] == ["b", "a"] and [t.name for t in model.graph.initializer] == ["w"]


def test_an_output_declared_with_another_rank_than_the_graph_computes_takes_the_computed_shape():
    """ONNX's strict shape inference (``onnx.checker`` with ``full_check``) refuses a declared output rank the graph
    does not compute; a declaration of the right rank, named dims included, is kept as written."""
    from qdq.graphs.onnx import declare_computed_output_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 5])
    stale = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])  # rank 2: the Relu computes rank 3
    named = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "rows", "cols"])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["z"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [stale, named]),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    with pytest.raises(onnx.shape_inference.InferenceError, match="differ in rank"):
        onnx.checker.check_model(model, full_check=True)
    assert declare_computed_output_shapes(model) == 1
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output}
    assert shapes == {"y": ["n", 4, 5], "z": ["batch", "rows", "cols"]}
    onnx.checker.check_model(model, full_check=True)
    assert declare_computed_output_shapes(model) == 0  # nothing left to change


def test_the_export_check_takes_the_computed_rank_only_for_a_file_it_writes():
    """The check before a write (``declared=True``): a stale output rank a rewrite left is declared as computed and
    the file passes; any other check of the same graph still refuses it."""
    from qdq.errors import QdqExportError
    from qdq.export.onnx_export import _check

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    with pytest.raises(QdqExportError, match="differ in rank"):
        _check(model)
    _check(model, declared=True)
    assert len(model.graph.output[0].type.tensor_type.shape.dim) == 3
