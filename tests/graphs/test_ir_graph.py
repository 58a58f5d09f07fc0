"""The onnx_ir graph helpers (qdq.graphs.ir_graph) on small hand-built graphs: every expected value is read off
the graph as drawn in the builders' docstrings."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.ir_graph import (
    add_const,
    attr,
    const,
    const_input,
    fresh_name,
    graph_readers,
    graphs_of,
    hand_over,
    holders,
    inferred_dims,
    make_node,
    mark_main,
    name_of,
    only_readers,
    readers,
    readers_through,
    remove,
    run_on_graph,
    single_reader,
    source,
    subgraphs,
    take_place,
    tidy,
)


def graph() -> onnx.ModelProto:
    """x -> Transpose -> t -> Relu -> r -> (Add with itself) -> a -> Mul(a, c) -> y, with a Constant c = 2.0, an
    initializer ``unused`` that nothing reads; graph outputs y and t (t also read by the Relu)."""
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
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 1, 2, 2]) for name in ("y", "t")],
        initializer=[numpy_helper.from_array(np.ones(3, np.float32), "unused")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def branched() -> onnx.ModelProto:
    """``y = If(flag)``; its ``then`` branch reads the main graph's x and initializer w: ``m__8 = Mul(x, w)``,
    ``s = Sigmoid(x)`` (read by nothing), ``t = Neg(m__8)``, returns t; its ``else`` branch ``e = Relu(x)``, returns
    e. The model's names: x, flag, w, y, m__8, s, t, e (8)."""
    then = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["m__8"], name="mul"),
         helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"),
         helper.make_node("Neg", ["m__8"], ["t"], name="neg")],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )  # fmt: skip
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="relu")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])  # fmt: skip
    nodes = [helper.make_node("If", ["flag"], ["y"], name="if", then_branch=then, else_branch=other)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]
    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, [w]),
                             opset_imports=[helper.make_opsetid("", 18)])  # fmt: skip


def on_ir(model: onnx.ModelProto) -> tuple[ir.Model, dict[str, ir.Value]]:
    """``model`` as onnx_ir, with its values by name (the subgraphs' included)."""
    ir_model = ir.serde.deserialize_model(model)
    return ir_model, ir.convenience.create_value_mapping(ir_model.graph)


def names(nodes) -> list[str | None]:
    return [None if n is None else n.name for n in nodes]


def test_constants_and_attributes():
    _, v = on_ir(graph())
    mul, transpose = v["y"].producer(), v["t"].producer()
    assert const(v["unused"]).tolist() == [1.0, 1.0, 1.0]  # an initializer
    assert const(v["c"]) == np.float32(2.0) and const(v["c"]).dtype == np.float32  # a Constant node's output
    assert const(v["x"]) is None and const(v["r"]) is None and const(None) is None
    assert const_input(mul, 1) == np.float32(2.0)
    assert const_input(mul, 0) is None and const_input(mul, 2) is None and const_input(mul, 5) is None  # out of range
    assert list(attr(transpose, "perm")) == [0, 1, 3, 2]
    assert attr(transpose, "axis") is None and attr(transpose, "axis", 7) == 7  # absent: the default
    assert name_of(v["x"]) == "x" and name_of(None) == "value" and name_of(None, "w") == "w"
    assert name_of(ir.Value(), "stem") == "stem"  # a value without a name


def test_readers():
    _, v = on_ir(graph())
    assert names(readers(v["r"])) == ["add", "add"]  # once per input slot: Add reads r twice
    assert names(readers(v["t"])) == ["relu"] and readers(v["y"]) == [] and readers(v["unused"]) == []
    assert single_reader(v["x"]).name == "transpose" and single_reader(v["a"]).name == "mul"
    assert single_reader(v["r"]) is None  # two reads (by one node)
    assert single_reader(v["t"]) is None  # a graph output, though the Relu is its one reader
    assert single_reader(v["y"]) is None and single_reader(None) is None
    assert names(only_readers(v["r"], ("Add", "Mul"))) == ["add", "add"]  # every reader of an allowed type
    assert names(only_readers(v["a"], ["Mul"])) == ["mul"]
    assert only_readers(v["r"], ("Mul",)) is None  # a reader of another type
    assert only_readers(v["t"], ("Relu",)) is None  # a graph output
    assert only_readers(v["y"], ("Mul",)) is None and only_readers(v["unused"], ("Mul",)) is None  # no reader


def test_walks_look_through_the_given_ops():
    _, v = on_ir(graph())
    assert source(v["r"]).name == "relu" and source(v["c"]).name == "const"
    assert source(v["r"], through={"Relu"}).name == "transpose"
    assert source(v["r"], through=("Relu", "Transpose")) is None  # back to the graph input
    assert source(v["x"]) is None and source(v["unused"]) is None and source(None) is None
    assert source(v["y"], through={"Relu"}).name == "mul"  # a Mul is not looked through
    assert names(readers_through(v["x"], ())) == ["transpose"]
    assert names(readers_through(v["x"], {"Transpose"})) == [None, "relu"]  # t is a graph output, read by the Relu
    assert names(readers_through(v["r"], {"Add"})) == ["mul"]  # a, written once, looked at once
    assert names(readers_through(v["t"], {"Relu", "Add"})) == [None, "mul"]  # t itself is an output
    assert names(readers_through(v["y"], {"Mul"})) == [None]


def test_reads_inside_a_branch_are_the_inner_nodes():
    model, v = on_ir(branched())
    main = model.graph
    (if_node,) = main
    then_graph = next(g for g in subgraphs(if_node) if g.name == "then")
    assert sorted(g.name for g in subgraphs(if_node)) == ["else", "then"] and subgraphs(then_graph.node(0)) == []
    assert [g.name for g in graphs_of(main)] == ["g", "else", "then"]  # outer first; helper sorts the attributes
    assert sorted(names(readers(v["x"]))) == ["mul", "relu", "sigmoid"]  # not the If: its inner nodes
    assert single_reader(v["w"]) is then_graph.node(0)  # the main graph's initializer, read in the branch
    assert single_reader(v["x"]) is None and names(only_readers(v["w"], {"Mul"})) == ["mul"]
    assert names(readers(v["flag"])) == ["if"]


def test_graph_readers_credit_a_branch_read_to_its_if_once():
    model, v = on_ir(branched())
    held = holders(model.graph)
    (if_node,) = model.graph
    assert sorted(held) == sorted(id(g) for g in subgraphs(if_node))  # both branches belong to the If
    assert names(graph_readers(v["x"], held)) == ["if"]  # three reads in two branches: the If, once
    assert names(graph_readers(v["flag"], held)) == ["if"]  # its own read: once, not again for its branches
    then_graph = next(g for g in subgraphs(if_node) if g.name == "then")
    assert names(graph_readers(v["m__8"], holders(then_graph))) == ["neg"]  # as the branch sees its own value


def test_fresh_names_are_unique_across_the_model_and_never_reused():
    model, v = on_ir(branched())
    mark_main(model)  # as qdq.graphs.onnx.on_ir does
    main = model.graph
    then_graph = next(g for g in subgraphs(main.node(0)) if g.name == "then")
    defined = {"x", "flag", "w", "y", "m__8", "s", "t", "e"}
    assert set(v) == defined
    # <stem>__<n> from n = the number of names in use (8): m__8 is the branch's, so the next one
    assert fresh_name(main, "m") == "m__9"
    assert fresh_name(main, "m") == "m__10"  # m__9 was handed out, though nothing holds it
    assert fresh_name(then_graph, "m") == "m__11"  # the branch shares the main graph's list
    assert fresh_name(main, "t") == "t__11"
    assert set(ir.convenience.create_value_mapping(main)) == defined  # naming adds no value


def test_a_branch_asking_first_avoids_the_main_graph_names():
    model, _ = on_ir(branched())
    mark_main(model)
    then_graph, else_graph = sorted(subgraphs(model.graph.node(0)), key=lambda g: g.name != "then")
    # 8 names in use: a branch listing only its own (x, w... read; m__8, s, t written) would start lower and collide
    first = fresh_name(then_graph, "m")
    assert first == "m__9" and fresh_name(else_graph, "m") == "m__10"  # one list, whichever graph asks


def test_add_const_and_make_node():
    model, v = on_ir(graph())
    g = model.graph
    array = np.array([3.0, 4.0], np.float32)
    scale = add_const(g, "scale", array)
    array[0] = 9.0  # copied: the initializer keeps 3.0
    assert scale.name.startswith("scale__") and scale.name not in v and g.initializers[scale.name] is scale
    assert const(scale).tolist() == [3.0, 4.0] and scale.dtype == ir.DataType.FLOAT and list(scale.shape) == [2]
    other = add_const(g, "scale", np.zeros((2, 1), np.int8))
    assert other.name != scale.name and const(other).dtype == np.int8 and list(other.shape) == [2, 1]
    mul = v["y"].producer()
    node = make_node(g, "Transpose", [v["a"]], "a_t", name="extra", perm=[0, 1, 3, 2])
    assert node.graph is None and node.name == "extra" and node.op_type == "Transpose" and node.domain == ""
    assert node.inputs == (v["a"],) and list(attr(node, "perm")) == [0, 1, 3, 2] and len(node.outputs) == 1
    assert node.outputs[0].name.startswith("a_t__") and node.outputs[0].name not in (*v, scale.name, other.name)
    assert make_node(g, "Relu", [], "a_t").outputs[0].name != node.outputs[0].name
    g.insert_before(mul, node)
    mul.replace_input_with(0, node.outputs[0])
    assert names(g) == ["transpose", "relu", "add", "const", "extra", "mul"]
    assert source(v["y"], through={"Mul", "Transpose"}).name == "add"  # back through the new node


def test_remove_detaches_the_reads():
    model, v = on_ir(graph())
    g = model.graph
    add, mul = v["a"].producer(), v["y"].producer()
    mul.replace_input_with(0, v["r"])  # a is read by nothing now
    assert names(readers(v["r"])) == ["add", "add", "mul"]
    remove(g, [add, add])  # each once
    assert names(g) == ["transpose", "relu", "const", "mul"] and add.graph is None
    assert names(readers(v["r"])) == ["mul"]  # the Add's two reads gone
    remove(g, [])
    assert len(g) == 4


def test_remove_finds_the_graph_of_a_branch_node():
    model, v = on_ir(branched())
    then_graph = next(g for g in subgraphs(model.graph.node(0)) if g.name == "then")
    sigmoid = then_graph.node(1)
    remove(model.graph, [sigmoid])  # given the main graph; the node is the branch's
    assert names(then_graph) == ["mul", "neg"] and sorted(names(readers(v["x"]))) == ["mul", "relu"]


def tidy_graph() -> onnx.ModelProto:
    """``i = Identity(w)`` (an initializer), ``j = Identity(x)`` (the graph input), ``y = Mul(j, i)``,
    ``n = Neg(x)`` read by nothing, ``k_out = Identity(k)`` a graph output; initializers w, k, unused."""
    nodes = [
        helper.make_node("Identity", ["w"], ["i"], name="identity_of_w"),
        helper.make_node("Identity", ["x"], ["j"], name="identity_of_x"),
        helper.make_node("Mul", ["j", "i"], ["y"], name="mul"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Identity", ["k"], ["k_out"], name="identity_of_k"),
    ]
    constants = {"w": np.float32(2.0), "k": np.float32(3.0), "unused": np.ones(3, np.float32)}
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "k_out")],
        initializer=[numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_tidy_bypasses_an_identity_of_an_initializer_and_removes_what_nothing_reads():
    model, v = on_ir(tidy_graph())
    g = model.graph
    tidy(model)
    # the Identity of w is bypassed; that of x is not (not a constant), that of k writes a graph output; Neg unread
    assert names(g) == ["identity_of_x", "mul", "identity_of_k"]
    mul = g.node(1)
    assert mul.inputs[0] is v["j"] and mul.inputs[1] is v["w"]
    assert sorted(g.initializers) == ["k", "w"]  # unused goes
    assert [o.name for o in g.outputs] == ["y", "k_out"] and [i.name for i in g.inputs] == ["x"]
    tidy(model)  # nothing left to do
    assert names(g) == ["identity_of_x", "mul", "identity_of_k"] and sorted(g.initializers) == ["k", "w"]


def test_tidy_removes_the_initializers_nothing_reads_inside_a_branch():
    # then: y = x * a (a the branch's own), the unread z stays nowhere; else: y = x * w (w the main graph's)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    const = lambda name, v: numpy_helper.from_array(np.full(2, v, np.float32), name)  # noqa: E731
    then = helper.make_graph([helper.make_node("Mul", ["x", "a"], ["y_then"], name="mul_then")], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [2])],
                             [const("a", 2.0), const("z", 3.0)])  # fmt: skip
    other = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y_else"], name="mul_else")], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [2])])  # fmt: skip
    g = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="if")], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [out], [const("w", 4.0)],
    )  # fmt: skip
    model, _ = on_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    tidy(model)
    branch = model.graph.node(0).attributes["then_branch"].value
    assert sorted(branch.initializers) == ["a"]  # z goes: nothing reads it
    assert sorted(model.graph.initializers) == ["w"]  # read inside the else branch only: kept
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)


def test_inferred_dims_leave_the_model_as_it_was():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    t = helper.make_tensor_value_info("t", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0])]
    model = ir.serde.deserialize_model(helper.make_model(helper.make_graph(nodes, "g", [x], [t]),
                                                         opset_imports=[helper.make_opsetid("", 18)]))  # fmt: skip
    assert inferred_dims(model) == {"x": [None, 3], "t": [3, None]}  # n is symbolic
    assert model.graph.outputs[0].shape is None  # the model keeps its recorded types


def test_run_on_graph_edits_the_protobuf_in_place_and_returns_what_the_edit_returns():
    model = graph()

    def bypass(g: ir.Graph, op_type: str) -> int:
        doomed = [node for node in g if node.op_type == op_type]
        for node in doomed:
            node.outputs[0].replace_all_uses_with(node.inputs[0])
        remove(g, doomed)
        return len(doomed)

    assert run_on_graph(model, bypass, "Relu") == 1
    assert [n.name for n in model.graph.node] == ["transpose", "add", "const", "mul"]
    assert list(model.graph.node[1].input) == ["t", "t"]
    assert [o.name for o in model.graph.output] == ["y", "t"] and [t.name for t in model.graph.initializer] == [
        "unused"]  # fmt: skip
    assert run_on_graph(model, bypass, "Relu") == 0 and len(model.graph.node) == 4


def test_take_place_and_hand_over_keep_a_graph_outputs_name_type_and_shape():
    model, v = on_ir(graph())  # t = Transpose(x): a graph output, read by the Relu too
    main, t = model.graph, v["t"]
    neg = make_node(main, "Neg", [v["x"]], "t_other", name="neg")  # another node computing t
    main.insert_before(main.node(0), neg)
    take_place(t, neg.outputs[0])
    assert neg.outputs[0].name == "t" and neg.outputs[0].shape == ir.Shape([1, 1, 2, 2])
    assert [o.name for o in main.outputs] == ["y", "t"] and main.outputs[1] is neg.outputs[0]
    assert names(readers(neg.outputs[0])) == ["relu"] and not list(t.uses())
    sigmoid = make_node(main, "Sigmoid", [None], "after", name="sigmoid")  # then a node after it takes its place
    main.insert_after(neg, sigmoid)
    fresh = sigmoid.outputs[0].name
    out = hand_over(neg.outputs[0], sigmoid)
    assert out is sigmoid.outputs[0] and out.name == "t" and neg.outputs[0].name == fresh
    assert main.outputs[1] is out and names(readers(out)) == ["relu"] and names(readers(neg.outputs[0])) == ["sigmoid"]
    assert out.shape == ir.Shape([1, 1, 2, 2])
