"""Integer and boolean results in a TensorRT 11 float16 file: index outputs (``ArgMax``, ``TopK`` indices) of a
CNN + BiLSTM reader, and comparisons (``Greater(scores, 0.25)``) whose float input computes in float16 while their
other input is a float32 constant: every input bound to one type parameter must have one type."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.graphs.onnx_session import ort_session
from qdq.targets.tensorrt.check import check_tensorrt


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.5) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.normal(size=shape) * scale).astype(np.float32), name)


def _reader() -> onnx.ModelProto:
    """Opset 12, width W dynamic: Conv -> Relu -> Transpose/Reshape to [W, 1, 16] -> bidirectional LSTM -> MatMul +
    Add -> [1, W, 5] scores; outputs the ArgMax index [1, W] (int64), the TopK index squeezed [1, W] (int64) and
    the score's maximum kept where above 0.25 (a comparison and a Where)."""
    rng = np.random.default_rng(0)
    inits = [_init("conv.w", (4, 1, 3, 3), rng), _init("conv.b", (4,), rng), _init("lstm.W", (2, 32, 16), rng),
             _init("lstm.R", (2, 32, 8), rng), _init("lstm.B", (2, 64), rng), _init("fc.w", (16, 5), rng),
             _init("fc.b", (5,), rng), numpy_helper.from_array(np.array([-1, 1, 16], np.int64), "seq_shape"),
             numpy_helper.from_array(np.array([1], np.int64), "k"),
             numpy_helper.from_array(np.array(0.25, np.float32), "threshold"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Transpose", ["r"], ["t"], name="to_sequence", perm=[3, 0, 1, 2]),
             helper.make_node("Reshape", ["t", "seq_shape"], ["s"], name="flatten"),
             helper.make_node("LSTM", ["s", "lstm.W", "lstm.R", "lstm.B"], ["h"], name="lstm", hidden_size=8,
                              direction="bidirectional"),
             helper.make_node("Transpose", ["h"], ["ht"], name="directions", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["ht", "seq_shape"], ["f"], name="features"),
             helper.make_node("MatMul", ["f", "fc.w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "fc.b"], ["logits"], name="fc_bias"),
             helper.make_node("Transpose", ["logits"], ["scores"], name="batch_first", perm=[1, 0, 2]),
             helper.make_node("ArgMax", ["scores"], ["index"], name="argmax", axis=2, keepdims=0),
             helper.make_node("TopK", ["scores", "k"], ["top", "top_index"], name="topk", axis=2),
             helper.make_node("Squeeze", ["top_index"], ["top_index_2d"], name="squeeze", axes=[2]),
             helper.make_node("ReduceMax", ["scores"], ["best"], name="best", axes=[2], keepdims=0),
             helper.make_node("Greater", ["best", "threshold"], ["kept"], name="above"),
             helper.make_node("Where", ["kept", "best", "zero"], ["confidence"], name="confidence")]  # fmt: skip
    outputs = [helper.make_tensor_value_info("index", TensorProto.INT64, [1, "W"]),
               helper.make_tensor_value_info("top_index_2d", TensorProto.INT64, [1, "W"]),
               helper.make_tensor_value_info("confidence", TensorProto.FLOAT, [1, "W"])]  # fmt: skip
    graph = helper.make_graph(nodes, "reader", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, "W"])],
                              outputs, inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def test_a_recurrent_readers_index_outputs_and_a_comparison_survive_the_float16_export(tmp_path):
    rng = np.random.default_rng(1)
    data = [{"x": rng.normal(size=(1, 1, 4, 6 + 2 * k)).astype(np.float32)} for k in range(3)]
    files = {}
    for kind in ("float32", "float16"):
        result = qdq.quantize_onnx(_reader(), data, tmp_path / f"{kind}.onnx", target="tensorrt",
                                   target_options={"float": kind}, progress=False, method="max")  # fmt: skip
        report = check_tensorrt(result.path)
        assert report.ok, str(report)
        files[kind] = result.path
    model = onnx.load(str(files["float16"]))
    (above,) = [n for n in model.graph.node if n.op_type == "Greater"]
    inits = {t.name: t.data_type for t in model.graph.initializer}
    assert inits[above.input[1]] == TensorProto.FLOAT16  # the threshold follows the scores into float16
    feed = {"x": rng.normal(size=(1, 1, 4, 9)).astype(np.float32)}
    (i32, _, c32), (i16, t16, c16) = (ort_session(files[k]).run(None, feed) for k in ("float32", "float16"))
    assert i16.dtype == t16.dtype == np.int64 and i16.shape == t16.shape == (1, 9)
    assert np.mean(i16 == i32) >= 0.75 and np.array_equal(i16, t16)  # float16 may flip a near tie
    np.testing.assert_allclose(c16, c32, atol=0.05)


def test_a_float_output_declared_with_a_rank_the_graph_does_not_compute_is_written_as_computed(tmp_path):
    """The held-back captcha reader's crash, its family on this graph: the scores [1, W, 5] are also an output, whose
    declaration says [1, W] (an exporter's stale shape). ONNX's strict shape inference refuses the file as it comes;
    every file qdq writes from it (both targets, float16 too, where the float32 Cast before the output failed the
    check: "Inferred shape and existing shape differ in rank: (3) vs (2)") declares the computed rank, said once."""
    model = _reader()
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, "W"]))
    try:
        onnx.checker.check_model(model, full_check=True)
        raise AssertionError("the generated graph should fail strict shape inference")
    except onnx.shape_inference.InferenceError as err:
        assert "differ in rank" in str(err)
    rng = np.random.default_rng(1)
    data = [{"x": rng.normal(size=(1, 1, 4, 6 + 2 * k)).astype(np.float32)} for k in range(3)]
    cases = (("onnxruntime", {}), ("tensorrt", {"float": "float32"}), ("tensorrt", {"float": "float16"}))
    for target, options in cases:
        result = qdq.quantize_onnx(model, data, tmp_path / f"{target}_{options.get('float')}.onnx", target=target,
                                   target_options=options, progress=False, method="max")  # fmt: skip
        written = onnx.load(str(result.path))
        onnx.checker.check_model(written, full_check=True)
        (scores,) = [v for v in written.graph.output if v.name == "scores"]
        assert len(scores.type.tensor_type.shape.dim) == 3 and result.prepared["output_shapes"] == 1
        assert result.report().count("declared with a rank the graph does not compute") == 1
        out = ort_session(result.path).run(["scores"], {"x": data[0]["x"]})[0]
        assert out.shape == (1, 6, 5)
