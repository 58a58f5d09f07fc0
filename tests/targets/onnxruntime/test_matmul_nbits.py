"""Block-quantized MatMul weights (``MatMulNBits``) for the MatMuls a Q/DQ file runs in float."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.targets.onnxruntime.passes.matmul_nbits import float_weight_matmuls, matmul_nbits

K, N = 96, 24


def _graph() -> onnx.ModelProto:
    """Three MatMuls: ``float_mm`` (float input, constant float weight: the one to convert), ``q_mm`` (dequantized
    input and int8 weight: ONNX Runtime's int8 path already) and ``act_mm`` (a second activation, no weight)."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(K, N)).astype(np.float32)
    w2 = rng.integers(-127, 128, size=(N, N)).astype(np.int8)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["y1"], name="float_mm"),
        helper.make_node("QuantizeLinear", ["y1", "s", "z"], ["y1_q"], name="q"),
        helper.make_node("DequantizeLinear", ["y1_q", "s", "z"], ["y1_dq"], name="dq"),
        helper.make_node("DequantizeLinear", ["w2", "ws"], ["w2_dq"], name="w_dq"),
        helper.make_node("MatMul", ["y1_dq", "w2_dq"], ["y2"], name="q_mm"),
        helper.make_node("MatMul", ["y1", "v"], ["y3"], name="act_mm"),
    ]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "z"),
             numpy_helper.from_array(np.float32(0.01), "ws")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [N, 5])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y1", "y2", "y3")],
        inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_only_float_matmuls_on_constant_weights_are_chosen():
    assert float_weight_matmuls(_graph()) == ["float_mm"]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_converted_matmul_computes_its_stored_block_weights(bits):
    """The oracle decodes the stored weights by MatMulNBits' definition (codes packed low nibble first along K,
    ``(code - 2^(bits-1)) * scale`` per block of 32 without stored zero points): each decoded weight is within one
    step of the float weight, and ONNX Runtime's product differs from ``x @ decoded`` by at most what rounding the
    activation to int8 can do (one step of its row's absmax / 127 per element, summed over the reduction axis)."""
    model = _graph()
    converted = matmul_nbits(model, ["float_mm"], bits=bits)
    ops = [n.op_type for n in converted.graph.node]
    assert ops.count("MatMulNBits") == 1 and ops.count("MatMul") == 2  # q_mm and act_mm untouched
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 0  # the caller's model is unchanged
    node = next(n for n in converted.graph.node if n.op_type == "MatMulNBits")
    assert len(node.input) == 3  # symmetric: no zero points stored
    stored = {t.name: numpy_helper.to_array(t) for t in converted.graph.initializer}
    codes, scales = stored[node.input[1]], stored[node.input[2]].reshape(N, K // 32)
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(N, K // 32, 32)
    decoded = ((codes.astype(np.float64) - 2 ** (bits - 1)) * scales[..., None]).reshape(N, K).T  # [K, N]
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1")).astype(np.float64)
    step = np.abs(np.repeat(scales.T, 32, axis=0))  # [K, N]; ORT stores a negative scale where -absmax is -2^(bits-1)
    assert (np.abs(decoded - w) <= step * (1 + 1e-6)).all()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, K)).astype(np.float32)
    feed = {"x": x, "v": rng.normal(size=(N, 5)).astype(np.float32)}
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    y = session.run(["y1"], feed)[0]
    expected = x.astype(np.float64) @ decoded
    bound = np.abs(x).max(axis=1, keepdims=True) / 127.0 @ np.abs(decoded).sum(axis=0, keepdims=True)
    error = np.abs(y - expected)
    assert (error <= bound * (1 + 1e-5) + 1e-5).all()
    assert np.abs(y - x.astype(np.float64) @ w).max() > 0  # it did quantize


def test_bad_widths_are_refused():
    with pytest.raises(ValueError, match="4 or 8 bits"):
        matmul_nbits(_graph(), ["float_mm"], bits=3)
    with pytest.raises(ValueError, match="power of two"):
        matmul_nbits(_graph(), ["float_mm"], block_size=24)
