"""The ONNX graph index (qdq.graphs.onnx.GraphIndex) and node removal, on a small hand-built graph."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.onnx import GraphIndex, remove_nodes, sort_nodes, tidy


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
