"""The low-precision (TensorRT 11) export: INT8 Q/DQ with the float remainder in FP16/BF16.

Oracles: the TensorRT rule checker (strong typing included); the PyTorch model quantized with float16 steps
(``QuantConfig(target_options={"float": "float16"})``), teacher-forced at every quantizer against the FP16
file in ONNX Runtime (bit exact, weights included); the float32 export of the same model (same grid, float32
arithmetic); and the same PyTorch model run in float16, whose distance to the float32 model measures what
float16 arithmetic alone does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torchvision
from export_helpers import calibrate_max, steps_apart, teacher_forced_mismatches
from onnx import numpy_helper
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

import qdq
from qdq.errors import QdqConfigError
from qdq.export import export_onnx
from qdq.graphs.onnx_tags import quantizer_names
from qdq.graphs.onnx_types import TensorTypes
from qdq.quantizer import TensorQuantizer
from qdq.targets.tensorrt.check import check_tensorrt
from qdq.targets.tensorrt.float_fidelity import compare_graphs, weight_bytes
from qdq.targets.tensorrt.float_scales import round_scales
from qdq.targets.tensorrt.float_types import FLOAT_KEY, convert_float_precision, read_float_record

X = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
CALIB = [X[:2], X[2:]]
F16, BF16 = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
FP16 = {"float": "float16"}


def placed(float_model: nn.Module, options: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    config = qdq.QuantConfig(target="tensorrt", target_options=options)
    model = qdq.quantize_model(float_model, config)
    calibrate_max(model, X)
    return model.eval()


def resnet(options: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    return placed(torchvision.models.resnet18(num_classes=10), options)


def vit(options: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    return placed(VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, num_classes=10), options)  # fmt: skip


def weight_mismatches(model: nn.Module, path) -> dict[str, int]:
    """Each weight stored as int8 codes in the file, dequantized (codes * scale, float32), against the PyTorch
    weight quantizer's output on the model's weight: elements that differ, by quantizer name."""
    proto = onnx.load(str(path))
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    modules = dict(model.named_modules())
    bad, seen = {}, 0
    for dq in [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants]:
        (name,) = quantizer_names(dq)
        codes, scale = constants[dq.input[0]], constants[dq.input[1]].astype(np.float32)
        quantizer = modules[name]
        weight = next(w for n, w, q in modules[name.rsplit(".", 1)[0]].quantized_weights() if q is quantizer)
        with torch.no_grad():
            expected = quantizer(weight).numpy()
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1] * codes.ndim
        shape[axis] = scale.size
        got = codes.astype(np.float32) * scale.reshape(shape if scale.size > 1 else ())
        read_by_matmul = any(n.op_type == "MatMul" and n.input[1] == dq.output[0] for n in proto.graph.node)
        got = got.T if read_by_matmul else got  # a Linear weight folded into MatMul codes is W transposed
        wrong = int(np.count_nonzero(got != expected))
        seen += 1
        if wrong:
            bad[name] = wrong
    assert seen > 0
    return bad


@pytest.fixture(scope="module")
def resnet_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resnet")
    model = resnet(FP16)
    fp32 = export_onnx(model, X, folder / "fp32.onnx", target_options={"float": "float32"})
    fp16 = export_onnx(model, X, folder / "fp16.onnx", target_options={"calibration_data": CALIB})
    return model, fp32, fp16


@pytest.mark.slow
def test_fp16_export_passes_tensorrt_rules(resnet_files):
    _, fp32, fp16 = resnet_files
    report = check_tensorrt(fp16)
    record = read_float_record(fp16)
    assert report.ok, str(report)
    assert report.fp32_outside == 0 and report.compute == {"float16": record["converted_nodes"]}
    assert report.int8_ops == check_tensorrt(fp32).int8_ops == 21
    model = onnx.load(str(fp16))
    types = TensorTypes.of(model)
    dq_types = {types.get(n.output[0]) for n in model.graph.node if n.op_type == "DequantizeLinear"}
    assert dq_types == {F16}  # every DQ outputs float16 directly: no Cast before an int8 op
    assert [types.get(v.name) for v in (*model.graph.input, *model.graph.output)] == [1, 1]  # float32 edges
    assert {p.key: p.value for p in model.metadata_props}[FLOAT_KEY] == "float16"
    assert record["ranges_measured"] and record["largest_step_change"] == 0.0  # the model's steps were float16
    assert record["fp32_nodes"] == {} and record["int8_weights"] == 21


def test_fp16_export_halves_float_layers(resnet_files):
    _, fp32, fp16 = resnet_files
    before, after = weight_bytes(fp32), weight_bytes(fp16)
    assert after["float_layers"] * 2 == before["float_layers"]
    assert after["quantized_weights"] * 4 == before["quantized_weights"]  # int8 codes instead of float32


def test_pytorch_model_is_bit_exact_with_the_fp16_file_at_every_quantizer(resnet_files):
    """The model quantized with float16 steps computes, quantizer by quantizer, what the FP16 file computes."""
    model, fp32, fp16 = resnet_files
    assert all(q.step_type == "float16" for q in model.modules() if isinstance(q, TensorQuantizer))
    assert teacher_forced_mismatches(model, fp16, X) == {}
    assert weight_mismatches(model, fp16) == {}
    assert teacher_forced_mismatches(model, fp32, X) == {}  # and the float32 file of the same model


def test_fp16_export_agrees_within_fp16_arithmetic(resnet_files):
    model, fp32, fp16 = resnet_files
    comparison = compare_graphs(fp32, fp16, CALIB)
    assert all(comparison.q_exact.values())  # ORT's float16 QuantizeLinear is the definition
    assert comparison.agreement["conv1._input_quantizer"] == 1.0  # same float32 input, same step
    with torch.no_grad():
        torch32 = model(X).numpy()
        torch16 = model.half()(X.half()).float().numpy()
    model.float()
    arithmetic = steps_apart(torch32, torch16)  # what float16 arithmetic does to the same quantized model
    assert comparison.max_steps <= 2 * arithmetic + 1.0, (comparison.max_steps, arithmetic)


@pytest.mark.slow
def test_float32_steps_are_rounded_and_said(tmp_path):
    """A model quantized without the float option: the file rounds its steps and says how to match them."""
    model = resnet()
    with pytest.warns(UserWarning, match=r"steps were rounded to float16.*target_options=\{'float': 'float16'\}"):
        path = export_onnx(model, X, tmp_path / "m.onnx", target_options={**FP16, "calibration_data": CALIB})
    assert 0 < read_float_record(path)["largest_step_change"] <= 2.0**-10
    rounded = tmp_path / "rounded.onnx"
    onnx.save(round_scales(export_onnx(model, X, tmp_path / "fp32.onnx"), "fp16"), rounded)
    assert teacher_forced_mismatches(model, rounded, X)  # the model's own steps: another grid
    for q in model.modules():
        if isinstance(q, TensorQuantizer):
            q.step_type = "float16"
    assert teacher_forced_mismatches(model, rounded, X) == {}


@pytest.mark.slow
def test_vit_fp16_export(tmp_path):
    model = vit(FP16)
    fp32 = export_onnx(model, X, tmp_path / "vit32.onnx", target_options={"float": "float32"})
    fp16 = export_onnx(model, X, tmp_path / "vit16.onnx", target_options={"calibration_data": CALIB})
    report = check_tensorrt(fp16)
    assert report.ok and report.fp32_outside == 0, str(report)
    assert report.int8_ops == check_tensorrt(fp32).int8_ops > 0
    nodes = {n.op_type for n in onnx.load(str(fp16)).graph.node}
    assert "Transpose" in nodes  # attention transposes stay; the weight transposes are folded into int8 codes
    assert teacher_forced_mismatches(model, fp16, X) == {}
    assert weight_mismatches(model, fp16) == {}
    comparison = compare_graphs(fp32, fp16, CALIB)
    assert all(comparison.q_exact.values()) and comparison.top1 == 1.0


@pytest.mark.slow
def test_bf16_export_passes_tensorrt_rules(tmp_path):
    model = resnet({"float": "bf16"})
    assert {q.step_type for q in model.modules() if isinstance(q, TensorQuantizer)} == {"bfloat16"}
    path = export_onnx(model, X, tmp_path / "bf16.onnx", target_options={"calibration_data": CALIB})
    report = check_tensorrt(path)
    record = read_float_record(path)
    assert report.ok and report.compute == {"bfloat16": record["converted_nodes"]}, str(report)
    assert onnx.load(str(path)).opset_import[0].version >= 22  # bfloat16 Conv/Gemm
    scales = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer if t.data_type == BF16]
    assert scales and record["largest_step_change"] == 0.0


def test_keep_io_types_false_gives_fp16_edges(resnet_files, tmp_path):
    model, _, _ = resnet_files
    with pytest.warns(UserWarning, match="value ranges were not measured"):
        path = export_onnx(model, X, tmp_path / "m.onnx", target_options={"keep_io_types": False})
    graph = onnx.load(str(path)).graph
    assert graph.input[0].type.tensor_type.elem_type == F16 == graph.output[0].type.tensor_type.elem_type
    assert check_tensorrt(path).ok
    assert not read_float_record(path)["ranges_measured"]


def test_convert_float_precision_converts_any_file(resnet_files):
    """The same conversion on a float32 file; float32 returns it unchanged."""
    _, fp32, fp16 = resnet_files
    conversion = convert_float_precision(fp32, "fp16", calibration_data=[x.numpy() for x in CALIB])
    assert check_tensorrt(conversion.model).ok and conversion.largest_step_change == 0.0
    assert conversion.converted == read_float_record(fp16)["converted_nodes"]
    unchanged = convert_float_precision(fp32, "fp32")
    assert unchanged.model.SerializeToString() == onnx.load(str(fp32)).SerializeToString()


class _Loud(nn.Module):
    """A quantized conv whose float output is scaled far beyond float16's safe range before the next conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)) * 4000.0)


def test_overflowing_node_stays_fp32_and_is_recorded(tmp_path, caplog):
    model = placed(_Loud(), FP16)
    with caplog.at_level("INFO", logger="qdq.targets.tensorrt.rewrite"):
        path = export_onnx(model, X, tmp_path / "loud.onnx", target_options={"calibration_data": CALIB})
    kept = read_float_record(path)["fp32_nodes"]
    assert kept and all("data_max" in reason for reason in kept.values())
    assert any("Mul" in name or "mul" in name for name in kept)
    report = check_tensorrt(path)
    assert report.ok and report.fp32_outside == 0 and report.fp32_allowed == len(kept), str(report)
    logged = [r for r in caplog.records if r.name == "qdq.targets.tensorrt.rewrite"]
    assert len(logged) == 1 and logged[0].levelname == "WARNING"  # once, with the table of what stays FP32
    assert "2 stay FP32" in logged[0].getMessage() and all(name in logged[0].getMessage() for name in kept)
    assert teacher_forced_mismatches(model, path, X) == {}


def test_calibration_data_of_labelled_batches_is_refused(resnet_files, tmp_path):
    model, _, _ = resnet_files
    with pytest.raises(QdqConfigError, match=r"2 arrays but the graph has 1 inputs.*\[x for x, _ in loader\]"):
        export_onnx(model, X, tmp_path / "m.onnx", target_options={"calibration_data": [(X, torch.zeros(4))]})
    assert not (tmp_path / "m.onnx").exists()


def test_unknown_float_type_is_refused(resnet_files, tmp_path):
    with pytest.raises(QdqConfigError, match="unknown float type 'fp8'"):
        qdq.QuantConfig(target="tensorrt", target_options={"float": "fp8"})
    with pytest.raises(QdqConfigError, match="float16"):
        convert_float_precision(resnet_files[1], "fp8")


def _branch_reading_outer_scope() -> onnx.ModelProto:
    """x -> Q/DQ -> MatMul -> Sigmoid -> s; If(sum(x) > 0): then s * 2, else s - 1 (both read ``s`` from the main
    graph, their outputs declared float32), as silero-vad's decoder reads its state inside an If."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(0.02, np.float32), "step"),
             numpy_helper.from_array(np.array(0, np.int8), "zero"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero_f")]  # fmt: skip
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    then = helper.make_graph([helper.make_node("Mul", ["s", "two"], ["y_then"])], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [1, 4])])  # fmt: skip
    other = helper.make_graph([helper.make_node("Sub", ["s", "one"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [1, 4])])  # fmt: skip
    nodes = [helper.make_node("QuantizeLinear", ["x", "step", "zero"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "step", "zero"], ["xd"], name="dq"),
             helper.make_node("MatMul", ["xd", "w"], ["m"], name="matmul"),
             helper.make_node("Sigmoid", ["m"], ["s"], name="sigmoid"),
             helper.make_node("ReduceSum", ["x"], ["total"], name="sum", keepdims=0),
             helper.make_node("Greater", ["total", "zero_f"], ["cond"], name="greater"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=other)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])], [out],
                              inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_tensor_read_inside_an_if_branch_stays_float32_with_the_if(tmp_path):
    import onnxruntime as ort

    model = _branch_reading_outer_scope()
    conversion = convert_float_precision(model, "fp16")
    onnx.checker.check_model(conversion.model, full_check=True)  # the branches' declared types hold
    reasons = conversion.fp32_nodes
    assert "subgraphs" in reasons["if"] and "inside a subgraph" in reasons["sigmoid"]
    assert TensorTypes.of(conversion.model).get("s") == onnx.TensorProto.FLOAT
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for x in (np.full((1, 4), 0.5, np.float32), np.full((1, 4), -0.5, np.float32)):  # both branches
        ref, = ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": x})
        got, = ort.InferenceSession(conversion.model.SerializeToString(), options).run(None, {"x": x})
        np.testing.assert_allclose(got, ref, atol=2e-3)  # float16 MatMul, float32 after it
