"""Quantized linear layer: input per tensor, weight per output row (axis 0). The bias stays float."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qdq import descriptor as d
from qdq.descriptor import QuantDescriptor
from qdq.nn.base import QuantMixin
from qdq.nn.registry import quantizes

__all__ = ["QuantLinear"]


@quantizes(nn.Linear)
class QuantLinear(QuantMixin, nn.Linear):
    """``nn.Linear`` with quantized input and weight."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(self._input_quantizer(input), self._weight_quantizer(self.weight), self.bias)
