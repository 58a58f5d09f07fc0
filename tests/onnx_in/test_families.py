"""qdq.quantize_onnx on the families of graphs real files hold, one small generated graph per family.

Each graph stands for a family a public model showed (issue 44): its file is written here with ``onnx.helper`` or
exported from a tiny PyTorch module, quantized, and checked against numbers derived apart from qdq: the node types
ONNX Runtime runs, counts of int8 kernels, node-name uniqueness, outputs against FP32 within a number of steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import qdq
from onnx_models import batches, export
from qdq.runtime.ort import fusion_report, inference_session, session_options


def run(path: Path, feed: dict[str, np.ndarray], optimize: bool = True) -> np.ndarray:
    """The first output of ``path`` on ONNX Runtime: its int8 kernels, or (``optimize=False``) the Q/DQ graph
    computed in float, what the file means."""
    options = session_options(threads=1, optimization_level="all" if optimize else "disable")
    return np.asarray(inference_session(path, options).run(None, feed)[0])


def steps_apart(reference: np.ndarray, other: np.ndarray) -> float:
    """The largest difference, in steps of an 8-bit grid over ``reference``'s range."""
    return float(np.abs(reference - other).max() / (np.abs(reference).max() / 127))


class UpsampleLike(nn.Module):
    """U²-Net's ``_upsample_like``: a ReLU conv output upsampled (bilinear) to the size of an earlier tensor, read
    from that tensor's shape at run time, and concatenated with it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = self.a(x)
        late = self.b(early)
        up = nn.functional.interpolate(late, size=early.shape[2:], mode="bilinear", align_corners=False)
        return self.head(torch.cat([up, early], 1))


def test_a_conv_upsampled_to_a_size_computed_at_run_time_runs_in_int8(tmp_path: Path) -> None:
    """u2netp: a Resize whose sizes come from Shape arithmetic (an int64 tensor, not a constant) read the ReLU
    conv's output; the sizes counted as data said nothing is >= 0 after the Resize, so the shared range went
    signed, the ReLU could not fold and the conv ran in float. Every conv is a QLinearConv now."""
    torch.manual_seed(0)
    path = export(UpsampleLike(), torch.randn(1, 3, 16, 16), tmp_path / "up.onnx",
                  dynamic={"images": {0: "batch", 2: "height", 3: "width"}})  # fmt: skip
    resize = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Resize")
    assert resize.input[3] and resize.input[3] not in {t.name for t in onnx.load(str(path)).graph.initializer}
    result = qdq.quantize_onnx(path, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False)  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 3} and not report.float_kernels


class SamePadConv(nn.Conv2d):
    """``efficientnet_pytorch``'s ``Conv2dDynamicSamePadding`` (timm's ``Conv2dSame``): TensorFlow's same padding,
    the amounts computed from the input's shape at run time, then the conv unpadded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (height, width), (kh, kw), (sh, sw) = x.shape[-2:], self.weight.shape[-2:], self.stride
        ph = max((math.ceil(height / sh) - 1) * sh + kh - height, 0)
        pw = max((math.ceil(width / sw) - 1) * sw + kw - width, 0)
        x = nn.functional.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class SamePadNet(nn.Module):
    """Two same-padding convs (strided, then depthwise) with ReLU6, then a constant pad before a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = SamePadConv(3, 8, 3, stride=2), SamePadConv(8, 8, 3, groups=8)
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu6(self.b(nn.functional.relu6(self.a(x))))
        return self.c(nn.functional.pad(x, [1, 1, 1, 1]))


def test_padding_before_a_conv_runs_on_int8_data(tmp_path: Path) -> None:
    """EfficientNet-Lite's same-padding convs: ``Pad`` nodes fed by Shape/Slice/Concat arithmetic, and a constant
    pad. Every conv is a QLinearConv, and each Pad after an int8 op pads the integers (ONNX Runtime leaves
    ``DQ -> Pad -> Q`` in float): no Q/DQ is left without an int8 kernel behind it."""
    torch.manual_seed(0)
    float_path = export(SamePadNet(), torch.randn(1, 3, 16, 16), tmp_path / "same.onnx",
                        dynamic={"images": {0: "batch", 2: "height", 3: "width"}})  # fmt: skip
    assert sum(n.op_type == "Pad" for n in onnx.load(str(float_path)).graph.node) == 3
    result = qdq.quantize_onnx(float_path, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False)  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 3} and not report.float_kernels
    assert not report.idle
    model = onnx.load(str(result.path))
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    pads = [n for n in model.graph.node if n.op_type == "Pad"]
    assert [producers.get(n.input[0]) for n in pads] == [None, "QuantizeLinear", "QuantizeLinear"]  # input, int8
    feed = batches((2, 3, 20, 18), count=1, seed=4)[0]  # another size: other pad amounts
    assert steps_apart(run(float_path, feed), run(result.path, feed)) <= 6.0
    engine, graph = run(result.path, feed), run(result.path, feed, optimize=False)
    assert steps_apart(graph, engine) <= 1.0


def old_export(path: Path) -> Path:
    """What an old PyTorch wrote (IR version 3, opset 9): every initializer listed among the graph inputs too (a
    BatchNorm's ``num_batches_tracked`` included, which no node reads), no node named; x -> Conv(+b) -> BN -> Relu
    -> Conv(+b) -> Relu -> Conv(+b) -> y."""
    rng = np.random.default_rng(0)
    shapes = {"c1.weight": (4, 3, 3, 3), "c1.bias": (4,), "bn.weight": (4,), "bn.bias": (4,), "bn.running_mean": (4,),
              "c2.weight": (4, 4, 3, 3), "c2.bias": (4,), "c3.weight": (2, 4, 1, 1), "c3.bias": (2,)}  # fmt: skip
    arrays = {name: (rng.normal(size=shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
              for name, shape in shapes.items()}  # fmt: skip
    arrays["bn.running_var"] = rng.uniform(0.5, 1.5, 4).astype(np.float32)
    inits = [numpy_helper.from_array(value, name) for name, value in arrays.items()]
    inits.append(numpy_helper.from_array(np.array(7, np.int64), "bn.num_batches_tracked"))
    norm = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    nodes = [
        helper.make_node("Conv", ["x", "c1.weight", "c1.bias"], ["1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["1", *norm], ["2"]),
        helper.make_node("Relu", ["2"], ["3"]),
        helper.make_node("Conv", ["3", "c2.weight", "c2.bias"], ["4"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["4"], ["5"]),
        helper.make_node("Conv", ["5", "c3.weight", "c3.bias"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 8, 8])
    model = helper.make_model(helper.make_graph(nodes, "old", inputs, [output], inits),
                              opset_imports=[helper.make_opsetid("", 9)])  # fmt: skip
    model.ir_version = 3
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_an_old_export_with_initializers_among_its_inputs_and_unnamed_nodes(tmp_path: Path, target: str) -> None:
    """CenterFace's family: calibration asks for the image alone (the initializers listed as inputs are constants,
    not data), and the file written names every node once (two unnamed convs' bias DequantizeLinears were both
    '/bias_DequantizeLinear', which ONNX Runtime refuses)."""
    float_path = old_export(tmp_path / "old.onnx")
    result = qdq.quantize_onnx(float_path, batches((4, 3, 8, 8), name="x", count=6), tmp_path / "int8.onnx",
                               target=target, progress=False)  # fmt: skip
    model = onnx.load(str(result.path))
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert [i.name for i in model.graph.input] == ["x"]
    assert result.int8_ops == {"Conv": 3}
    feed = batches((2, 3, 8, 8), name="x", count=1, seed=5)[0]
    assert steps_apart(run(float_path, feed), run(result.path, feed, optimize=False)) <= 12.0
    if target == "onnxruntime":
        assert fusion_report(result.path).int8_kernels == {"com.microsoft:QLinearConv": 3}
