"""The default selection is one rule: the op types of what module replacement swaps by default are the ones the
ONNX door selects first (``qdq.graphs.ops.QUANTIZED_BY_DEFAULT``), besides the seed's recurrent and attention
modules; MaxPool and InstanceNorm stay float, as the seed leaves them."""

from torch import nn

from qdq.graphs import fx_ops
from qdq.graphs.ops import ATTENTION, QUANTIZED_BY_DEFAULT, RECURRENT
from qdq.nn.registry import QUANT_MODULES, default_float_types

_EXAMPLES = {
    nn.Conv1d: lambda: nn.Conv1d(1, 1, 1), nn.Conv2d: lambda: nn.Conv2d(1, 1, 1), nn.Conv3d: lambda: nn.Conv3d(1, 1, 1),
    nn.ConvTranspose1d: lambda: nn.ConvTranspose1d(1, 1, 1), nn.ConvTranspose2d: lambda: nn.ConvTranspose2d(1, 1, 1),
    nn.ConvTranspose3d: lambda: nn.ConvTranspose3d(1, 1, 1), nn.Linear: lambda: nn.Linear(1, 1),
    nn.AvgPool1d: lambda: nn.AvgPool1d(1), nn.AvgPool2d: lambda: nn.AvgPool2d(1), nn.AvgPool3d: lambda: nn.AvgPool3d(1),
    nn.AdaptiveAvgPool1d: lambda: nn.AdaptiveAvgPool1d(1), nn.AdaptiveAvgPool2d: lambda: nn.AdaptiveAvgPool2d(1),
    nn.AdaptiveAvgPool3d: lambda: nn.AdaptiveAvgPool3d(1), nn.LSTM: lambda: nn.LSTM(1, 1),
    nn.LSTMCell: lambda: nn.LSTMCell(1, 1), nn.MultiheadAttention: lambda: nn.MultiheadAttention(4, 1),
    nn.MaxPool2d: lambda: nn.MaxPool2d(1), nn.InstanceNorm2d: lambda: nn.InstanceNorm2d(1),
}  # fmt: skip


def _op_type(cls: type) -> str:
    return fx_ops._module_type(_EXAMPLES[cls]())[0]


def test_module_replacement_swaps_by_default_what_every_door_selects_first():
    defaults = set(default_float_types())
    assert defaults <= set(_EXAMPLES), "a new default class: add an example of it here"
    types = {_op_type(cls) for cls in defaults}
    # the seed's QuantLSTM/QuantLSTMCell and QuantMultiheadAttention are PyTorch's own; a MatMul of two activations
    # is a function call there (attention's, captured with its module); an adaptive average pool is PyTorch's
    # global one
    assert types - RECURRENT - {ATTENTION, "torch:MultiheadAttention"} <= QUANTIZED_BY_DEFAULT
    assert QUANTIZED_BY_DEFAULT - {"MatMul", "GlobalAveragePool"} <= types


def test_what_the_seed_leaves_float_is_not_selected_by_default():
    for cls in (nn.MaxPool2d, nn.InstanceNorm2d):
        assert cls in QUANT_MODULES and cls not in default_float_types()
        assert _op_type(cls) not in QUANTIZED_BY_DEFAULT
