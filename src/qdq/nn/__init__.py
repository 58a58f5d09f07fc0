"""Quantized modules (seed path: ``from pytorch_quantization import nn as quant_nn``).

``from qdq import nn as quant_nn`` gives ``quant_nn.QuantConv2d``, ``quant_nn.TensorQuantizer``, and the
seed's short aliases (``quant_nn.Conv2d`` is ``QuantConv2d``).
"""

from qdq.clip import Clip
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import InputQuantized, QuantInputMixin, QuantMixin, QuantModule, pop_quant_desc_in_kwargs
from qdq.nn.conv import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)
from qdq.nn.elementwise import QuantAdd, QuantConcat, QuantMatMul
from qdq.nn.linear import QuantLinear
from qdq.nn.multihead_attention import QuantMultiheadAttention
from qdq.nn.norm import QuantInstanceNorm1d, QuantInstanceNorm2d, QuantInstanceNorm3d
from qdq.nn.pooling import (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantMaxPool1d,
    QuantMaxPool2d,
    QuantMaxPool3d,
)
from qdq.nn.rnn import QuantLSTM, QuantLSTMCell
from qdq.quantizer import TensorQuantizer

# The seed's aliases without the "Quant" prefix.
Conv1d, Conv2d, Conv3d = QuantConv1d, QuantConv2d, QuantConv3d
ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d
Linear = QuantLinear
MaxPool1d, MaxPool2d, MaxPool3d = QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d
AvgPool1d, AvgPool2d, AvgPool3d = QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
)
InstanceNorm1d, InstanceNorm2d, InstanceNorm3d = QuantInstanceNorm1d, QuantInstanceNorm2d, QuantInstanceNorm3d
LSTM, LSTMCell = QuantLSTM, QuantLSTMCell

__all__ = [
    "LSTM", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "Clip", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "InputQuantized", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LSTMCell", "Linear",
    "MaxPool1d", "MaxPool2d", "MaxPool3d",
    "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d", "QuantAdd",
    "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d", "QuantConcat",
    "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose1d", "QuantConvTranspose2d",
    "QuantConvTranspose3d", "QuantInputMixin", "QuantInstanceNorm1d", "QuantInstanceNorm2d",
    "QuantInstanceNorm3d", "QuantLSTM", "QuantLSTMCell", "QuantLinear", "QuantMatMul",
    "QuantMaxPool1d", "QuantMaxPool2d",
    "QuantMaxPool3d", "QuantMixin", "QuantModule", "QuantMultiheadAttention", "QuantScaledDotProductAttention",
    "TensorQuantizer", "pop_quant_desc_in_kwargs",
]  # fmt: skip
