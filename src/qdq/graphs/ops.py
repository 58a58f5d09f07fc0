"""The op vocabulary of the placement language: ONNX op types, and what placement needs to know about each.

Every front end names its operations with the ONNX op type its exporter writes (a PyTorch ``nn.Conv2d`` and a
Keras ``Conv2D`` are both ``"Conv"``; ``nn.Linear`` and ``Dense`` are ``"Gemm"``), so that a placement rule and a
target's fusion facts are written once, in the language every runtime's facts are already written in. Two
names are not ONNX ops: ``"Silu"`` (``x * Sigmoid(x)``, which exporters write as those two ops: the view keeps
it one activation and exposes the sigmoid as an inner value) and ``"Attention"`` (qdq's quantized attention
module, ``softmax(Q·Kᵀ·s)·V``). An op a front end does not know is named ``"<front end>:<its class>"``, which
no rule matches.

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ACTIVATIONS",
    "ATTENTION",
    "ATTENTION_SITES",
    "AVERAGE_POOLS",
    "FEATURE_NORMS",
    "IDENTITIES",
    "KEEP_SIGN",
    "LAYOUT",
    "NORMS",
    "QUANTIZED_BY_DEFAULT",
    "RECURRENT",
    "SILU",
    "WEIGHTED",
    "is_non_negative_op",
    "keeps_sign",
]

#: Ops that multiply their input by a weight: TensorRT and ONNX Runtime run them in int8.
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: The average pools: their inputs are quantized as the weighted ops' are (the seed's QuantAvgPool modules).
AVERAGE_POOLS = frozenset({"AveragePool", "GlobalAveragePool"})
#: The ops whose data inputs (and weights) every front end quantizes before any target's rule runs: what module
#: replacement swaps on the PyTorch path (besides the seed's LSTM and attention modules), the Keras layers "full"
#: quantization wraps, and the ONNX door's first selection. Everything else is the targets' rules' to decide.
QUANTIZED_BY_DEFAULT = WEIGHTED | AVERAGE_POOLS
#: The normalization a runtime folds into the weighted op before it.
NORMS = frozenset({"BatchNormalization"})
#: Normalizations over features (a transformer's): they read and write float.
FEATURE_NORMS = frozenset({"LayerNormalization", "GroupNormalization", "RMSNormalization", "InstanceNormalization"})
#: The identity at inference (dropout, stochastic depth).
IDENTITIES = frozenset({"Identity", "Dropout"})
SILU = "Silu"
#: values computed inside one op that a rule may quantize (the front end splits the op then): op type -> names
INNER_VALUES: dict[str, tuple[str, ...]] = {SILU: ("sigmoid",)}
ATTENTION = "Attention"
#: What a target may quantize in an ``Attention`` op, in the order the data meets them: the two inputs of ``Q·Kᵀ``,
#: the softmax output (the probabilities) and ``V``, the other input of ``probs·V``. A target's attention facts name
#: them (:class:`qdq.targets.AttentionFacts`); each front end knows where they are in its model (the PyTorch
#: module's four quantizers, in this order; the ONNX op's inputs 0, 1, 2 and its inner value ``"probs"``).
ATTENTION_SITES = ("query", "key", "probs", "value")
#: Elementwise activations (what a runtime may fuse after a weighted op).
ACTIVATIONS = frozenset({"Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Gelu", "HardSwish",
                         "HardSigmoid", "Mish", "Softplus", "PRelu", SILU})  # fmt: skip
#: Recurrent layers.
RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
#: Ops that only move or reshape data: a runtime adds them around its kernels.
LAYOUT = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
#: Ops whose output is >= 0 wherever every data input is (pooling, moving, padding with 0, sums, products, ...;
#: an ``If``, whose view reads what its branches return).
KEEP_SIGN = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax",
                       "Pad", "Resize", "Slice", "Split", "Gather", "Concat", "Add", "Mul", "DepthToSpace",
                       "SpaceToDepth", "Expand", "Tile", "If", *LAYOUT})  # fmt: skip
_NON_NEGATIVE = frozenset({"Relu", "Sigmoid", "Softmax", "HardSigmoid"})


def is_non_negative_op(op_type: str, attrs: Mapping[str, Any]) -> bool:
    """Is every output of an ``op_type`` op >= 0 whatever its input (ReLU, Sigmoid, Softmax, a Clip at >= 0)?"""
    if op_type in _NON_NEGATIVE:
        return True
    low = attrs.get("min")
    return op_type == "Clip" and low is not None and float(low) >= 0.0


def keeps_sign(op_type: str, attrs: Mapping[str, Any]) -> bool:
    """Is an ``op_type`` op's output >= 0 when its data inputs are (cubic resizing overshoots; a Pad with a
    negative constant does not)?"""
    if op_type == "Resize":
        return attrs.get("mode", "nearest") != "cubic"
    if op_type == "Pad":
        return attrs.get("mode", "constant") != "constant" or float(attrs.get("value", 0.0)) >= 0.0
    return op_type in KEEP_SIGN
