"""Tiny ONNX models for the runtime tests, built without qdq's own exporter.

* :func:`export_fp32`: a small torch CNN exported with the TorchScript exporter (dynamic batch).
* :func:`quantize_u8`: that model quantized by ONNX Runtime's ``quantize_static`` (QDQ, uint8
  activations, int8 per-channel weights, after ``quant_pre_process``) on random calibration data.
* :func:`export_trt_style`: the TensorRT-style graph: signed int8 symmetric fake-quant on the inputs
  and weights of every conv (per-tensor activations, per-channel weights), nothing on conv outputs.
* :func:`qdq_conv_graph`: a hand-built ``Q -> DQ -> Conv [-> Q -> DQ] [-> Tanh]`` graph for exact checks.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

INPUT_SHAPE = (3, 32, 32)


class TinyCnn(nn.Module):
    """4 convs (one depthwise), BatchNorm, ReLU, a residual add, global pooling and a Linear."""

    n_convs = 4

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        y = F.relu(self.pw(F.relu(self.dw(x))))
        x = F.relu(self.down(x + y))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_cnn() -> TinyCnn:
    """A TinyCnn in eval mode with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    model = TinyCnn()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _export(model: nn.Module, path: Path) -> Path:
    example = torch.randn(1, *INPUT_SHAPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (example,), str(path), dynamo=False, opset_version=17,
            input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )  # fmt: skip
    return path


def export_fp32(model: nn.Module, path: Path) -> Path:
    """The FP32 model as ONNX (opset 17, dynamic batch)."""
    return _export(model, path)


def calibration_batches(n: int = 8, batch: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((batch, *INPUT_SHAPE)).astype(np.float32) for _ in range(n)]


def quantize_u8(fp32_path: Path, out_path: Path) -> Path:
    """ORT's own static quantization: QDQ, U8 activations, S8 per-channel weights."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter({"input": b} for b in calibration_batches())

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._batches, None)

    pre = out_path.with_name(out_path.stem + "_pre.onnx")
    quant_pre_process(str(fp32_path), str(pre))
    quantize_static(
        str(pre), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
    )  # fmt: skip
    return out_path


class _FakeQuantConv(nn.Module):
    """A conv whose input (per-tensor) and weight (per output channel) go through int8 fake-quant."""

    def __init__(self, conv: nn.Conv2d, input_amax: float) -> None:
        super().__init__()
        self.conv = conv
        self.input_scale = input_amax / 127.0
        w_amax = conv.weight.detach().abs().amax(dim=(1, 2, 3)).clamp_min(1e-8)
        self.register_buffer("w_scale", w_amax / 127.0)
        self.register_buffer("w_zero", torch.zeros(conv.out_channels, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.fake_quantize_per_tensor_affine(x, self.input_scale, 0, -128, 127)
        w = torch.fake_quantize_per_channel_affine(self.conv.weight, self.w_scale, self.w_zero, 0, -128, 127)
        c = self.conv
        return F.conv2d(x, w, c.bias, c.stride, c.padding, c.dilation, c.groups)


def trt_style_model() -> TinyCnn:
    """TinyCnn with BN folded and every conv fake-quantized TensorRT-style, calibrated by max."""
    model = tiny_cnn()
    model.stem = torch.nn.utils.fusion.fuse_conv_bn_eval(model.stem, model.bn)
    model.bn = nn.Identity()
    amax: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))
        )
        for name, module in model.named_children() if isinstance(module, nn.Conv2d)
    ]  # fmt: skip
    with torch.no_grad():
        for batch in calibration_batches():
            model(torch.from_numpy(batch))
    for hook in hooks:
        hook.remove()
    for name, value in amax.items():
        setattr(model, name, _FakeQuantConv(getattr(model, name), value))
    return model.eval()


def export_trt_style(path: Path) -> Path:
    """The TensorRT-style Q/DQ graph of TinyCnn (signed int8, zero point 0)."""
    return _export(trt_style_model(), path)


def qdq_conv_graph(
    path: Path, *, quantize_output: bool, activation_type: str = "uint8", tail: str | None = None
) -> Path:
    """``x -> Q -> DQ -> Conv(DQ(int8 weight)) [-> Q -> DQ] [-> tail op] -> y``, 3->4 channels, 8x8."""
    rng = np.random.default_rng(0)
    zp_type = np.dtype(activation_type)
    zero = 0 if zp_type == np.int8 else 128
    inits = [
        numpy_helper.from_array(rng.integers(-127, 128, size=(4, 3, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.full(4, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(4, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(zero, zp_type), "x_zero"),
        numpy_helper.from_array(np.array(0.1, np.float32), "y_scale"),
        numpy_helper.from_array(np.array(zero, zp_type), "y_zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], name="dq_w", axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq"], ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
    ]
    last = "conv_out"
    if quantize_output:
        nodes += [
            helper.make_node("QuantizeLinear", ["conv_out", "y_scale", "y_zero"], ["y_q"], name="q_out"),
            helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zero"], ["y_dq"], name="dq_out"),
        ]
        last = "y_dq"
    if tail is not None:
        nodes.append(helper.make_node(tail, [last], ["tail_out"], name="tail"))
        last = "tail_out"
    nodes.append(helper.make_node("Identity", [last], ["y"], name="out"))
    graph = helper.make_graph(
        nodes, "qdq_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def export_vit_fp16(path: Path) -> tuple[Path, np.ndarray]:
    """A 2-layer torchvision ViT (32x32), quantized for target "tensorrt" with float16 steps and exported with
    its float part in float16 (ranges measured on the batch returned with it)."""
    from torchvision.models.vision_transformer import VisionTransformer

    import qdq
    from qdq.export import export_onnx

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                            num_classes=10)  # fmt: skip
    config = qdq.QuantConfig(target="tensorrt", target_options={"float": "float16"})
    model = qdq.quantize_model(vit, config).eval()
    qdq.calibrate(model, [x], method="max", progress=False)
    export_onnx(model, x, path, target_options={"calibration_data": [x]})
    return path, x.numpy()
