"""fusion_report: what ORT's CPU provider fused, counted in its optimized graph, with reasons."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import rt_models

from qdq.runtime.ort import fusion_report

NO_Q = "float Conv: no QuantizeLinear on its output"


def test_ort_quantized_model_runs_every_conv_in_int8(u8_onnx: Path) -> None:
    report = fusion_report(u8_onnx, threads=1)
    n_convs = report.source_ops["Conv"]
    assert n_convs == rt_models.TinyCnn.n_convs
    assert report.count("QLinearConv") == n_convs
    assert report.int8_kernels == {"com.microsoft:QLinearConv": n_convs, "com.microsoft:QGemm": 1}
    assert report.float_kernels == {}
    assert (report.n_int8, report.n_float) == (n_convs + 1, 0)
    # Only the conversions at the model's edges remain: one Q on the input, one DQ on the logits.
    assert report.problems == ()
    assert sorted((u.op_type, u.boundary) for u in report.unfused) == [
        ("DequantizeLinear", True), ("QuantizeLinear", True)
    ]  # fmt: skip


def test_fp32_model_runs_float_convs(fp32_onnx: Path) -> None:
    report = fusion_report(fp32_onnx, threads=1)
    assert report.n_int8 == 0
    assert report.n_float == rt_models.TinyCnn.n_convs + 1  # 4 convs (NCHWc) and the Gemm
    assert report.unfused == ()


def test_disabled_optimizations_fuse_nothing(u8_onnx: Path) -> None:
    report = fusion_report(u8_onnx, optimization_level="disable")
    assert report.n_int8 == 0
    assert report.float_kernels == {"ai.onnx:Conv": rt_models.TinyCnn.n_convs, "ai.onnx:Gemm": 1}
    assert report.count("QuantizeLinear") == report.source_ops["QuantizeLinear"]


def test_conv_without_output_q_is_reported_float(tmp_path: Path) -> None:
    path = rt_models.qdq_conv_graph(tmp_path / "no_q.onnx", quantize_output=False)
    report = fusion_report(path)
    assert report.float_kernels == {"ai.onnx:Conv": 1}
    assert report.n_int8 == 0
    by_name = {u.name: u for u in report.unfused}
    assert set(by_name) == {"q_in", "dq_in", "dq_w"}
    assert by_name["dq_in"].reason == NO_Q and not by_name["dq_in"].boundary
    assert by_name["dq_w"].reason == NO_Q
    assert by_name["q_in"].boundary
    assert report.reasons()[NO_Q] == 2


@pytest.mark.parametrize("activation_type", ["uint8", "int8"])
def test_conv_with_output_q_is_fused(tmp_path: Path, activation_type: str) -> None:
    path = rt_models.qdq_conv_graph(tmp_path / "q.onnx", quantize_output=True, activation_type=activation_type)
    report = fusion_report(path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 1}
    assert report.float_kernels == {}
    assert report.problems == ()
    assert {u.name for u in report.unfused} == {"q_in", "dq_out"}


def test_dq_feeding_an_op_without_int8_kernel(tmp_path: Path) -> None:
    path = rt_models.qdq_conv_graph(tmp_path / "tanh.onnx", quantize_output=True, tail="Tanh")
    report = fusion_report(path)
    assert report.count("QLinearConv") == 1
    (problem,) = report.problems
    assert (problem.name, problem.op_type) == ("dq_out", "DequantizeLinear")
    assert problem.reason == "float Tanh: ONNX Runtime's CPU provider has no int8 kernel for it"


def test_tensorrt_style_graph_runs_in_float_on_ort(trt_onnx: Path) -> None:
    """Q/DQ on conv inputs only: no Q follows any conv directly, so ORT fuses none of them."""
    report = fusion_report(trt_onnx)
    assert report.n_int8 == 0
    assert report.float_kernels == {"com.microsoft:FusedConv": rt_models.TinyCnn.n_convs, "ai.onnx:Gemm": 1}
    reasons = report.reasons()
    assert reasons["float FusedConv: no QuantizeLinear on its output"] >= 2  # convs feeding Add / pooling
    assert any(r.startswith("float FusedConv: a Relu sat between the Conv and its QuantizeLinear") for r in reasons)
    for problem in report.problems:
        assert problem.reason.startswith(("float ", "quantizes the output of float ")), problem


def test_markdown_rendering(u8_onnx: Path, tmp_path: Path) -> None:
    text = str(fusion_report(u8_onnx))
    assert "source graph: 4 Conv, 1 Gemm" in text
    assert re.search(r"\| com\.microsoft:QLinearConv \| 4 +\| int8 +\|", text)
    assert "quantizes a graph input" in text
    no_q = str(fusion_report(rt_models.qdq_conv_graph(tmp_path / "n.onnx", quantize_output=False)))
    assert re.search(r"\| DequantizeLinear \| float Conv: no QuantizeLinear on its output +\| 2 +\| dq_w, dq_in", no_q)


def _resize_graph(path: Path, mode: str) -> Path:
    """``Q -> DQ -> Resize(mode, x2) -> Q -> DQ``, one scale and zero point on both sides."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"),
             helper.make_node("Resize", ["xd", "roi", "scales"], ["r"], name="resize", mode=mode),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q_out"),
             helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq_out")]  # fmt: skip
    arrays = {"s": np.array(0.05, np.float32), "z": np.array(0, np.uint8), "roi": np.zeros(0, np.float32),
              "scales": np.array([1, 1, 2, 2], np.float32)}
    inits = [numpy_helper.from_array(value, name) for name, value in arrays.items()]
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_resize_between_one_scale_runs_on_int8_only_in_nearest_mode(tmp_path: Path, mode: str) -> None:
    """ONNX Runtime drops the DQ and Q around a Resize with one scale only in nearest mode (1.32, measured); the
    report says which mode a float one has, not that its scales differ."""
    report = fusion_report(_resize_graph(tmp_path / "resize.onnx", mode))
    inner = {u.name: u.reason for u in report.unfused if not u.boundary}
    if mode == "nearest":
        assert inner == {}
    else:
        assert inner == {"dq_in": "float Resize: ONNX Runtime runs Resize on int8 data only in nearest mode "
                                  "(this one: linear)",
                         "q_out": "quantizes the output of float Resize: ONNX Runtime runs Resize on int8 data only "
                                  "in nearest mode (this one: linear)"}  # fmt: skip
