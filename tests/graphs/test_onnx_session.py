"""The one ONNX Runtime session factory runs a float16 Q/DQ graph as TensorRT computes it: unoptimized.

The graph is a TensorRT 11 file in small: float32 edges, a float16 Conv between int8 Q/DQ, its weight steps small
enough that ORT's optimizer (WeightBiasQuantization, from ORT_ENABLE_BASIC on) rounds the Conv's float16 bias to
int32 on a float16 product of the steps that underflows: the optimized session loses the bias. The oracle computes
the file the TensorRT way in numpy: int8 codes exactly, the float part stored in float16 with float32 arithmetic."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.graphs.onnx_session import UNOPTIMIZED_NOTE, low_precision_qdq, ort_session, session_options

_S1, _S2 = np.float16(4e-3), np.float16(0.02)  # input and output steps
_SW = np.array([2e-5, 4e-5, 1e-3, 2e-3], np.float16)  # the Conv's weight steps per output channel
_BIAS = np.array([0.5, 0.8, 0.3, 0.05], np.float16)


def _weights() -> np.ndarray:
    return np.random.default_rng(1).integers(-127, 128, (4, 4, 3, 3)).astype(np.int8)


def _qdq_conv(low: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """x (float32) -> Cast -> Q/DQ -> Conv(DQ(int8 weight), bias) -> Relu -> Q/DQ -> Cast -> y (float32)."""
    kind = np.float16 if low == TensorProto.FLOAT16 else np.float32
    inits = [numpy_helper.from_array(np.asarray(_S1, kind), "s1"), numpy_helper.from_array(np.asarray(_S2, kind), "s2"),
             numpy_helper.from_array(np.array(0, np.int8), "z"), numpy_helper.from_array(_weights(), "w"),
             numpy_helper.from_array(_SW.astype(kind), "sw"), numpy_helper.from_array(np.zeros(4, np.int8), "zw"),
             numpy_helper.from_array(_BIAS.astype(kind), "b")]  # fmt: skip
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=low),
             helper.make_node("QuantizeLinear", ["x16", "s1", "z"], ["q1"]),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["dw"], axis=0),
             helper.make_node("Conv", ["d1", "dw", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
             helper.make_node("Cast", ["d2"], ["y"], to=TensorProto.FLOAT)]  # fmt: skip
    graph = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _tensorrt_oracle(x: np.ndarray) -> np.ndarray:
    """The file computed as TensorRT does: int8 codes exact, float16 tensors, float32 accumulation."""
    f32 = np.float32
    d1 = (np.clip(np.rint(x.astype(np.float16).astype(f32) / f32(_S1)), -128, 127) * f32(_S1)).astype(np.float16)
    weight = (_weights().astype(f32) * _SW.astype(f32)[:, None, None, None]).astype(np.float16).astype(f32)
    padded = np.pad(d1.astype(f32), ((0, 0), (0, 0), (1, 1), (1, 1)))
    patches = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # [1, C_in, 8, 8, 3, 3]
    conv = np.einsum("nchwij,ocij->nohw", patches, weight) + _BIAS.astype(f32)[None, :, None, None]
    r = np.maximum(conv.astype(np.float16).astype(f32), 0)
    return (np.clip(np.rint(r / f32(_S2)), -128, 127) * f32(_S2)).astype(np.float16).astype(f32)


def _input() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(1, 4, 8, 8)).astype(np.float32)


def test_the_factory_runs_a_float16_qdq_graph_as_tensorrt_computes_it_where_the_optimizer_does_not():
    model, x = _qdq_conv(), _input()
    assert low_precision_qdq(model) == "float16"
    expected = _tensorrt_oracle(x)
    got = ort_session(model, session_options(threads=1)).run(None, {"x": x})[0]  # "all" asked: unoptimized run
    assert np.abs(got - expected).max() <= float(_S2) * 1.001  # a rounding tie at most one output step apart
    assert np.mean(got == expected) >= 0.99
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    optimized = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert np.abs(optimized.run(None, {"x": x})[0] - expected).max() >= 10 * float(_S2)  # the bias lost


def test_a_float32_qdq_graph_keeps_the_level_asked():
    model = _qdq_conv(TensorProto.FLOAT)
    assert low_precision_qdq(model) is None
    options = session_options(threads=1)
    ort_session(model, options)
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_verify_of_a_float16_file_says_how_onnx_runtime_computed_it(tmp_path):
    fp16 = tmp_path / "fp16.onnx"
    onnx.save(_qdq_conv(), str(fp16))
    reference = tmp_path / "fp32.onnx"
    onnx.save(_qdq_conv(TensorProto.FLOAT), str(reference))
    result = qdq.verify(str(reference), str(fp16), [{"x": _input()}], "onnxruntime", threads=1)
    assert result.how == UNOPTIMIZED_NOTE.format(type="float16")
    assert str(result).endswith("\nrun on ONNX Runtime without graph optimizations: float16 as TensorRT computes it")
