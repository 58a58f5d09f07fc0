"""Small ONNX files for the ONNX front end's tests: exported from tiny PyTorch modules, or written node by node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn


def export(module: nn.Module, example: torch.Tensor, path: Path, *, dynamic: dict | None = None,
           names: tuple[str, str] = ("images", "scores")) -> Path:  # fmt: skip
    """``module`` (eval) exported with the TorchScript exporter, opset 17."""
    torch.onnx.export(module.eval(), (example,), str(path), dynamo=False, opset_version=17, input_names=[names[0]],
                      output_names=[names[1]], dynamic_axes=dynamic or {names[0]: {0: "batch"}})  # fmt: skip
    return path


def batches(shape: tuple[int, ...], count: int = 3, name: str = "images", seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{name: rng.normal(size=shape).astype(np.float32)} for _ in range(count)]


class ConvNet(nn.Module):
    """conv-bn-relu, max-pool, conv-bn-silu, a residual add, upsampling, a concatenation, a conv head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.res = nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        y = self.mid(nn.functional.max_pool2d(skip, 2))
        y = y + self.res(y)
        up = nn.functional.interpolate(y, scale_factor=2.0, mode="nearest")
        return self.head(torch.cat([up, skip], 1))


class DetectorHead(nn.Module):
    """A detector's output: boxes in pixels (0-320) and sigmoid scores (0-1) concatenated in one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.boxes, self.scores = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        boxes = torch.relu(self.boxes(h)) * 80.0
        return torch.cat([boxes, torch.sigmoid(self.scores(h))], 1).flatten(2)


class YoloBlocks(nn.Module):
    """YOLOv8's movers of SiLU outputs: a C2f split (halves to a concatenation and to a conv), an SPPF chain of
    max-pools concatenated, and a max-pool then nearest upsampling of a SiLU output concatenated with that output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU())
        self.inner = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.SiLU())
        self.fuse = nn.Sequential(nn.Conv2d(12, 8, 1), nn.SiLU())
        self.sppf = nn.Sequential(nn.Conv2d(32, 8, 1), nn.SiLU())
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.stem(x).chunk(2, 1)
        y = self.fuse(torch.cat([a, b, self.inner(b)], 1))
        p1 = nn.functional.max_pool2d(y, 5, 1, 2)
        p2 = nn.functional.max_pool2d(p1, 5, 1, 2)
        p3 = nn.functional.max_pool2d(p2, 5, 1, 2)
        z = self.sppf(torch.cat([y, p1, p2, p3], 1))
        up = nn.functional.interpolate(nn.functional.max_pool2d(z, 2), scale_factor=2.0, mode="nearest")
        return self.head(torch.cat([up, z], 1))


class Attention(nn.Module):
    """One attention block written with matmuls between activations (no fused op)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(1, 2) * 0.25, dim=-1)
        return self.proj(probs @ v)


class Recognizer(nn.Module):
    """A CRNN in miniature: convs with max-pools, then an LSTM over the columns, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d((4, 1)))  # fmt: skip
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.convs(x).squeeze(2).transpose(1, 2)  # (N, W, C)
        return self.fc(self.lstm(features)[0])


def constant_weight_conv(path: Path) -> Path:
    """x -> Conv (weight from a Constant node, as Paddle2ONNX writes it) -> Relu -> Conv -> y, opset 12."""
    rng = _rng()
    w1 = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    w2 = rng.normal(size=(2, 4, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w1"], value=numpy_helper.from_array(w1)),
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "constant_weights", [_image(3)], [_output("y")],
                              [numpy_helper.from_array(w2, "w2")])  # fmt: skip
    return _save(graph, path, opset=12)


def scale_shift_convs(path: Path) -> Path:
    """PP-LCNetV3's learnt affine layers after convs: x -> Conv(+b) -> Mul(scalar, constant first) -> Add(scalar)
    -> Relu -> Conv -> Mul(per channel [1, C, 1, 1]) -> y1; and that second Mul's input also read by
    Add(x2: a graph input, so not foldable) -> y2."""
    rng = _rng()
    w1, b1 = rng.normal(size=(4, 3, 3, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32)
    w2 = rng.normal(size=(4, 4, 1, 1)).astype(np.float32)
    constants = {"w1": w1, "b1": b1, "w2": w2, "c": np.array([0.7], np.float32), "d": np.array([-0.2], np.float32),
                 "cc": rng.uniform(0.5, 1.5, size=(1, 4, 1, 1)).astype(np.float32)}  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "c1"], ["m1"]),
        helper.make_node("Add", ["m1", "d"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"]),
        helper.make_node("Mul", ["c2", "cc"], ["y1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c3"]),
        helper.make_node("Add", ["c3", "x2"], ["y2"]),
    ]
    inputs = [_image(3), helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["batch", 4, "height", "width"])]
    inits = [numpy_helper.from_array(v, k) for k, v in constants.items()]
    return _save(helper.make_graph(nodes, "scale_shift", inputs, [_output("y1"), _output("y2")], inits), path)


def with_if(path: Path) -> Path:
    """x -> Conv -> Relu -> If(cond: a graph input) {then: Neg, else: Identity} -> Conv -> y."""
    rng = _rng()
    w1, w2 = (rng.normal(size=s).astype(np.float32) for s in ((4, 3, 3, 3), (2, 4, 1, 1)))
    then_graph = helper.make_graph([helper.make_node("Neg", ["r1"], ["t"])], "then", [], [_output("t")])
    else_graph = helper.make_graph([helper.make_node("Identity", ["r1"], ["e"])], "else", [], [_output("e")])
    then_graph.output[0].type.tensor_type.shape.dim[1].dim_value = 4
    else_graph.output[0].type.tensor_type.shape.dim[1].dim_value = 4
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("If", ["flip"], ["branch"], then_branch=then_graph, else_branch=else_graph),
        helper.make_node("Conv", ["branch", "w2"], ["y"]),
    ]
    inputs = [_image(3), helper.make_tensor_value_info("flip", TensorProto.BOOL, [])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    return _save(helper.make_graph(nodes, "with_if", inputs, [_output("y")], inits), path)


def with_custom_op(path: Path) -> Path:
    """x -> Conv -> com.microsoft Gelu (a contrib op ONNX Runtime runs) -> Conv -> y."""
    rng = _rng()
    w1, w2 = (rng.normal(size=s).astype(np.float32) for s in ((4, 3, 3, 3), (2, 4, 1, 1)))
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Gelu", ["c1"], ["g"], domain="com.microsoft"),
        helper.make_node("Conv", ["g", "w2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "custom", [_image(3)], [_output("y")],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])  # fmt: skip
    return _save(graph, path, extra=[helper.make_opsetid("com.microsoft", 1)])


def already_quantized(path: Path) -> Path:
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "z")]
    return _save(helper.make_graph(nodes, "quantized", [_image(3)], [_output("y")], inits), path)


def _rng() -> np.random.Generator:
    """A fresh generator per model: each file is the same whatever ran before it."""
    return np.random.default_rng(0)


def _image(channels: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, "height", "width"])


def _output(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "channels", "height", "width"])


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17, extra: list | None = None) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *(extra or [])])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
