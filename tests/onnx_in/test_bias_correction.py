"""qdq.onnx_in.bias_correction: each quantized layer's bias absorbs the mean error of its own quantization.

The expected shifts come from a numpy oracle: the layer computed by hand (padded patches, matrix products) on the
inputs and weights rounded to the grid the written file holds, against the same layer in float; a channel's shift
counts where it is significant against the sampling error of its mean over the samples (3 standard errors)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.onnx_in.bias_correction import correct_biases
from qdq.runtime import load_runtime


def _fq(x: np.ndarray, amax: np.ndarray | float) -> np.ndarray:
    """The signed 8-bit grid of ``amax`` (numpy: round half to even, clamp to [-128, 127]), dequantized."""
    step = (np.asarray(amax, np.float32) / np.float32(127.0)).astype(np.float32)
    return np.clip(np.rint(x / step), -128, 127) * step


def _conv2d(x: np.ndarray, w: np.ndarray, pads: tuple[int, int, int, int], stride: int, groups: int = 1,
            dilation: int = 1) -> np.ndarray:  # fmt: skip
    """NCHW conv without bias, ONNX pads ``(top, left, bottom, right)``, by explicit patches."""
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span = dilation * (w.shape[2] - 1) + 1
    rows, cols = (x.shape[2] - span) // stride + 1, (x.shape[3] - span) // stride + 1
    out = np.zeros((x.shape[0], w.shape[0], rows, cols))
    per_in, per_out = x.shape[1] // groups, w.shape[0] // groups
    for g in range(groups):
        xs, ws = x[:, g * per_in : (g + 1) * per_in], w[g * per_out : (g + 1) * per_out]
        for r in range(rows):
            for c in range(cols):
                patch = xs[:, :, r * stride : r * stride + span : dilation, c * stride : c * stride + span : dilation]
                out[:, g * per_out : (g + 1) * per_out, r, c] = np.einsum("nihw,oihw->no", patch, ws)
    return out


def _conv_model(path, weight, bias, pads=(1, 0, 2, 1), stride=2, share_bias=False, groups=1, dilation=1):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=list(pads), strides=[stride] * 2,
                              group=groups, dilations=[dilation] * 2)]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, weight.shape[0], None, None])]
    if share_bias:  # the bias is read by a second op too: correcting it would change that op
        nodes.append(helper.make_node("Add", ["y2in", "b"], ["y2"], name="other"))
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [None, 4]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 9, 9])]
    if share_bias:
        inputs.append(helper.make_tensor_value_info("y2in", TensorProto.FLOAT, [None, 4]))
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    weight = (
        rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * np.array([1, 0.1, 3, 0.5], np.float32)[:, None, None, None]
    )
    return weight, rng.normal(size=4).astype(np.float32)


def _data(count=3, seed=1, batch=5):
    rng = np.random.default_rng(seed)  # a skewed input: percentile calibration clips its long positive tail
    return [{"x": (rng.exponential(size=(batch, 3, 9, 9)) - 0.3).astype(np.float32)} for _ in range(count)]


def _measured(per_sample: np.ndarray) -> np.ndarray:
    """The oracle of the measurability rule: the mean error per channel over samples (``[N, C]``), 0 where it is
    below 3 standard errors of that mean."""
    mean = per_sample.mean(0)
    error = per_sample.std(0, ddof=1) / np.sqrt(per_sample.shape[0])
    return np.where(np.abs(mean) >= 3 * error, mean, 0.0)


def _bias_in(path) -> np.ndarray:
    graph = onnx.load(str(path)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    conv = next(n for n in graph.node if n.op_type == "Conv")
    return inits[conv.input[2]]


def test_a_conv_bias_is_shifted_by_the_mean_error_of_its_quantized_input_and_weights(tmp_path):
    weight, bias = _weights()
    data = _data(batch=40)
    result = qdq.quantize_onnx(_conv_model(tmp_path / "f.onnx", weight, bias), data, tmp_path / "q.onnx",
                               target="tensorrt", method="percentile", percentile=99.0, progress=False)  # fmt: skip
    amax_x = float(result.ranges[next(k for k in result.ranges if "input" in k)])
    x = np.concatenate([d["x"] for d in data]).astype(np.float64)
    w_q = _fq(weight, np.abs(weight).reshape(4, -1).max(1)[:, None, None, None])
    error = _conv2d(_fq(x, amax_x), w_q, (1, 0, 2, 1), 2) - _conv2d(x, weight, (1, 0, 2, 1), 2)
    shift = _measured(error.mean((2, 3)))
    assert np.abs(shift).max() > 1e-2  # the clipped tail makes a real shift
    assert list(result.bias_shifts[0].unmeasured) == [int(c) for c in np.flatnonzero(shift == 0)]
    np.testing.assert_allclose(_bias_in(result.path), bias - shift, rtol=0, atol=2e-5)
    assert [s.op for s in result.bias_shifts] == ["conv"]
    assert "Bias correction: 1 biases" in result.report()


def test_a_grouped_dilated_conv_is_corrected_by_the_oracle(tmp_path):
    """Three groups of one input channel and two outputs each, dilation 2, stride 1: the patch means per group."""
    rng = np.random.default_rng(5)
    weight = rng.normal(size=(6, 1, 3, 3)).astype(np.float32)
    bias = rng.normal(size=6).astype(np.float32)
    data = _data(seed=6, batch=40)
    result = qdq.quantize_onnx(_conv_model(tmp_path / "f.onnx", weight, bias, pads=(2, 1, 0, 2), stride=1, groups=3,
                                           dilation=2), data, tmp_path / "q.onnx", target="tensorrt",
                               method="percentile", percentile=99.0, progress=False)  # fmt: skip
    amax_x = float(result.ranges[next(k for k in result.ranges if "input" in k)])
    x = np.concatenate([d["x"] for d in data]).astype(np.float64)
    w_q = _fq(weight, np.abs(weight).reshape(6, -1).max(1)[:, None, None, None])
    args = ((2, 1, 0, 2), 1, 3, 2)
    shift = _measured((_conv2d(_fq(x, amax_x), w_q, *args) - _conv2d(x, weight, *args)).mean((2, 3)))
    assert np.count_nonzero(shift) >= 3
    np.testing.assert_allclose(_bias_in(result.path), bias - shift, rtol=0, atol=2e-5)


def test_bias_correction_removes_the_mean_error_on_held_out_data(tmp_path):
    """TensorRT's placement (no output quantizer, whose own clipping no bias can undo), run on ONNX Runtime."""
    weight, bias = _weights(3)
    source = _conv_model(tmp_path / "f.onnx", weight, bias)
    calibration, held_out = _data(4, seed=2, batch=64), _data(4, seed=9, batch=64)
    errors = {}
    for corrected in (False, True):
        path = qdq.quantize_onnx(source, calibration, tmp_path / f"q{corrected}.onnx", target="tensorrt",
                                 method="percentile", percentile=99.0, bias_correction=corrected,
                                 progress=False).path  # fmt: skip
        with load_runtime(source, "onnxruntime") as fp32, load_runtime(path, "onnxruntime") as int8:
            diff = np.concatenate([int8.run(d)[0] - fp32.run(d)[0] for d in held_out])
        errors[corrected] = np.abs(diff.mean((0, 2, 3))).max()
    assert errors[True] < errors[False] / 4, errors


def test_gemm_and_a_linear_matmul_are_corrected_by_the_oracle(tmp_path):
    rng = np.random.default_rng(4)
    w1, b1 = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=6).astype(np.float32)  # Gemm, transB=1
    w2, b2 = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)  # MatMul + Add
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="gemm", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b2"], ["y"], name="add")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
                              [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"),
                                                                          (b2, "b2"))])  # fmt: skip
    source = tmp_path / "f.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    data = [{"x": (rng.exponential(size=(512, 5)) - 0.5).astype(np.float32)} for _ in range(2)]
    result = qdq.quantize_onnx(source, data, tmp_path / "q.onnx", target="tensorrt", method="percentile",
                               percentile=99.0, progress=False)  # fmt: skip
    shifts = {s.op: s.shift for s in result.bias_shifts}
    assert sorted(shifts) == ["gemm", "matmul"]
    inputs = {k: float(v) for k, v in result.ranges.items() if v.ndim == 0}
    x = np.concatenate([d["x"] for d in data]).astype(np.float64)
    amax_x = next(v for k, v in inputs.items() if k.startswith("gemm"))
    expected = _measured(_fq(x, amax_x) @ _fq(w1, np.abs(w1).max(1)[:, None]).T - x @ w1.T)  # a sample: a row
    assert np.count_nonzero(expected) >= 1
    np.testing.assert_allclose(shifts["gemm"], expected, rtol=1e-4, atol=1e-6)
    # the MatMul's input is the float model's ReLU output (its own error only: the Gemm's correction is not in it),
    # on TensorRT's signed grid
    r = np.maximum(x @ w1.T + b1, 0)
    amax_r = next(v for k, v in inputs.items() if k.startswith("matmul"))
    expected = _measured(_fq(r, amax_r) @ _fq(w2, np.abs(w2).max(0)[None, :]) - r @ w2)
    assert np.count_nonzero(expected) >= 1
    np.testing.assert_allclose(shifts["matmul"], expected, rtol=1e-4, atol=1e-6)
    graph = onnx.load(str(result.path)).graph
    written = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    np.testing.assert_allclose(written["b2"], b2 - expected, rtol=0, atol=1e-5)


def test_without_bias_correction_or_with_a_shared_bias_the_biases_stay(tmp_path):
    weight, bias = _weights()
    data = _data()
    kept = qdq.quantize_onnx(_conv_model(tmp_path / "f.onnx", weight, bias), data, tmp_path / "q.onnx",
                             target="tensorrt", bias_correction=False, progress=False, method="max")  # fmt: skip
    np.testing.assert_array_equal(_bias_in(kept.path), bias)
    assert kept.bias_shifts == [] and "Bias correction" not in kept.report()
    shared = _conv_model(tmp_path / "s.onnx", weight, bias, share_bias=True)
    feed = [{**d, "y2in": np.zeros((5, 4), np.float32)} for d in data]
    result = qdq.quantize_onnx(shared, feed, tmp_path / "qs.onnx", target="tensorrt", progress=False, method="max")
    assert result.bias_shifts == []
    np.testing.assert_array_equal(_bias_in(result.path), bias)


def test_a_view_without_quantized_layers_changes_nothing(tmp_path):
    from qdq.graphs.view import GraphView

    model = onnx.load(str(_conv_model(tmp_path / "f.onnx", *_weights())))
    assert correct_biases(model, GraphView("onnx"), {}, [{"x": np.zeros((1, 3, 9, 9), np.float32)}]) == []


def test_shifts_of_an_earlier_call_are_applied_again_without_measuring(tmp_path, monkeypatch):
    from qdq.onnx_in import bias_correction

    weight, bias = _weights()
    source, data = _conv_model(tmp_path / "f.onnx", weight, bias), _data()
    first = qdq.quantize_onnx(source, data, tmp_path / "a.onnx", target="tensorrt", progress=False, method="max")
    monkeypatch.setattr(bias_correction, "probe_model", None)  # measuring would fail
    again = qdq.quantize_onnx(source, data[:1], tmp_path / "b.onnx", target="tensorrt", progress=False,
                              value_ranges=first.value_ranges, bias_shifts=first.bias_shifts, method="max")  # fmt: skip
    np.testing.assert_array_equal(_bias_in(again.path), _bias_in(first.path))
    floated = qdq.quantize_onnx(source, data[:1], tmp_path / "c.onnx", target="tensorrt", progress=False,
                                value_ranges=first.value_ranges, bias_shifts=first.bias_shifts,
                                float_values=["x"], method="max")  # fmt: skip
    assert floated.bias_shifts == []  # the conv runs float: its bias stays the file's
    np.testing.assert_array_equal(_bias_in(floated.path), bias)


def test_a_dead_channel_is_reported_as_constant_and_its_exact_shift_applied(tmp_path):
    """conv1's channel 1 has zero weights (its output is its bias, 0.37, everywhere); conv2's channel 0 reads only
    that channel: its output never varies, and its error (0.37 on the input's grid) is the same on every sample.
    The shift relative to a spread of 0 is no number: the channel is reported as constant, and its shift, measured
    exactly, is applied."""
    rng = np.random.default_rng(3)
    w1 = rng.normal(size=(3, 3, 1, 1)).astype(np.float32)
    w1[1] = 0.0
    b1 = np.array([0.1, 0.37, -0.2], np.float32)
    w2 = rng.normal(size=(2, 3, 1, 1)).astype(np.float32)
    w2[0, [0, 2]] = 0.0
    b2 = np.zeros(2, np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="conv1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="conv2")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2, 4, 4])],
                              [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"),
                                                                          (b2, "b2"))])  # fmt: skip
    source = tmp_path / "f.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    data = [{"x": rng.normal(size=(4, 3, 4, 4)).astype(np.float32)} for _ in range(2)]
    result = qdq.quantize_onnx(source, data, tmp_path / "q.onnx", target="tensorrt", progress=False, method="max")
    shifts = {s.op: s for s in result.bias_shifts}
    assert 1 in shifts["conv1"].constant and shifts["conv1"].shift[1] == 0  # zero weights: no error at all
    assert shifts["conv2"].constant == (0,) and np.isfinite(shifts["conv2"].relative) and shifts["conv2"].relative < 1
    amax_r = float(next(v for k, v in result.ranges.items() if k.startswith("conv2") and v.ndim == 0))
    w_q = _fq(w2[0, 1], np.abs(w2[0]).max())
    np.testing.assert_allclose(shifts["conv2"].shift[0], (w_q * _fq(np.float32(0.37), amax_r) - w2[0, 1] * 0.37).item(),
                               rtol=1e-5)  # fmt: skip
    assert "constant channels (no output spread)" in result.report()


def _conv_in_if(path, weight, bias):
    """``y = If(flip) {then: Conv(x, w, b), else: Conv(x, w_else, b_else)}`` (the conv of ``_conv_model``): the
    layers inside the branches, their weights the main graph's."""

    def branch(name, w, b):
        conv = helper.make_node("Conv", ["x", w, b], [f"{name}_y"], name=f"{name}_conv", pads=[1, 0, 2, 1],
                                strides=[2, 2])  # fmt: skip
        out = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [None, 4, None, None])
        return helper.make_graph([conv], name, [], [out])

    node = helper.make_node("If", ["flip"], ["y"], name="if", then_branch=branch("then", "w", "b"),
                            else_branch=branch("else", "w_else", "b_else"))  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 9, 9]),
              helper.make_tensor_value_info("flip", TensorProto.BOOL, [])]  # fmt: skip
    inits = [numpy_helper.from_array(a, n) for a, n in ((weight, "w"), (bias, "b"), (weight * 2, "w_else"),
                                                         (bias * 2, "b_else"))]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, None, None])]
    graph = helper.make_graph([node], "g", inputs, outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_convs_inside_if_branches_are_corrected_as_in_the_main_graph(tmp_path):
    """Each branch's conv reads the graph input ``x``: both are measured on it (a conv of the branch no batch takes
    too: its input is reached) and corrected by the oracle of the same conv in a main graph."""
    weight, bias = _weights()
    data = [{**batch, "flip": np.array(True)} for batch in _data(batch=40)]
    result = qdq.quantize_onnx(_conv_in_if(tmp_path / "f.onnx", weight, bias), data, tmp_path / "q.onnx",
                               target="tensorrt", method="percentile", percentile=99.0, progress=False)  # fmt: skip
    amax_x = float(result.ranges[next(k for k in result.ranges if "input" in k)])
    x = np.concatenate([d["x"] for d in data]).astype(np.float64)
    written = onnx.load(str(result.path))
    inits = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    assert sorted(s.op for s in result.bias_shifts) == ["else_conv", "then_conv"]
    branches = {a.name: a.g for a in written.graph.node[-1].attribute}
    for branch, w, b in (("then_branch", weight, bias), ("else_branch", weight * 2, bias * 2)):
        w_q = _fq(w, np.abs(w).reshape(4, -1).max(1)[:, None, None, None])
        error = _conv2d(_fq(x, amax_x), w_q, (1, 0, 2, 1), 2) - _conv2d(x, w, (1, 0, 2, 1), 2)
        shift = _measured(error.mean((2, 3)))
        assert np.abs(shift).max() > 1e-2
        conv = next(n for n in branches[branch].node if n.op_type == "Conv")
        np.testing.assert_allclose(inits[conv.input[2]], b - shift, rtol=0, atol=4e-5)
