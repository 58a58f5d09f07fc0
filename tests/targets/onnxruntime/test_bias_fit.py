"""A depthwise conv whose int32 bias does not fit at ``s_x * s_w`` (a channel of near-zero weights, so a tiny
per-channel step, and a large bias: EfficientNet-Lite's and PP-OCR's depthwise convs after BatchNorm folding):
the channel's weight step is widened until the bias fits, and the conv keeps its int8 kernel."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.runtime.ort import fusion_report, inference_session, session_options
from qdq.targets.onnxruntime.passes.biases import BIAS_CODE_LIMIT, WIDENED_METADATA_KEY


def _depthwise(path) -> str:
    """x -> depthwise Conv (channel 2: weights ~1e-7, bias 40) -> Relu -> pointwise Conv -> y."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(4, 1, 3, 3)).astype(np.float32)
    weight[2] *= 1e-7
    bias = np.array([0.1, -0.2, 40.0, 0.3], np.float32)
    inits = [numpy_helper.from_array(weight, "dw.weight"), numpy_helper.from_array(bias, "dw.bias"),
             numpy_helper.from_array(rng.normal(size=(2, 4, 1, 1)).astype(np.float32) * 0.1, "pw.weight"),
             numpy_helper.from_array(np.zeros(2, np.float32), "pw.bias")]  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "dw.weight", "dw.bias"], ["dw"], name="dw", group=4, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["dw"], ["act"], name="relu"),
             helper.make_node("Conv", ["act", "pw.weight", "pw.bias"], ["y"], name="pw")]  # fmt: skip
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], inits)  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return str(path)


def test_a_bias_too_large_for_its_weight_step_widens_the_step_and_stays_int8(tmp_path):
    source = _depthwise(tmp_path / "dw.onnx")
    rng = np.random.default_rng(1)
    data = [{"x": rng.normal(size=(1, 4, 6, 6)).astype(np.float32)} for _ in range(2)]
    result = qdq.quantize_onnx(source, data, tmp_path / "q.onnx", target="onnxruntime", bias_correction=False,
                               target_options={"weights": "int8"}, progress=False, method="max")  # fmt: skip
    model = onnx.load(str(result.path))
    widened = json.loads({p.key: p.value for p in model.metadata_props}[WIDENED_METADATA_KEY])
    assert list(widened) == ["dw"] and widened["dw"] > 1.0 and result.widened_weights == widened
    assert "widened so that int32 biases fit: 1 op(s) kept int8 (largest: dw" in result.report()
    assert fusion_report(result.path, threads=1).count("QLinearConv") == 2  # both convs int8, none float
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (bias_dq,) = [n for n in model.graph.node if n.name == "dw/bias_DequantizeLinear"]
    codes, scale = consts[bias_dq.input[0]], consts[bias_dq.input[1]]
    assert codes.dtype == np.int32 and np.abs(codes).max() <= BIAS_CODE_LIMIT
    np.testing.assert_allclose(codes * scale.astype(np.float64), [0.1, -0.2, 40.0, 0.3], atol=float(scale.max()))
    feed = {"x": rng.normal(size=(1, 4, 6, 6)).astype(np.float32)}
    options = session_options(threads=1)
    reference, quantized = (inference_session(p, options).run(None, feed)[0] for p in (source, result.path))
    step = np.abs(reference).max() / 127
    assert np.abs(reference - quantized).max() <= 4 * step  # int8 rounding of three tensors, not the bias
