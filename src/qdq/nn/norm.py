"""Quantized instance normalization: the input is quantized, then normalized in float."""

from __future__ import annotations

from torch import nn

from qdq.nn.base import InputQuantized as _QuantInputOnly
from qdq.nn.registry import quantizes

__all__ = ["QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d"]


@quantizes(nn.InstanceNorm1d, by_default=False)
class QuantInstanceNorm1d(_QuantInputOnly, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` on a quantized input."""


@quantizes(nn.InstanceNorm2d, by_default=False)
class QuantInstanceNorm2d(_QuantInputOnly, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` on a quantized input."""


@quantizes(nn.InstanceNorm3d, by_default=False)
class QuantInstanceNorm3d(_QuantInputOnly, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` on a quantized input."""
