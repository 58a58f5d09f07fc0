"""Quantized convolutions: input quantized per tensor, weight per output channel (axis 0).

ConvTranspose weights are laid out ``(in_channels, out_channels / groups, *kernel)``; their per-channel
axis is 0 as well, the per-*input*-channel scale TensorRT's deconvolution kernels need (TensorRT#1694).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, cast

import torch
from torch import nn

from qdq import descriptor as d
from qdq.descriptor import QuantDescriptor
from qdq.nn.base import QuantMixin
from qdq.nn.registry import quantizes

__all__ = [
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantConvTranspose1d",
    "QuantConvTranspose2d",
    "QuantConvTranspose3d",
]


class _QuantConvNd(QuantMixin):
    # What the torch convolution each class is combined with provides (QuantConv2d(_QuantConvNd, nn.Conv2d)).
    weight: torch.Tensor
    bias: torch.Tensor | None
    _conv_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        quant_input = self._input_quantizer(input)
        quant_weight = self._weight_quantizer(self.weight)
        return self._conv_forward(quant_input, quant_weight, self.bias)

    @classmethod
    def sample_input(cls, module: nn.Module) -> torch.Tensor:
        """Zeros of batch 1, ``module``'s input channels and, per spatial axis, a few strides more than its
        dilated kernel (no padding needed)."""
        conv = cast(nn.modules.conv._ConvNd, module)
        weight = conv.weight
        sizes = [(k - 1) * d + 2 * s + 1 for k, s, d in zip(conv.kernel_size, conv.stride, conv.dilation, strict=True)]
        return torch.zeros(1, conv.in_channels, *sizes, dtype=weight.dtype, device=weight.device)


@quantizes(nn.Conv1d)
class QuantConv1d(_QuantConvNd, nn.Conv1d):
    """``nn.Conv1d`` with quantized input and weight."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL
    weighted_function = staticmethod(torch.conv1d)


@quantizes(nn.Conv2d)
class QuantConv2d(_QuantConvNd, nn.Conv2d):
    """``nn.Conv2d`` with quantized input and weight."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL
    weighted_function = staticmethod(torch.conv2d)


@quantizes(nn.Conv3d)
class QuantConv3d(_QuantConvNd, nn.Conv3d):
    """``nn.Conv3d`` with quantized input and weight."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL
    weighted_function = staticmethod(torch.conv3d)


class _QuantConvTransposeNd(_QuantConvNd):
    _functional: ClassVar[Any]
    _spatial_dims: ClassVar[int]
    # What nn.ConvTransposeNd provides (its types, as torch declares them).
    stride: tuple[int, ...]
    padding: str | tuple[int, ...]
    dilation: tuple[int, ...]
    kernel_size: tuple[int, ...]
    groups: int
    padding_mode: Literal["zeros", "reflect", "replicate", "circular"]
    _output_padding: Callable[..., list[int]]

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.padding_mode != "zeros":
            raise ValueError(f"Only 'zeros' padding mode is supported for {type(self).__name__}")
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, self._spatial_dims, self.dilation
        )
        quant_input = self._input_quantizer(input)
        quant_weight = self._weight_quantizer(self.weight)
        return type(self)._functional(
            quant_input, quant_weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation
        )


@quantizes(nn.ConvTranspose1d)
class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL
    _functional = staticmethod(nn.functional.conv_transpose1d)
    _spatial_dims = 1


@quantizes(nn.ConvTranspose2d)
class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL
    _functional = staticmethod(nn.functional.conv_transpose2d)
    _spatial_dims = 2


@quantizes(nn.ConvTranspose3d)
class QuantConvTranspose3d(_QuantConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL
    _functional = staticmethod(nn.functional.conv_transpose3d)
    _spatial_dims = 3
