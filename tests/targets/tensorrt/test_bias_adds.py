"""Adds that are no residual add TensorRT fuses into a weighted op, where placement and the rule check agree:

* a linear exported as ``MatMul`` + bias ``Add`` (a GRU denoiser's layers, any transformer's): TensorRT fuses the
  bias into the MatMul; a residual add after such a linear is found through its bias;
* an Add of a conv's output that other ops read too (``x + x * HardSigmoid(x)``, PP-OCR's detector): the conv
  cannot take the Add into its kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.targets.tensorrt.check import check_tensorrt


def _linear_model(residual: bool) -> onnx.ModelProto:
    """x -> MatMul(W1) -> Add(b1) [-> Add(x)] -> Relu -> MatMul(W2): two linears, the first with its bias apart."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
             for name, shape in (("W1", (8, 8)), ("b1", (8,)), ("W2", (8, 4)))]  # fmt: skip
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"], name="MatMul_23"),
             helper.make_node("Add", ["b1", "m1"], ["a1"], name="Add_24")]  # fmt: skip
    last = "a1"
    if residual:
        nodes.append(helper.make_node("Add", ["a1", "x"], ["sum"], name="residual"))
        last = "sum"
    nodes += [helper.make_node("Relu", [last], ["r1"], name="Relu_25"),
              helper.make_node("MatMul", ["r1", "W2"], ["y"], name="MatMul_26")]  # fmt: skip
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 4])], inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _data() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(1, 5, 8)).astype(np.float32)} for _ in range(2)]


@pytest.mark.parametrize("float_type", ["float32", "float16"])
def test_a_bias_add_after_a_matmul_is_no_residual_add(tmp_path, float_type):
    result = qdq.quantize_onnx(_linear_model(residual=False), _data(), tmp_path / "q.onnx", target="tensorrt",
                               target_options={"float": float_type}, progress=False, method="max")  # fmt: skip
    report = check_tensorrt(result.path)
    assert report.ok, str(report)
    assert report.int8_ops == 2
    adds = [n for n in onnx.load(str(result.path)).graph.node if n.op_type == "Add"]
    assert len(adds) == 1 and not any("DequantizeLinear" in name for name in adds[0].input)  # the bias stays float


@pytest.mark.parametrize("float_type", ["float32", "float16"])
def test_a_residual_add_after_a_biased_matmul_quantizes_its_shortcut(tmp_path, float_type):
    result = qdq.quantize_onnx(_linear_model(residual=True), _data(), tmp_path / "q.onnx", target="tensorrt",
                               target_options={"float": float_type}, progress=False, method="max")  # fmt: skip
    report = check_tensorrt(result.path)
    assert report.ok, str(report)
    model = onnx.load(str(result.path))
    producers = {o: n for n in model.graph.node for o in n.output}
    (residual,) = [n for n in model.graph.node if n.name == "residual"]
    kinds = [producers[name].op_type for name in residual.input]
    assert kinds == ["Add", "DequantizeLinear"]  # the linear's output fused, the shortcut read in int8


def test_an_add_of_a_conv_output_other_ops_read_is_no_residual_add(tmp_path):
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(size=(2, 4, 1, 1)).astype(np.float32), "w2")]  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("HardSigmoid", ["c"], ["gate"], name="gate"),
             helper.make_node("Mul", ["c", "gate"], ["swish"], name="swish"),
             helper.make_node("Add", ["c", "swish"], ["sum"], name="sum"),
             helper.make_node("Conv", ["sum", "w2"], ["y"], name="head")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    data = [{"x": rng.normal(size=(1, 3, 6, 6)).astype(np.float32)} for _ in range(2)]
    result = qdq.quantize_onnx(model, data, tmp_path / "q.onnx", target="tensorrt", progress=False, method="max")
    report = check_tensorrt(result.path)
    assert report.ok, str(report)
    assert report.int8_ops == 2
