"""PyTorch and Keras place Q/DQ identically: one rule set, two front ends, the same exported graph.

Four architectures are written in both frameworks (a ResNet block with a projection shortcut, a MobileNetV2
inverted residual, an EfficientNet block with squeeze-excitation, a block concatenating two branches), quantized
for each target, calibrated, exported, and compared by operation role: for every quantized activation tensor of
each ONNX graph, what produces it and which ops read it dequantized (looking through the layout ops and the
BatchNorms the exporters write differently), and its grid (signed or unsigned).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
from qdq.errors import QdqBackendUnavailable
from qdq.export import export_onnx
from qdq.keras import _backend

try:
    keras = _backend.keras()  # through qdq: Triton first where it is installed (after TensorFlow it crashes)
except QdqBackendUnavailable:
    pytest.skip("the Keras front end needs TensorFlow: pip install 'qdq[tf]'", allow_module_level=True)
pytest.importorskip("tf2onnx", reason="the Keras export needs tf2onnx: pip install 'qdq[tf]'")
import qdq.keras as qk

_LOOK_THROUGH = {"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "BatchNormalization",
                 "Cast"}  # fmt: skip
_SAME = {"ReduceMean": "GlobalAveragePool", "MatMul": "Gemm", "HardSigmoid": "Sigmoid"}
SIZE, CHANNELS = 12, 8


# ----------------------------------------------------------------------------------------------- PyTorch
def _conv_bn(cin: int, cout: int, k: int = 3, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class TorchResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, CHANNELS), nn.ReLU())
        self.main = nn.Sequential(*_conv_bn(CHANNELS, 2 * CHANNELS), nn.ReLU(), *_conv_bn(2 * CHANNELS, 2 * CHANNELS))
        self.shortcut = nn.Sequential(*_conv_bn(CHANNELS, 2 * CHANNELS, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)  # a module: quantized like Keras's GlobalAveragePooling2D
        self.head = nn.Linear(2 * CHANNELS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.main(x) + self.shortcut(x))
        return self.head(self.pool(y).flatten(1))


class TorchMobile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, CHANNELS), nn.ReLU6())
        self.block = nn.Sequential(*_conv_bn(CHANNELS, 4 * CHANNELS, 1), nn.ReLU6(),
                                   *_conv_bn(4 * CHANNELS, 4 * CHANNELS, 3, groups=4 * CHANNELS), nn.ReLU6(),
                                   *_conv_bn(4 * CHANNELS, CHANNELS, 1))  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d(1)  # a module: quantized like Keras's GlobalAveragePooling2D
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = x + self.block(x)
        return self.head(self.pool(y).flatten(1))


class TorchEfficient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, CHANNELS), nn.SiLU())
        self.dw = nn.Sequential(*_conv_bn(CHANNELS, CHANNELS, 3, groups=CHANNELS), nn.SiLU())
        self.fc1, self.fc2 = nn.Conv2d(CHANNELS, 4, 1), nn.Conv2d(4, CHANNELS, 1)
        self.project = nn.Sequential(*_conv_bn(CHANNELS, CHANNELS, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)  # a module: quantized like Keras's GlobalAveragePooling2D
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        h = self.dw(x)
        gate = torch.sigmoid(self.fc2(nn.functional.silu(self.fc1(self.pool(h)))))
        y = x + self.project(h * gate)
        return self.head(self.pool(y).flatten(1))


class TorchConcat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, CHANNELS), nn.ReLU())
        self.a = nn.Sequential(*_conv_bn(CHANNELS, CHANNELS, 1), nn.ReLU())
        self.b = nn.Sequential(*_conv_bn(CHANNELS, CHANNELS, 3), nn.ReLU())
        self.merge = nn.Sequential(*_conv_bn(2 * CHANNELS, CHANNELS, 1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)  # a module: quantized like Keras's GlobalAveragePooling2D
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(self.stem(x), 2)
        y = self.merge(torch.cat([self.a(x), self.b(x)], 1))
        return self.head(self.pool(y).flatten(1))


# ------------------------------------------------------------------------------------------------- Keras
def _k_conv_bn(x, filters: int, k: int = 3, depthwise: bool = False):
    layers = keras.layers
    conv = layers.DepthwiseConv2D(k, padding="same", use_bias=False) if depthwise else \
        layers.Conv2D(filters, k, padding="same", use_bias=False)  # fmt: skip
    return layers.BatchNormalization()(conv(x))


def _keras_head(y):
    return keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(y))


def keras_resnet():
    inputs = keras.Input((SIZE, SIZE, 3))
    x = keras.layers.ReLU()(_k_conv_bn(inputs, CHANNELS))
    main = _k_conv_bn(keras.layers.ReLU()(_k_conv_bn(x, 2 * CHANNELS)), 2 * CHANNELS)
    y = keras.layers.ReLU()(keras.layers.Add()([_k_conv_bn(x, 2 * CHANNELS, 1), main]))  # shortcut first
    return keras.Model(inputs, _keras_head(y))


def keras_mobile():
    relu6 = lambda: keras.layers.ReLU(6.0)  # noqa: E731
    inputs = keras.Input((SIZE, SIZE, 3))
    x = relu6()(_k_conv_bn(inputs, CHANNELS))
    h = relu6()(_k_conv_bn(x, 4 * CHANNELS, 1))
    h = relu6()(_k_conv_bn(h, 4 * CHANNELS, 3, depthwise=True))
    y = keras.layers.Add()([x, _k_conv_bn(h, CHANNELS, 1)])
    return keras.Model(inputs, _keras_head(y))


def keras_efficient():
    layers = keras.layers
    inputs = keras.Input((SIZE, SIZE, 3))
    x = layers.Activation("swish")(_k_conv_bn(inputs, CHANNELS))
    h = layers.Activation("swish")(_k_conv_bn(x, CHANNELS, 3, depthwise=True))
    gate = layers.GlobalAveragePooling2D(keepdims=True)(h)
    gate = layers.Conv2D(CHANNELS, 1, activation="sigmoid")(layers.Conv2D(4, 1, activation="swish")(gate))
    y = layers.Add()([x, _k_conv_bn(layers.Multiply()([h, gate]), CHANNELS, 1)])
    return keras.Model(inputs, _keras_head(y))


def keras_concat():
    layers = keras.layers
    inputs = keras.Input((SIZE, SIZE, 3))
    x = layers.MaxPooling2D(2)(layers.ReLU()(_k_conv_bn(inputs, CHANNELS)))
    a, b = layers.ReLU()(_k_conv_bn(x, CHANNELS, 1)), layers.ReLU()(_k_conv_bn(x, CHANNELS, 3))
    y = layers.ReLU()(_k_conv_bn(layers.Concatenate()([a, b]), CHANNELS, 1))
    return keras.Model(inputs, _keras_head(y))


ARCHITECTURES = {
    "resnet_projection": (TorchResNet, keras_resnet),
    "mobilenet_v2_block": (TorchMobile, keras_mobile),
    "efficientnet_se_block": (TorchEfficient, keras_efficient),
    "concat_block": (TorchConcat, keras_concat),
}


# ------------------------------------------------------------------------------------------- comparing
def placement_by_role(path) -> Counter:
    """``(producer role, reader roles, grid)`` of every quantized activation tensor of an ONNX graph, counted."""
    graph = onnx.load(str(path)).graph
    constants = {t.name for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def role_before(name: str) -> str:
        node = producer.get(name)
        while node is not None and node.op_type in _LOOK_THROUGH | {"DequantizeLinear", "QuantizeLinear"}:
            node = producer.get(node.input[0])
        return "input" if node is None else _SAME.get(node.op_type, node.op_type)

    def roles_after(name: str) -> list[str]:
        found = ["output"] if name in outputs else []
        for node in readers.get(name, []):
            found += roles_after(node.output[0]) if node.op_type in _LOOK_THROUGH else [_SAME.get(node.op_type,
                                                                                                    node.op_type)]
        return found

    by_tensor: dict[str, tuple[str, str, set]] = {}
    for q in (n for n in graph.node if n.op_type == "QuantizeLinear"):
        source = q.input[0]
        if source in constants or (producer.get(source) is not None and producer[source].op_type == "Constant"):
            continue
        zero = next((t for t in graph.initializer if t.name == q.input[2]), None) if len(q.input) > 2 else None
        grid = "unsigned" if zero is not None and onnx.numpy_helper.to_array(zero).tolist() == 0 and \
            zero.data_type == onnx.TensorProto.UINT8 else "signed"  # fmt: skip
        reads = {role for dq in readers.get(q.output[0], []) for role in roles_after(dq.output[0])}
        by_tensor.setdefault(source, (role_before(source), grid, set()))[2].update(reads)
    return Counter((role, tuple(sorted(reads)), grid) for role, grid, reads in by_tensor.values())


def _torch_export(factory, target: str, tmp_path) -> object:
    torch.manual_seed(0)
    model = qdq.quantize_model(factory().eval(), qdq.QuantConfig(target=target))
    x = torch.randn(4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    qdq.calibrate(model, [x], method="max", progress=False)
    return export_onnx(model, x, tmp_path / "torch.onnx")


def _keras_export(factory, target: str, tmp_path) -> object:
    keras.utils.set_random_seed(0)
    qmodel = qk.quantize_model(factory(), target=target)
    x = np.random.default_rng(1).normal(size=(4, SIZE, SIZE, 3)).astype(np.float32)
    qk.calibrate(qmodel, [x], method="max")
    return qk.export_onnx(qmodel, x, tmp_path / "keras.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_pytorch_and_keras_place_qdq_at_the_same_operations(architecture, target, tmp_path):
    torch_factory, keras_factory = ARCHITECTURES[architecture]
    torch_roles = placement_by_role(_torch_export(torch_factory, target, tmp_path))
    keras_roles = placement_by_role(_keras_export(keras_factory, target, tmp_path))
    assert torch_roles and torch_roles == keras_roles, (
        f"only in PyTorch: {torch_roles - keras_roles}; only in Keras: {keras_roles - torch_roles}"
    )
