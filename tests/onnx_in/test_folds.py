"""The folds of onnx_in's preparation (qdq.onnx_in.folds: onnxscript rewriter rules, qdq's guards) on small graphs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq.onnx_in.load import prepare


def conv_batchnorm(training_outputs: bool = False) -> onnx.ModelProto:
    """x -> Conv(w, b) -> BatchNormalization(scale, shift, mean, var) -> y (optionally also writing its training
    outputs, which nothing reads)."""
    rng = np.random.default_rng(0)
    arrays = {"w": rng.normal(size=(4, 3, 3, 3)), "b": rng.normal(size=4), "scale": rng.uniform(0.5, 2, 4),
              "shift": rng.normal(size=4), "mean": rng.normal(size=4), "var": rng.uniform(0.1, 3, 4)}  # fmt: skip
    outputs = ["y", "running_mean", "running_var"] if training_outputs else ["y"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], outputs, name="bn",
                              epsilon=1e-3, **({"training_mode": 1} if training_outputs else {}))]  # fmt: skip
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def test_a_batchnorm_folds_into_its_conv_in_float64_rounded_once():
    """onnxscript's FuseBatchNormIntoConv, computed in float64 and rounded once to float32 (qdq's numerics); the
    conv keeps its name."""
    model = conv_batchnorm()
    values = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    assert prepare(model)["batchnorms_folded"] == 1
    (conv,) = model.graph.node
    folded = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    factor = values["scale"] / np.sqrt(values["var"] + np.float32(1e-3))
    weight = (values["w"] * factor.reshape(-1, 1, 1, 1)).astype(np.float32)
    bias = ((values["b"] - values["mean"]) * factor + values["shift"]).astype(np.float32)
    assert conv.name == "conv" and list(conv.output) == ["y"]
    assert np.array_equal(folded[conv.input[1]], weight) and np.array_equal(folded[conv.input[2]], bias)


def test_a_batchnorm_in_training_mode_is_not_folded():
    """It normalizes with the batch's own statistics (onnxscript's rule would fold it: its other outputs are unread)."""
    model = conv_batchnorm(training_outputs=True)
    assert prepare(model)["batchnorms_folded"] == 0
    assert [n.op_type for n in model.graph.node] == ["Conv", "BatchNormalization"]
