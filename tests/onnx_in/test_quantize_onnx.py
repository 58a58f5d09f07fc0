"""qdq.quantize_onnx on small ONNX files, one test per thing ONNX files hold, both targets.

Each file is quantized on generated batches and then run on ONNX Runtime two ways: with its optimizations (its
int8 kernels, through qdq's session, exact on CPUs whose int8 dot products saturate) and with none (the Q/DQ graph
computed in float, the reference of what the file means). The two agree within one output step; the int8 file
stays near the float model's output; and the graph's Q/DQ sit where the target's rules say.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
from onnx_models import (
    Attention,
    ConvNet,
    DetectorHead,
    Recognizer,
    YoloBlocks,
    already_quantized,
    batches,
    constant_weight_conv,
    export,
    scale_shift_convs,
    with_custom_op,
    with_if,
)
from qdq.errors import QdqConfigError
from qdq.graphs.onnx_tags import qdq_sites
from qdq.onnx_in.load import prepare
from qdq.runtime.ort import fusion_report, inference_session, session_options


def run(path, feed, optimize: bool = True) -> list[np.ndarray]:
    options = session_options(threads=1, optimization_level="all" if optimize else "disable")
    return inference_session(path, options).run(None, feed)


def steps_apart(reference: np.ndarray, other: np.ndarray) -> float:
    return float(np.abs(reference - other).max() / (np.abs(reference).max() / 127))


def check_engine(path, float_path, feed, *, engine_steps: float = 1.0, float_steps: float = 12.0) -> None:
    """The int8 engine computes what the Q/DQ graph means, and stays near the float model."""
    engine, graph = run(path, feed)[0], run(path, feed, optimize=False)[0]
    assert steps_apart(graph, engine) <= engine_steps
    assert steps_apart(run(float_path, feed)[0], graph) <= float_steps


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_a_cnn_with_dynamic_axes_quantizes_for_both_targets(tmp_path, target):
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx",
                        dynamic={"images": {0: "batch", 2: "height", 3: "width"}})  # fmt: skip
    data = batches((2, 3, 16, 16)) + batches((3, 3, 24, 24), count=2, seed=2)  # any batch size, any spatial size
    result = qdq.quantize_onnx(float_path, data, tmp_path / "int8.onnx", target=target, progress=False, method="max")
    model = onnx.load(str(result.path))
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"] and result.batches == 5
    assert result.prepared["batchnorms_folded"] == 0  # the TorchScript exporter folded them already
    assert result.int8_ops["Conv"] == 4 and not result.float_op_types
    feed = batches((4, 3, 32, 20), count=1, seed=3)[0]
    check_engine(result.path, float_path, feed)
    if target == "onnxruntime":
        report = fusion_report(result.path)
        assert report.int8_kernels == {"com.microsoft:QLinearConv": 4} and not report.float_kernels
        assert not report.idle  # max-pool, resize and concatenation on int8 data: no standalone Q/DQ left


@pytest.mark.parametrize("method", ["entropy", "mse", "percentile", "auto"])
def test_every_method_keeps_the_max_pool_and_concatenation_in_int8(tmp_path, method):
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    result = qdq.quantize_onnx(float_path, batches((4, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               method=method, progress=False)  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 4} and not report.idle
    assert result.method.startswith(method)


@pytest.mark.parametrize("method", ["max", "percentile"])
def test_movers_of_an_unquantized_silu_output_run_on_int8_data(tmp_path, method):
    """A SiLU output that reaches int8 readers only through a Split, a MaxPool or a Resize is quantized before
    the mover, with one range for it and the mover's quantized reads: ONNX Runtime runs the product as
    QLinearMul and the mover on int8 data, with no DQ -> float op -> Q left."""
    torch.manual_seed(0)
    float_path = export(YoloBlocks(), torch.randn(1, 3, 16, 16), tmp_path / "yolo.onnx")
    result = qdq.quantize_onnx(float_path, batches((4, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               method=method, progress=False)  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 5} and not report.idle
    fused = {op: report.count(op) for op in ("QLinearMul", "QLinearSigmoid", "NhwcMaxPool", "QLinearConcat")}
    assert fused == {"QLinearMul": 4, "QLinearSigmoid": 4, "NhwcMaxPool": 4, "QLinearConcat": 3}
    check_engine(result.path, float_path, batches((2, 3, 16, 16), count=1, seed=6)[0])


def test_weights_in_constant_nodes_are_quantized_per_channel_as_int8_initializers(tmp_path):
    path = constant_weight_conv(tmp_path / "const.onnx")
    result = qdq.quantize_onnx(path, batches((2, 3, 8, 8), name="x"), tmp_path / "int8.onnx", target="tensorrt",
                               progress=False, method="max")  # fmt: skip
    assert result.prepared["constant_weights"] == 1 and result.prepared["opset"] == 13  # opset 12 raised
    model = onnx.load(str(result.path))
    inits = {t.name: t for t in model.graph.initializer}
    weights = [s for s in qdq_sites(model) if s.axis is not None]
    assert len(weights) == 2 and all(inits[s.input].data_type == onnx.TensorProto.INT8 for s in weights)
    assert {s.step.shape for s in weights} == {(4,), (2,)}  # one step per output channel
    check_engine(result.path, path, batches((2, 3, 8, 8), name="x", count=1, seed=5)[0])


def test_batchnorm_after_a_conv_is_folded_before_quantizing(tmp_path):
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    net[1].running_mean.uniform_(-1, 1)
    net[1].running_var.uniform_(0.5, 2)
    float_path = tmp_path / "bn.onnx"
    torch.onnx.export(net.eval(), (torch.randn(1, 3, 8, 8),), str(float_path), dynamo=False, opset_version=17,
                      input_names=["input"], dynamic_axes={"input": {0: "batch"}},
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)  # fmt: skip
    assert "BatchNormalization" in {n.op_type for n in onnx.load(str(float_path)).graph.node}
    result = qdq.quantize_onnx(float_path, batches((2, 3, 8, 8), name="input"), tmp_path / "int8.onnx",
                               target="tensorrt", progress=False, method="max")  # fmt: skip
    assert result.prepared["batchnorms_folded"] == 1
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(str(result.path)).graph.node}
    check_engine(result.path, float_path, batches((2, 3, 8, 8), name="input", count=1, seed=4)[0])


def test_a_constant_scale_and_shift_after_a_conv_is_folded_into_it(tmp_path):
    path = scale_shift_convs(tmp_path / "affine.onnx")
    model = onnx.load(str(path))
    counts = prepare(model)
    # Mul and Add after the first conv, the per-channel Mul at an output; the Add of a graph input stays
    assert counts["scale_shifts_folded"] == 3
    assert [n.op_type for n in model.graph.node] == ["Conv", "Relu", "Conv", "Conv", "Add"]
    assert [o.name for o in model.graph.output] == ["y1", "y2"]
    folded = tmp_path / "folded.onnx"
    onnx.save(model, str(folded))
    rng = np.random.default_rng(3)
    feed = {"x": rng.normal(size=(2, 3, 6, 6)).astype(np.float32),
            "x2": rng.normal(size=(2, 4, 6, 6)).astype(np.float32)}  # fmt: skip
    for want, got in zip(run(path, feed, optimize=False), run(folded, feed, optimize=False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # one float rounding apart
    result = qdq.quantize_onnx(path, [feed], tmp_path / "int8.onnx", target="onnxruntime", progress=False, method="max")
    assert result.prepared["scale_shifts_folded"] == 3 and result.int8_ops["Conv"] == 3


class _WrittenOutHardSwish(nn.Module):
    """conv -> x * clamp(x + 3, 0, 6) / 6 (the form Paddle2ONNX writes) -> conv -> (x * clamp(x + 3, 0, 6)) * 1/6."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        y = self.conv2(y * torch.clamp(y + 3, 0, 6) / 6)
        return y * torch.clamp(y + 3, 0, 6) * (1 / 6)


def test_a_written_out_hard_swish_becomes_one_op(tmp_path):
    torch.manual_seed(0)
    example = 4 * torch.randn(2, 3, 8, 8)  # values on both sides of -3 and 3
    path = tmp_path / "hswish.onnx"
    torch.onnx.export(_WrittenOutHardSwish().eval(), (example,), str(path), dynamo=False, opset_version=13,
                      input_names=["images"], output_names=["scores"])  # fmt: skip
    model = onnx.load(str(path))
    counts = prepare(model)
    assert counts["hard_swishes"] == 2 and counts["opset"] == 14  # HardSwish is an opset-14 op
    assert [n.op_type for n in model.graph.node] == ["Conv", "HardSwish", "Conv", "HardSwish"]
    fused = tmp_path / "fused.onnx"
    onnx.save(model, str(fused))
    feed = {"images": example.numpy()}
    np.testing.assert_allclose(run(fused, feed, optimize=False)[0], run(path, feed, optimize=False)[0], rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    result = qdq.quantize_onnx(path, [feed], tmp_path / "int8.onnx", target="onnxruntime", progress=False, method="max")
    assert result.prepared["hard_swishes"] == 2 and result.int8_ops["Conv"] == 2
    check_engine(result.path, path, feed)


def test_control_flow_and_custom_operators_stay_float_and_are_reported(tmp_path):
    path = with_if(tmp_path / "if.onnx")
    data = [{**b, "flip": np.array(False)} for b in batches((2, 3, 8, 8), name="x")]
    result = qdq.quantize_onnx(path, data, tmp_path / "int8.onnx", target="tensorrt", progress=False, method="max")
    assert "control flow" in next(why for name, why in result.float_ops.items() if name.startswith("If"))
    assert result.int8_ops["Conv"] == 2
    custom = with_custom_op(tmp_path / "custom.onnx")
    result = qdq.quantize_onnx(custom, batches((2, 3, 8, 8), name="x"), tmp_path / "int8c.onnx",
                               target="onnxruntime", progress=False, method="max")  # fmt: skip
    assert any("custom domain" in why for why in result.float_ops.values())
    check_engine(result.path, custom, batches((2, 3, 8, 8), name="x", count=1, seed=6)[0])


def test_a_quantized_file_and_missing_data_are_refused_with_one_clear_error(tmp_path):
    with pytest.raises(QdqConfigError, match=r"quantized already: it holds 1 QuantizeLinear, 1 DequantizeLinear"):
        qdq.quantize_onnx(
            already_quantized(tmp_path / "q.onnx"), batches((1, 3, 4, 4), name="x"), tmp_path / "o.onnx", method="max",
        )
    path = constant_weight_conv(tmp_path / "const.onnx")
    with pytest.raises(QdqConfigError, match="no calibration data"):
        qdq.quantize_onnx(path, [], tmp_path / "o.onnx", progress=False, method="max")
    with pytest.raises(QdqConfigError, match=r"no array for the graph input\(s\) \['x'\]"):
        qdq.quantize_onnx(
            path, [{"images": np.zeros((1, 3, 4, 4), np.float32)}], tmp_path / "o.onnx", progress=False, method="max",
        )
    with pytest.raises(QdqConfigError, match="no ONNX file"):
        qdq.quantize_onnx(tmp_path / "missing.onnx", [], tmp_path / "o.onnx", method="max")


def test_a_detector_output_concatenation_keeps_boxes_and_scores_apart(tmp_path):
    """ORT's quantize_static gives the concatenation of pixel boxes and 0-1 scores one scale, and the scores round
    to 0; qdq leaves that model output float, each input on its own grid."""
    torch.manual_seed(0)
    float_path = export(DetectorHead(), torch.rand(1, 3, 16, 16), tmp_path / "det.onnx")
    data = [{"images": np.random.default_rng(i).random((2, 3, 16, 16), np.float32)} for i in range(3)]
    result = qdq.quantize_onnx(
        float_path, data, tmp_path / "int8.onnx", target="onnxruntime", progress=False, method="max",
    )
    feed = data[0]
    scores, reference = run(result.path, feed)[0][:, 4:], run(float_path, feed)[0][:, 4:]
    assert np.abs(scores - reference).max() < 0.02  # the scores keep their own fine grid (the boxes reach 80)
    model = onnx.load(str(result.path))
    concat = next(n for n in model.graph.node if n.op_type == "Concat")
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == concat.output[0] for n in model.graph.node)


def test_silu_and_sigmoid_gates_run_as_int8_sigmoid_and_mul_on_onnx_runtime(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 1))
    float_path = export(net, torch.randn(1, 3, 8, 8), tmp_path / "silu.onnx")
    result = qdq.quantize_onnx(float_path, batches((2, 3, 8, 8)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False, method="max")  # fmt: skip
    sites = qdq_sites(onnx.load(str(result.path)))
    activations = [s for s in sites if s.axis is None]
    assert sum(s.zero_point.dtype == np.uint8 and int(s.zero_point) == 0 for s in activations) == 1  # the sigmoid
    check_engine(result.path, float_path, batches((2, 3, 8, 8), count=1, seed=7)[0])


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_attention_matmuls_between_activations_are_quantized(tmp_path, target):
    torch.manual_seed(0)
    float_path = export(Attention(), torch.randn(1, 6, 16), tmp_path / "attn.onnx", names=("tokens", "out"),
                        dynamic={"tokens": {0: "batch", 1: "sequence"}})  # fmt: skip
    data = [{"tokens": np.random.default_rng(i).normal(size=(2, 6 + i, 16)).astype(np.float32)} for i in range(3)]
    result = qdq.quantize_onnx(float_path, data, tmp_path / "int8.onnx", target=target, progress=False, method="max")
    # qkv and proj (Linear on 3-D input); Q·Kᵀ and probs·V, one Attention op, every input read quantized
    assert result.int8_ops == {"MatMul": 2, "Attention": 1}
    check_engine(result.path, float_path, data[0], float_steps=16.0)


def test_recurrent_layers_stay_float_and_the_convs_before_them_run_in_int8(tmp_path):
    torch.manual_seed(0)
    float_path = export(Recognizer(), torch.randn(1, 1, 8, 16), tmp_path / "crnn.onnx",
                        dynamic={"images": {0: "batch", 3: "width"}})  # fmt: skip
    result = qdq.quantize_onnx(float_path, batches((2, 1, 8, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False, method="max")  # fmt: skip
    model = onnx.load(str(result.path))
    lstm = next(n for n in model.graph.node if n.op_type == "LSTM")
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    assert all(producers.get(name) != "DequantizeLinear" for name in lstm.input if name)  # the LSTM reads float
    report = fusion_report(result.path)
    assert report.int8_kernels["com.microsoft:QLinearConv"] == 2
    check_engine(result.path, float_path, batches((2, 1, 8, 24), count=1, seed=8)[0])


def test_keep_float_by_name_op_type_and_pattern(tmp_path):
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    names = [n.name for n in onnx.load(str(float_path)).graph.node if n.op_type == "Conv"]
    result = qdq.quantize_onnx(float_path, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               keep_float=[names[-1], "op:Concat", "*mid*"], progress=False, method="max")  # fmt: skip
    assert result.float_ops[names[-1]] == "kept float by the user (by name)"
    assert "pattern '*mid*'" in result.float_ops[next(n for n in names if "mid" in n)]
    assert any(why.startswith("op type Concat") for why in result.float_ops.values())
    assert result.int8_ops.get("Conv") == 2


def test_models_over_two_gigabytes_go_through_external_data(tmp_path, monkeypatch):
    """The 2 GB limit, lowered for a small model: calibration runs from a file with external data, and the result
    is written as a model file and its data file."""
    from qdq.graphs import onnx as graph
    from qdq.graphs import onnx_types

    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    external = tmp_path / "external.onnx"
    onnx.save(onnx.load(str(float_path)), str(external), save_as_external_data=True, location="external.data",
              size_threshold=0)  # fmt: skip
    monkeypatch.setattr(onnx_types, "PROTOBUF_LIMIT", 1024)
    monkeypatch.setattr(graph, "EXTERNAL_TENSOR_BYTES", 0)  # every tensor to the data file, scales included
    result = qdq.quantize_onnx(external, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="tensorrt",
                               progress=False, method="max")  # fmt: skip
    assert (tmp_path / "int8.onnx.data").is_file()
    check_engine(result.path, float_path, batches((2, 3, 16, 16), count=1, seed=9)[0])


def test_calibration_memory_does_not_grow_with_the_number_of_batches(tmp_path):
    """What calibration keeps between batches is a fixed-size histogram per quantizer: its statistics after 2 and
    after 20 batches have the same size."""
    from qdq.onnx_in.calibrate import collect
    from qdq.onnx_in.load import load_float_model, prepare
    from qdq.onnx_in.view import KeepFloat, build_view, select_weighted
    from qdq.targets import get_target

    torch.manual_seed(0)
    model = load_float_model(export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx"))
    prepare(model)
    view = build_view(model, get_target("onnxruntime"))
    select_weighted(view, KeepFloat())
    sizes = []
    for count in (2, 20):
        stats = collect(model, view, batches((2, 3, 16, 16), count=count), "histogram", progress=False)
        sizes.append(sum(c.bin_counts.numel() for c in stats.calibrators.values()))
    assert sizes[0] == sizes[1]


def test_a_clipping_range_is_warned_once(tmp_path):
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    data = batches((2, 3, 16, 16))
    data[0]["images"][0, 0, 0, 0] = 400.0  # one outlier: percentile 90 clips it away
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qdq.quantize_onnx(float_path, data, tmp_path / "int8.onnx", method="percentile", percentile=90.0,
                                   progress=False)  # fmt: skip
    texts = [str(w.message) for w in caught if issubclass(w.category, qdq.QdqCalibrationWarning)]
    assert len(texts) == 1 and "clip" in texts[0] and result.calibration.flagged()
    assert {d.method for d in result.calibration.quantizers} == {"percentile 90.0"}
    assert len(result.calibration.quantizers) == result.quantizers - result.int8_ops["Conv"]  # all but the weights


def test_a_tensorrt_11_file_holds_int8_weights_fp16_elsewhere_and_passes_the_rule_check(tmp_path):
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx", dynamic={"images": {0: "b"}})
    data = batches((2, 3, 16, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # steps on float16's grid from the start: no rounding at export to warn of
        fp16 = qdq.quantize_onnx(float_path, data, tmp_path / "fp16.onnx", target="tensorrt",
                                 target_options={"float": "fp16"}, progress=False, method="max")  # fmt: skip
    fp32 = qdq.quantize_onnx(float_path, data, tmp_path / "fp32.onnx", target="tensorrt", progress=False, method="max")
    report = qdq.export.check_tensorrt(fp16.path)
    assert report.ok, str(report)
    model = onnx.load(str(fp16.path))
    constants = {t.name: t for t in model.graph.initializer}
    weights = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants]
    assert len(weights) == 4 and all(constants[n.input[0]].data_type == onnx.TensorProto.INT8 for n in weights)
    scales = [onnx.numpy_helper.to_array(constants[n.input[1]]) for n in model.graph.node
              if n.op_type == "DequantizeLinear"]  # fmt: skip
    assert all(s.dtype == np.float16 for s in scales)
    float32_ranges = {name: amax for name, amax in fp32.ranges.items()}
    for name, amax in fp16.ranges.items():  # each range moved at most to the nearest float16 step
        np.testing.assert_allclose(amax, float32_ranges[name], rtol=2**-10)
    feed = batches((2, 3, 16, 16), count=1, seed=5)[0]
    assert steps_apart(run(fp32.path, feed)[0], run(fp16.path, feed)[0]) <= 2.0  # FP16 arithmetic, not more


class WideConvs(nn.Module):
    """Two 32-channel convs with folded BatchNorms (non-zero biases), as in a small ResNet's first block."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())  # fmt: skip
        with torch.no_grad():
            for bn in (self.body[1], self.body[4]):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_onnx_runtime_runs_a_float16_file_as_its_q_dq_graph_means(tmp_path):
    """ONNX Runtime's WeightBiasQuantization pass rewrites the float16 bias of the first Conv (whose input step is
    float32) as int32 (0.4 output steps off here, 17 dB instead of 39 on a digits ResNet); qdq's sessions leave it
    out for float16 files, so the optimized session computes what the graph computes node by node."""
    torch.manual_seed(0)
    float_path = export(WideConvs(), torch.randn(1, 1, 28, 28), tmp_path / "net.onnx")
    data = batches((4, 1, 28, 28))
    fp16 = qdq.quantize_onnx(float_path, data, tmp_path / "fp16.onnx", target="tensorrt",
                             target_options={"float": "fp16"}, progress=False, method="max")  # fmt: skip
    feed = batches((4, 1, 28, 28), count=1, seed=7)[0]
    optimized, written = run(fp16.path, feed)[0], run(fp16.path, feed, optimize=False)[0]
    assert steps_apart(written.astype(np.float32), optimized.astype(np.float32)) <= 0.05  # float16 rounding only


def test_a_file_exported_by_qdq_does_not_hand_its_records_to_the_quantized_file(tmp_path):
    """An FP32 file written by qdq.export_onnx for ONNX Runtime records its weight encoding (``qdq.weights``); the
    tensorrt file quantized from it stores int8 weights, so it must not say uint8 (the runtimes trust that record
    and would skip the re-encoding that keeps int8 weights exact on a CPU without VNNI)."""
    from qdq.targets.onnxruntime.passes.weight_encoding import WEIGHTS_METADATA_KEY, recorded_weights

    torch.manual_seed(0)
    float_path = qdq.export_onnx(WideConvs().eval(), torch.randn(1, 1, 28, 28), tmp_path / "fp32.onnx",
                                 target="onnxruntime")  # fmt: skip
    source = onnx.load(str(float_path))
    onnx.helper.set_model_props(source, {WEIGHTS_METADATA_KEY: "uint8", "qdq.target": "onnxruntime", "user": "kept"})
    onnx.save(source, str(float_path))
    name = source.graph.input[0].name
    data = [{name: b["images"]} for b in batches((4, 1, 28, 28))]
    result = qdq.quantize_onnx(float_path, data, tmp_path / "trt.onnx", target="tensorrt", progress=False, method="max")
    model = onnx.load(str(result.path))
    meta = {p.key: p.value for p in model.metadata_props}
    assert recorded_weights(model) is None and meta["qdq.target"] == "tensorrt" and meta["user"] == "kept"
    constants = {t.name: t for t in model.graph.initializer}
    weights = [n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants]
    assert weights and all(constants[w].data_type == onnx.TensorProto.INT8 for w in weights)


@pytest.mark.parametrize("target, low, unsigned", [("onnxruntime", 0.0, True), ("onnxruntime", -0.5, False),
                                                   ("tensorrt", 0.0, False)])  # fmt: skip
def test_an_input_the_data_shows_non_negative_gets_the_uint8_grid_where_the_target_has_one(tmp_path, target, low,
                                                                                          unsigned):  # fmt: skip
    """Images in [0, 1]: ONNX Runtime's uint8 grid [0, amax] (zero point 0, step amax / 255: half the signed
    step); TensorRT has signed int8 only; data with a negative value keeps the signed grid (int8, or the same grid
    as uint8 with zero point 128 where ONNX Runtime's rewrite moves it)."""
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    rng = np.random.default_rng(0)
    data = [{"images": rng.uniform(low, 1.0, size=(2, 3, 16, 16)).astype(np.float32)} for _ in range(3)]
    result = qdq.quantize_onnx(float_path, data, tmp_path / "int8.onnx", target=target, method="max",
                               progress=False)  # fmt: skip
    graph = onnx.load(str(result.path)).graph
    quantize = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "images")
    inits = {t.name: t for t in graph.initializer}
    zero = inits[quantize.input[2]]
    grid = (zero.data_type, int(onnx.numpy_helper.to_array(zero)))
    signed = {(onnx.TensorProto.INT8, 0), (onnx.TensorProto.UINT8, 128)}
    assert grid == (onnx.TensorProto.UINT8, 0) if unsigned else grid in signed
    step = float(onnx.numpy_helper.to_array(inits[quantize.input[1]]))
    amax = max(float(np.max(np.abs(b["images"]))) for b in data)
    levels = 255 if unsigned else 127
    assert step == pytest.approx(np.float32(amax) / levels, rel=1e-3)


def test_a_constant_of_shape_feeding_float_math_is_retyped_for_tensorrt_11(tmp_path):
    """YOLOv8's anchor grid: ConstantOfShape (a float32 fill value) added to other float math; in the FP16 file its
    fill value is float16 too (else the Add reads two types and the file is invalid)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    fill = numpy_helper.from_array(np.array([0.5], np.float32), "fill")
    nodes = [helper.make_node("Conv", ["images", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["conv"], ["shape"], name="shape"),
             helper.make_node("ConstantOfShape", ["shape"], ["half"], name="half", value=fill),
             helper.make_node("Add", ["conv", "half"], ["scores"], name="add")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [None, 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], [weight])  # fmt: skip
    float_path = tmp_path / "anchors.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(float_path))
    data = batches((2, 3, 8, 8))
    result = qdq.quantize_onnx(float_path, data, tmp_path / "trt.onnx", target="tensorrt",
                               target_options={"float": "fp16"}, progress=False, method="max")  # fmt: skip
    onnx.checker.check_model(onnx.load(str(result.path)), full_check=True)
    assert qdq.export.check_tensorrt(result.path).ok
    fill_type = next(a.t.data_type for n in onnx.load(str(result.path)).graph.node if n.op_type == "ConstantOfShape"
                     for a in n.attribute if a.name == "value")  # fmt: skip
    assert fill_type == TensorProto.FLOAT16
    out = run(result.path, data[0])[0]  # the graph keeps float32 inputs and outputs
    assert steps_apart(run(float_path, data[0])[0], out.astype(np.float32)) <= 12


def test_a_float16_file_with_an_int8_concatenation_runs_on_onnx_runtime(tmp_path):
    """ORT's QDQ fusions would turn float16-scaled Q/DQ around a concatenation (a YOLOv8 head in a TensorRT 11
    file) into a QLinearConcat that rejects float16 scales: an invalid graph. qdq's session runs a float16 file's
    Q/DQ nodes as written."""
    from onnx import TensorProto, helper, numpy_helper

    step = numpy_helper.from_array(np.array(0.05, np.float16), "step")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    nodes = []
    for name in ("a", "b"):
        nodes += [helper.make_node("QuantizeLinear", [name, "step", "zero"], [f"{name}_q"], name=f"{name}_q"),
                  helper.make_node("DequantizeLinear", [f"{name}_q", "step", "zero"], [f"{name}_dq"],
                                   name=f"{name}_dq")]  # fmt: skip
    nodes += [helper.make_node("Concat", ["a_dq", "b_dq"], ["cat"], name="cat", axis=1),
              helper.make_node("QuantizeLinear", ["cat", "step", "zero"], ["cat_q"], name="cat_q"),
              helper.make_node("DequantizeLinear", ["cat_q", "step", "zero"], ["out"], name="cat_dq")]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, 2, 4, 4]) for n in ("a", "b")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT16, None)],
                              [step, zero])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    helper.set_model_props(model, {"qdq.target": "tensorrt", "qdq.float": "float16"})
    path = tmp_path / "fp16.onnx"
    onnx.save(model, str(path))
    feed = {n: np.full((1, 2, 4, 4), 0.5, np.float16) for n in ("a", "b")}
    assert np.allclose(inference_session(path).run(None, feed)[0], 0.5)


def test_a_tensorrt_11_file_with_an_int8_concatenation_runs_on_onnx_runtime(tmp_path):
    """ORT's QDQ fusions would turn the float16-scaled Q/DQ around the concatenation into a QLinearConcat that
    rejects float16 scales (an invalid graph); qdq's session runs a float16 file's Q/DQ nodes as written."""
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    data = batches((2, 3, 16, 16))
    result = qdq.quantize_onnx(float_path, data, tmp_path / "trt.onnx", target="tensorrt",
                               target_options={"float": "fp16"}, progress=False, method="max")  # fmt: skip
    assert any(n.op_type == "Concat" for n in onnx.load(str(result.path)).graph.node)
    out = run(result.path, data[0])[0]
    assert steps_apart(run(float_path, data[0])[0], out.astype(np.float32)) <= 12


def test_the_default_is_auto_every_candidate_scored_and_bias_correction_kept_only_where_it_scores(tmp_path):
    """No method given: auto. Every registered method computed from statistics is scored on the held-out batches
    (one in four), the report shows the table; bias correction is scored as one more row for the chosen method and
    applied only when that row wins; with bias_correction=False it is neither scored nor applied."""
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "net.onnx")
    data = batches((2, 3, 16, 16), count=8)
    result = qdq.quantize_onnx(float_path, data, tmp_path / "int8.onnx", target="onnxruntime", progress=False)
    auto = result.auto
    assert auto is not None and auto.held_out and auto.batches == 2 and result.batches == 8
    assert result.method == f"auto: {auto.chosen}"
    corrected = f"{auto.chosen} + bias correction"
    assert set(auto.scores) == {*(m.label(o) for m, o in qdq.workflow.auto_calibration.candidates()), corrected}
    # compared with the model as written without it (refined ranges, the stem), the figure the summary states
    assert auto.bias_base is not None and f"{auto.bias_base:.1f} dB without" in auto.summary()
    assert auto.bias_correction == (auto.scores[corrected] >= auto.bias_base + 0.1)
    assert bool([s for s in result.bias_shifts if s.applied]) == auto.bias_correction
    assert auto.summary() in result.report() and "| chosen |" in result.report()
    plain = qdq.quantize_onnx(float_path, data, tmp_path / "plain.onnx", target="onnxruntime", bias_correction=False,
                              progress=False)  # fmt: skip
    assert plain.auto.bias_correction is None and not plain.bias_shifts and plain.auto.chosen == auto.chosen


@pytest.mark.parametrize("weight_method", ["mse", "percentile"])
def test_a_weight_method_sets_each_output_channels_step_from_its_own_values(tmp_path, weight_method):
    """``weight_method`` on a conv of 16 channels whose scales differ by 2**8: each channel's step is the numpy
    oracle's range of that channel over 127 (percentile at its default, 99.99; the histograms' 4096 bins)."""
    import histogram_reference as ref
    from qdq.calib.histogram import DEFAULT_NUM_BINS

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3)
    with torch.no_grad():
        conv.weight.mul_(2.0 ** torch.linspace(-4, 4, 16).view(-1, 1, 1, 1))
    path = tmp_path / "conv.onnx"
    export(nn.Sequential(conv, nn.ReLU()).eval(), torch.zeros(1, 3, 8, 8), path, names=("x", "y"))
    result = qdq.quantize_onnx(path, batches((2, 3, 8, 8), name="x"), tmp_path / "int8.onnx", target="tensorrt",
                               method="max", weight_method=weight_method, progress=False)  # fmt: skip
    [site] = [s for s in qdq_sites(onnx.load(str(result.path))) if s.axis is not None]
    for c, values in enumerate(conv.weight.detach().numpy()):
        expected = (ref.mse_amax(values.ravel(), num_bins=DEFAULT_NUM_BINS) if weight_method == "mse" else
                    ref.percentile_amax(values.ravel(), 99.99, num_bins=DEFAULT_NUM_BINS))  # fmt: skip
        assert float(site.step[c]) * 127 == pytest.approx(expected, rel=1e-5), c
