"""A small PyTorch model whose activation channels differ in scale by construction: the equalization tests'."""

from __future__ import annotations

import torch
from torch import nn


def torch_pair(activation: str = "ReLU6") -> nn.Sequential:
    """Conv (8 channels, channel c's weights 2**c / 16) -> BatchNorm (eval, its own affine) -> activation -> 1x1 Conv
    whose input channel c is divided by 2**c: each channel counts as much in the output (as in
    tests/onnx_in/test_equalize.py)."""
    generator = torch.Generator().manual_seed(0)
    spread = 2.0 ** torch.arange(8) / 16
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), getattr(nn, activation)(),
                          nn.Conv2d(8, 4, 1))  # fmt: skip
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(8, 3, 3, 3, generator=generator) * spread.view(-1, 1, 1, 1))
        model[0].bias.zero_()
        model[1].weight.copy_(1 + 0.1 * torch.randn(8, generator=generator))
        model[1].bias.copy_(0.1 * spread)
        model[3].weight.copy_(torch.randn(4, 8, 1, 1, generator=generator) / spread.view(1, -1, 1, 1))
    return model.eval()


def images(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 8, 8, generator=generator) for _ in range(count)]
