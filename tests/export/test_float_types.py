"""The low-precision (TensorRT 11) export: INT8 Q/DQ with the float remainder in FP16/BF16.

Oracles: the TensorRT rule checker (strong typing included), the float32 export with its steps rounded to
float16 (``round_scales``: same grid, float32 arithmetic), a PyTorch model with ``exact_amax`` ranges (same
grid, bit exact at every quantizer), and the same PyTorch model run in float16 (same grid, float16
arithmetic), whose distance to the float32 model measures what float16 arithmetic alone does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torchvision
from export_helpers import calibrate_max, steps_apart, teacher_forced_mismatches
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

import qdq
from qdq.errors import QdqConfigError
from qdq.export import export_onnx
from qdq.export.float_fidelity import compare_graphs, weight_bytes
from qdq.export.float_types import FLOAT_KEY, convert_float_precision, exact_amax, round_scales
from qdq.export.onnx_types import TensorTypes
from qdq.export.trt_check import check_tensorrt
from qdq.placement import apply_placement
from qdq.quantizer import TensorQuantizer

X = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
CALIB = [X[:2].numpy(), X[2:].numpy()]
F16, BF16 = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16


def placed(float_model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = apply_placement(qdq.quantize_model(float_model), target="tensorrt")
    calibrate_max(model, X)
    return model.eval()


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return placed(torchvision.models.resnet18(num_classes=10))


def vit() -> nn.Module:
    torch.manual_seed(0)
    return placed(VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, num_classes=10))  # fmt: skip


def use_exact_amax(model: nn.Module, float_type: str = "float16") -> None:
    """Give every quantizer the range whose step is exactly a float16 number (what the converted graph uses)."""
    for q in model.modules():
        if isinstance(q, TensorQuantizer) and q.amax is not None:
            q.amax = exact_amax(q.amax, float_type, q.maxbound)


def test_exact_amax_gives_low_precision_steps():
    amax = torch.tensor([2.0, 0.37, 0.05, 123.4, 1e-3])  # the last step (7.9e-6) is subnormal in float16
    for kind, dtype, rel in (("float16", torch.float16, 2.0**-11), ("bfloat16", torch.bfloat16, 2.0**-8)):
        exact = exact_amax(amax, kind)
        step = exact / 127
        assert torch.equal(step, step.to(dtype).float())  # the step is a number of the low type
        assert torch.all((exact - amax).abs()[:4] <= rel * amax[:4])  # half an ulp of a normal step
        np.testing.assert_array_equal(exact_amax(amax.numpy(), kind), exact.numpy())
    subnormal = exact_amax(amax, "float16")[4]
    assert abs(float(subnormal - amax[4])) <= 127 * 2.0**-25  # half the smallest subnormal, times 127


@pytest.fixture(scope="module")
def resnet_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resnet")
    model = resnet()
    fp32 = export_onnx(model, X, folder / "fp32.onnx")
    conversion = convert_float_precision(fp32, "fp16", calibration_data=CALIB, path=folder / "fp16.onnx")
    return model, fp32, folder / "fp16.onnx", conversion


def test_fp16_export_passes_tensorrt_rules(resnet_files):
    _, fp32, fp16, conversion = resnet_files
    report = check_tensorrt(fp16)
    assert report.ok, str(report)
    assert report.fp32_outside == 0 and report.compute == {"float16": conversion.converted}
    assert report.int8_ops == check_tensorrt(fp32).int8_ops == 21
    model = onnx.load(str(fp16))
    types = TensorTypes.of(model)
    dq_types = {types.get(n.output[0]) for n in model.graph.node if n.op_type == "DequantizeLinear"}
    assert dq_types == {F16}  # every DQ outputs float16 directly: no Cast before an int8 op
    assert [types.get(v.name) for v in (*model.graph.input, *model.graph.output)] == [1, 1]  # float32 edges
    assert {p.key: p.value for p in model.metadata_props}[FLOAT_KEY] == "float16"


def test_fp16_export_halves_float_layers(resnet_files):
    _, fp32, fp16, conversion = resnet_files
    before, after = weight_bytes(fp32), weight_bytes(fp16)
    assert after["float_layers"] * 2 == before["float_layers"]
    assert after["quantized_weights"] * 4 == before["quantized_weights"]  # int8 codes instead of float32
    assert conversion.folded_weights == 21 and not conversion.fp32_nodes


def test_rounded_steps_match_pytorch_with_exact_amax(resnet_files, tmp_path):
    model, fp32, _, _ = resnet_files
    rounded = tmp_path / "rounded.onnx"
    onnx.save(round_scales(fp32, "fp16"), rounded)
    use_exact_amax(model)
    try:
        assert teacher_forced_mismatches(model, rounded, X) == {}
    finally:
        calibrate_max(model, X)


def test_fp16_export_agrees_within_fp16_arithmetic(resnet_files):
    model, fp32, fp16, _ = resnet_files
    comparison = compare_graphs(round_scales(fp32, "fp16"), fp16, CALIB)
    assert all(comparison.q_exact.values())  # ORT's float16 QuantizeLinear is the definition
    assert comparison.agreement["conv1._input_quantizer"] == 1.0  # same float32 input, same step
    use_exact_amax(model)
    try:
        with torch.no_grad():
            torch32 = model(X).numpy()
            torch16 = model.half()(X.half()).float().numpy()
    finally:
        model.float()
        calibrate_max(model, X)
    arithmetic = steps_apart(torch32, torch16)  # what float16 arithmetic does to the same quantized model
    assert comparison.max_steps <= 2 * arithmetic + 1.0, (comparison.max_steps, arithmetic)


def test_vit_fp16_export(tmp_path):
    model = vit()
    fp32 = export_onnx(model, X, tmp_path / "vit.onnx")
    conversion = convert_float_precision(fp32, "float16", calibration_data=CALIB)
    report = check_tensorrt(conversion.model)
    assert report.ok and report.fp32_outside == 0, str(report)
    assert report.int8_ops == check_tensorrt(fp32).int8_ops > 0
    nodes = {n.op_type for n in conversion.model.graph.node}
    assert "Transpose" in nodes  # attention transposes stay; the weight transposes are folded into int8 codes
    comparison = compare_graphs(round_scales(fp32, "fp16"), conversion.model, CALIB)
    assert all(comparison.q_exact.values()) and comparison.top1 == 1.0


def test_bf16_export_passes_tensorrt_rules(tmp_path):
    model = resnet()
    fp32 = export_onnx(model, X, tmp_path / "fp32.onnx")
    conversion = convert_float_precision(fp32, "bf16", calibration_data=CALIB)
    report = check_tensorrt(conversion.model)
    assert report.ok and report.compute == {"bfloat16": conversion.converted}, str(report)
    opset = next(o.version for o in conversion.model.opset_import if o.domain == "")
    assert opset >= 22  # bfloat16 Conv/Gemm
    worst = max(conversion.scale_changes.values())
    assert 2.0**-11 < worst <= 2.0**-8  # bfloat16 keeps 8 significant bits of each step


def test_keep_io_types_false_gives_fp16_edges(resnet_files):
    _, fp32, _, _ = resnet_files
    conversion = convert_float_precision(fp32, "fp16", keep_io_types=False)
    graph = conversion.model.graph
    assert graph.input[0].type.tensor_type.elem_type == F16 == graph.output[0].type.tensor_type.elem_type
    assert check_tensorrt(conversion.model).ok
    assert not conversion.measured


def test_float32_is_unchanged(resnet_files):
    _, fp32, _, _ = resnet_files
    conversion = convert_float_precision(fp32, "fp32")
    assert conversion.model.SerializeToString() == onnx.load(str(fp32)).SerializeToString()


class _Loud(nn.Module):
    """A quantized conv whose float output is scaled far beyond float16's safe range before the next conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)) * 4000.0)


def test_overflowing_node_stays_fp32_and_is_recorded(tmp_path):
    model = placed(_Loud())
    fp32 = export_onnx(model, X, tmp_path / "loud.onnx")
    conversion = convert_float_precision(fp32, "fp16", calibration_data=CALIB)
    kept = conversion.fp32_nodes
    assert kept and all("data_max" in reason for reason in kept.values())
    assert any("Mul" in name or "mul" in name for name in kept)
    report = check_tensorrt(conversion.model)
    assert report.ok and report.fp32_outside == 0 and report.fp32_allowed == len(kept), str(report)
    assert "stay FP32" in str(conversion) and next(iter(kept)) in str(conversion)
    unmeasured = convert_float_precision(fp32, "fp16")
    assert not unmeasured.fp32_nodes and "not measured" in str(unmeasured)


def test_unknown_float_type_is_refused(resnet_files):
    with pytest.raises(QdqConfigError, match="float16"):
        convert_float_precision(resnet_files[1], "fp8")
