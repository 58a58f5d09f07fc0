"""Functions of qdq.graphs.onnx that take an onnx.ModelProto, on small hand-built graphs: names made unique across
control-flow branches, declared output shapes brought in line with the computed ones, and the check before an
export writes a file. (The onnx_ir graph helpers: tests/graphs/test_ir_graph.py.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.onnx import on_ir, unique_value_names


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
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            inputs,
            outputs,
            [numpy_helper.from_array(np.ones(2, np.float32), "w")],
            value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
        )
    )
    helper.set_model_props(model, {"b": "2", "a": "1"})
    assert on_ir(model, unique_value_names) == [2]
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
