"""Folding BatchNormalization into the quantized convolution before it, for export.

Keras 3 exports BatchNormalization as ``Mul`` + ``Add`` after the Conv, which neither TensorRT's nor
ONNX Runtime's int8 fusions absorb. ``fold_batchnorms`` returns a copy of a quantized model in which each
BN that is the only reader of a quantized Conv2D / DepthwiseConv2D (without activation) is merged into it:
per output channel ``k = gamma / sqrt(moving_variance + epsilon)``, kernel ``w * k``, bias ``(b - mean) * k +
beta``. The folded kernel is then quantized per channel with its own ``max|w * k|``, which is ``|k|``
times the unfolded range: the same grid scaled, equal up to float32 rounding. This is the inference
form (BN with its moving statistics); QAT keeps the BN layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qdq.keras._backend import keras
from qdq.keras.graph import consumers, producers

__all__ = ["fold_batchnorms", "foldable_pairs"]

_FOLDABLE = ("Conv2DQuantizeWrapper", "DepthwiseConv2DQuantizeWrapper")
# what a QuantizeWrapper's config holds besides the layer (its constructor's parameters)
_WRAPPER_SETTINGS = ("quantize_inputs", "input_indices", "quantize_weight", "num_bits", "calibrated",
                     "unsigned_indices", "target", "weight_bits")  # fmt: skip


def _folded_placeholder(name: str) -> Any:
    """An identity layer that takes the place of a folded BN (and accepts the arguments BN was called with)."""

    layer: Any = keras().layers.Layer  # a base class read at run time

    class FoldedBatchNormalization(layer):
        def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
            return inputs

    return FoldedBatchNormalization(name=name)


def foldable_pairs(model: Any) -> list[tuple[Any, Any]]:
    """``(conv wrapper, batch norm)`` pairs of ``model`` that :func:`fold_batchnorms` merges."""
    pairs = []
    for layer in model.layers:
        if type(layer).__name__ != "BatchNormalization":
            continue
        parents = producers(layer)
        if len(parents) != 1 or type(parents[0]).__name__ not in _FOLDABLE:
            continue
        conv = parents[0]
        linear = getattr(conv.layer.activation, "__name__", "") == "linear"
        if linear and len(consumers(model, conv)) == 1 and len(conv._inbound_nodes) == 1:
            pairs.append((conv, layer))
    return pairs


def _bn_factor(bn: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(k, shift)`` with ``bn(y) = y * k + shift`` per channel (moving statistics)."""
    mean = np.asarray(bn.moving_mean.numpy(), np.float64)
    var = np.asarray(bn.moving_variance.numpy(), np.float64)
    gamma = np.asarray(bn.gamma.numpy(), np.float64) if bn.scale else np.ones_like(mean)
    beta = np.asarray(bn.beta.numpy(), np.float64) if bn.center else np.zeros_like(mean)
    k = gamma / np.sqrt(var + bn.epsilon)
    return k, beta - mean * k


def _folded_conv(wrapper: Any, bn: Any) -> Any:
    """A new wrapper of a conv with ``bn`` folded in, same quantization settings and input ranges."""
    inner = wrapper.layer
    config = dict(inner.get_config(), use_bias=True, name=inner.name)
    layer = type(inner).from_config(config)
    layer.build(wrapper._inbound_nodes[0].input_tensors[0].shape)
    factor, shift = _bn_factor(bn)
    kernel = np.asarray(inner.kernel.numpy(), np.float64)
    if type(wrapper).__name__ == "DepthwiseConv2DQuantizeWrapper":
        kernel = kernel * factor.reshape(kernel.shape[2], kernel.shape[3])
    else:
        kernel = kernel * factor
    bias = np.asarray(inner.bias.numpy(), np.float64) if inner.use_bias else 0.0
    layer.kernel.assign(kernel.astype(np.float32))
    layer.bias.assign((bias * factor + shift).astype(np.float32))
    settings = {k: v for k, v in wrapper.get_config().items() if k in _WRAPPER_SETTINGS}
    return type(wrapper)(layer, name=wrapper.name, **settings)


def fold_batchnorms(model: Any) -> Any:
    """A copy of quantized ``model`` with BN folded into the quantized convs before it (see the module doc)."""
    k = keras()
    pairs = foldable_pairs(model)
    if not pairs:
        return model
    replace: dict[str, Any] = {}
    for conv, bn in pairs:
        replace[conv.name] = _folded_conv(conv, bn)
        replace[bn.name] = _folded_placeholder(bn.name)
    folded = k.models.clone_model(model, clone_function=lambda layer: replace.get(layer.name, layer))
    old = {layer.name: layer for layer in model.layers}
    for conv, _ in pairs:
        new = folded.get_layer(conv.name)
        for target, source in zip(new.input_amax, old[conv.name].input_amax):
            target.assign(source)
    return folded
