"""The residual-add rule: one choice of the input TensorRT fuses, the same on both front ends.

Of the add inputs fed by a weighted op, the deepest branch is fused and the others are quantized, whatever
order the model writes the operands in; on torchvision's ResNet-50 the 4 projection blocks (both inputs from a
conv) quantize the shortcut, like the 12 identity blocks (``out += identity``: the shortcut is input 1). The
Keras twin, keras.applications ResNet50 (``Add([shortcut, main])``), is tests/keras/test_applications.py.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import qdq
from qdq import nn as qnn
from qdq.targets.common.residual import fused_input


@pytest.mark.parametrize(
    ("follows", "depths", "fused"),
    [
        ([False, False], [0, 0], None),  # no weighted input: the add is left alone
        ([True, False], [9, 0], 0),
        ([False, True], [0, 1], 1),
        ([True, True], [3, 1], 0),  # main branch written first (torchvision)
        ([True, True], [1, 3], 1),  # shortcut written first (keras.applications)
        ([True, True], [2, 2], 0),  # a tie: the first in argument order
    ],
)
def test_the_deepest_weighted_input_is_fused(follows, depths, fused):
    asked = []

    def depth(i: int) -> int:
        asked.append(i)
        return depths[i]

    assert fused_input(follows, depth) == fused
    assert asked == ([0, 1] if all(follows) else [])  # depths are only computed to break a two-conv add


class Projection(nn.Module):
    """A residual block with a projection shortcut, written shortcut-first (as Keras writes it), and a head conv
    (an add the model returns is its output tail: float)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.shortcut, self.head = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shortcut(x) + self.b(torch.relu(self.a(x))))


@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
def test_argument_order_does_not_decide(target):
    placed = qdq.quantize_model(Projection(), qdq.QuantConfig(target=target))
    (add,) = [m for m in placed.modules() if isinstance(m, qnn.QuantAdd)]
    expected = [True, False] if target == "tensorrt" else [True, True]  # the shortcut (input 0) is quantized
    assert [q.is_enabled for q in add.input_quantizers] == expected


@pytest.mark.slow
def test_torchvision_resnet50_quantizes_the_shortcut_of_every_block():
    torch.manual_seed(0)
    placed = qdq.quantize_model(torchvision.models.resnet50(num_classes=10), qdq.QuantConfig(target="tensorrt"))
    adds = [m for m in placed.modules() if isinstance(m, qnn.QuantAdd)]
    assert len(adds) == 16
    assert all([q.is_enabled for q in add.input_quantizers] == [False, True] for add in adds)
    blocks_with_projection = [n for n, m in placed.named_modules() if n.endswith("downsample.0")]
    assert len(blocks_with_projection) == 4


class PostNorm(nn.Module):
    """BERT's sublayer output, LayerNorm(dense(h) + x), and the next layer's dense."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.norm, self.next = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.next(self.norm(self.dense(x) + x))


class PreNorm(nn.Module):
    """A pre-LN block (timm's ViT): each sum is read by the next LayerNorm and by the next residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.fc1 = nn.LayerNorm(8), nn.Linear(8, 8)
        self.norm2, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc1(self.norm1(x))
        x = x + self.fc2(self.norm2(x))
        return self.head(nn.functional.layer_norm(x, (8,)))


@pytest.mark.parametrize("block", [PostNorm, PreNorm])
def test_transformer_residual_adds_stay_float_for_onnx_runtime_only(block):
    """ORT: no int8 LayerNorm reads the sum, so a quantized add would leave standalone DQs before a float Add
    (and block ORT's SkipLayerNormalization); TensorRT still quantizes the shortcut."""
    ort_model = qdq.quantize_model(block(), qdq.QuantConfig(target="onnxruntime"))
    assert not [m for m in ort_model.modules() if isinstance(m, qnn.QuantAdd)]
    assert all(isinstance(m, qnn.QuantLinear) for m in ort_model.modules() if isinstance(m, nn.Linear))
    trt_model = qdq.quantize_model(block(), qdq.QuantConfig(target="tensorrt"))
    adds = [m for m in trt_model.modules() if isinstance(m, qnn.QuantAdd)]
    assert len(adds) == (1 if block is PostNorm else 2)
    assert all(sum(q.is_enabled for q in add.input_quantizers) == 1 for add in adds)
