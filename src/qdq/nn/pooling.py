"""Quantized pooling: the input is quantized, then pooled by the torch module."""

from __future__ import annotations

from torch import nn

from qdq.nn.base import InputQuantized as _QuantInputOnly
from qdq.nn.registry import quantizes

__all__ = [
    "QuantAdaptiveAvgPool1d",
    "QuantAdaptiveAvgPool2d",
    "QuantAdaptiveAvgPool3d",
    "QuantAvgPool1d",
    "QuantAvgPool2d",
    "QuantAvgPool3d",
    "QuantMaxPool1d",
    "QuantMaxPool2d",
    "QuantMaxPool3d",
]


@quantizes(nn.MaxPool1d, by_default=False)
class QuantMaxPool1d(_QuantInputOnly, nn.MaxPool1d):
    """``nn.MaxPool1d`` on a quantized input."""


@quantizes(nn.MaxPool2d, by_default=False)
class QuantMaxPool2d(_QuantInputOnly, nn.MaxPool2d):
    """``nn.MaxPool2d`` on a quantized input."""


@quantizes(nn.MaxPool3d, by_default=False)
class QuantMaxPool3d(_QuantInputOnly, nn.MaxPool3d):
    """``nn.MaxPool3d`` on a quantized input."""


@quantizes(nn.AvgPool1d)
class QuantAvgPool1d(_QuantInputOnly, nn.AvgPool1d):
    """``nn.AvgPool1d`` on a quantized input."""


@quantizes(nn.AvgPool2d)
class QuantAvgPool2d(_QuantInputOnly, nn.AvgPool2d):
    """``nn.AvgPool2d`` on a quantized input."""


@quantizes(nn.AvgPool3d)
class QuantAvgPool3d(_QuantInputOnly, nn.AvgPool3d):
    """``nn.AvgPool3d`` on a quantized input."""


@quantizes(nn.AdaptiveAvgPool1d)
class QuantAdaptiveAvgPool1d(_QuantInputOnly, nn.AdaptiveAvgPool1d):
    """``nn.AdaptiveAvgPool1d`` on a quantized input."""


@quantizes(nn.AdaptiveAvgPool2d)
class QuantAdaptiveAvgPool2d(_QuantInputOnly, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on a quantized input."""


@quantizes(nn.AdaptiveAvgPool3d)
class QuantAdaptiveAvgPool3d(_QuantInputOnly, nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` on a quantized input."""
