"""Quantized multi-input operations that torch expresses as functions: add, concat, matmul.

TensorRT needs these quantized to keep a network in INT8 (a residual ``Add`` whose skip input carries a
Q/DQ fuses into the preceding convolution; a ``Concat`` needs one scale for all inputs). Use them in a
model's ``forward`` in place of ``a + b``, ``torch.cat`` and ``a @ b``; ``qdq.placement`` inserts them
automatically for the architectures it knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from qdq.descriptor import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor
from qdq.errors import QdqConfigError
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer

__all__ = ["QuantAdd", "QuantConcat", "QuantMatMul"]


def _desc(desc: QuantDescriptor | None) -> QuantDescriptor:
    return QUANT_DESC_8BIT_PER_TENSOR if desc is None else desc


class QuantAdd(QuantModule, nn.Module):
    """``a + b`` with each input quantized by its own quantizer.

    Args:
        quant_desc_input: descriptor of both input quantizers.
        quantize: which inputs to quantize, e.g. ``(False, True)`` for TensorRT's residual rule: the
            output of a conv stays float, the skip branch is quantized.
    """

    def __init__(
        self, quant_desc_input: QuantDescriptor | None = None, quantize: Sequence[bool] = (True, True)
    ) -> None:
        super().__init__()
        if len(quantize) != 2:
            raise QdqConfigError(f"quantize needs one flag per input (2), got {tuple(quantize)}.")
        quantizers = [TensorQuantizer(_desc(quant_desc_input), role="input") for _ in range(2)]
        for quantizer, on in zip(quantizers, quantize):
            if not on:
                quantizer.disable()
        self.input_quantizers = nn.ModuleList(quantizers)

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        return cast("tuple[TensorQuantizer, ...]", tuple(self.input_quantizers))  # a ModuleList of them

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.input_quantizers[0](a) + self.input_quantizers[1](b)


class QuantConcat(QuantModule, nn.Module):
    """``torch.cat(tensors, dim)`` with one quantizer shared by every input (one scale, as TensorRT needs)."""

    def __init__(self, dim: int = 1, quant_desc_input: QuantDescriptor | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.input_quantizer = TensorQuantizer(_desc(quant_desc_input), role="input")

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        """The shared quantizer, for every tensor of the sequence argument."""
        return (self.input_quantizer,)

    def forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # One scale for all inputs, so quantizing the concatenation equals concatenating the quantized
        # inputs; doing it in this order also gives a dynamic (uncalibrated) range over all of them.
        return self.input_quantizer(torch.cat(list(tensors), dim=self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class QuantMatMul(QuantModule, nn.Module):
    """``a @ b`` with both operands quantized (per tensor by default)."""

    def __init__(self, quant_desc_input: QuantDescriptor | None = None) -> None:
        super().__init__()
        self.input_quantizers = nn.ModuleList(TensorQuantizer(_desc(quant_desc_input), role="input") for _ in range(2))

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        return cast("tuple[TensorQuantizer, ...]", tuple(self.input_quantizers))  # a ModuleList of them

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.input_quantizers[0](a), self.input_quantizers[1](b))
