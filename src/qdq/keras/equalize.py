"""Cross-layer equalization in the Keras door: :mod:`qdq.workflow.equalization` on a quantized Keras model, the
first step of ``method="auto"`` (:mod:`qdq.keras.auto`), as in the PyTorch and ONNX doors.

The pairs are the shared rule's (:func:`~qdq.workflow.equalization.equalization_pairs`) on the model's view, its
wrappers read as the layers they wrap and its quantizers as their plans say (:func:`quantized_view`). The activation
between the two convolutions is measured float (every wrapper bypassed) on the first calibration batches; then
``first``'s kernel and bias, or its ``BatchNormalization``'s gamma and beta, and ``second``'s kernel are rewritten in
their variables. The wrappers take each call's kernel range from the kernel itself, so the weights' per-channel
ranges follow. The shared functions read kernels in PyTorch's ``[out, in / groups, *kernel]``: a Keras ``Conv``
kernel ``(*kernel, in / groups, out)`` and a ``DepthwiseConv`` kernel ``(*kernel, in, multiplier)`` (output channel
``c * multiplier + m``) are read so and written back. A layer called more than once, a ``SeparableConv`` and a
``BatchNormalization`` without both gamma and beta are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qdq.graphs.keras import LayerPlan, build_view
from qdq.graphs.view import GraphView
from qdq.keras._backend import keras
from qdq.workflow.equalization import (
    Pair,
    Scaling,
    equalization_pairs,
    levels_of,
    plan_scaling,
    scaled_first,
    scaled_second,
    stats_of,
)

__all__ = ["assign", "equalize", "quantized_view", "restore"]

_CONVS = frozenset({"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv1D", "DepthwiseConv2D"})


def quantized_view(model: Any) -> GraphView:
    """The view of a quantized Keras model: each wrapper an op of the layer it wraps, its quantizers as its settings
    say (inputs, unsigned grids, tied ranges, kernel; none for a layer kept float)."""
    from qdq.keras.wrappers import QuantizeWrapper, wrappers_of

    plans = {w.name: LayerPlan(w.quantize_inputs and not w.kept_float, w.input_indices,
                               w.quantize_weight and not w.kept_float, frozenset(w.unsigned_indices),
                               dict(w.range_ties)) for w in wrappers_of(model)}  # fmt: skip
    return build_view(model, plans, None, inner=lambda layer: layer.layer if isinstance(layer, QuantizeWrapper)
                      else layer)  # fmt: skip


def equalize(model: Any, batches: Sequence[Any]) -> list[Scaling]:
    """Equalize every pair of ``model`` (from :func:`qdq.keras.quantize_model`) whose scaling predicts a gain,
    measured on ``batches`` (model inputs) with every wrapper bypassed; the variables are rewritten in place.
    Each :class:`~qdq.workflow.equalization.Scaling` holds the variables as they were (:func:`restore`), the
    activation's histogram and the name of the range that reads it (``"<wrapper>/input_0"``)."""
    from qdq.keras.post_training import bypassed

    view = quantized_view(model)
    pairs = [(pair, layers) for pair in equalization_pairs(view) if (layers := _layers(pair)) is not None]
    if not pairs or not batches:
        return []
    stats = [stats_of(view, pair, _channel_axis(layers[2].layer)) for pair, layers in pairs]
    probe = keras().Model(model.inputs, [model.get_layer(pair.value).output for pair, _ in pairs])
    with bypassed(model):
        for batch in batches:
            values = probe.predict_on_batch(batch)
            for into, value in zip(stats, values if isinstance(values, list | tuple) else [values], strict=True):
                into.update(np.asarray(value, np.float32))
    scalings = []
    for (pair, (first, norm, second)), measured in zip(pairs, stats, strict=True):
        weight, groups = _torch_kernel(second.layer)
        scaling = plan_scaling(pair, measured, weight, groups, levels_of(view, pair))
        if scaling is not None:
            changed = _changed(first, norm, second)
            scaling.originals = {v.path: np.array(v.numpy()) for v in changed}
            scaling.histogram = measured.histogram
            scaling.handles = {"quantizer": f"{second.name}/input_0", "variables": {v.path: v for v in changed}}
            _write(first, norm, second, scaling.scales)
            scalings.append(scaling)
    return scalings


def restore(scalings: Sequence[Scaling]) -> dict[str, np.ndarray]:
    """Write back the variables ``scalings`` changed as they were (a kernel two pairs changed: its earliest);
    returns the values they held (:func:`assign` writes them again)."""
    return assign(scalings, {path: value for s in reversed(scalings) for path, value in s.originals.items()})


def assign(scalings: Sequence[Scaling], values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write ``values`` (by variable path) into the variables ``scalings`` changed; returns what they held."""
    variables = {path: variable for s in scalings for path, variable in s.handles["variables"].items()}
    held = {path: np.array(variables[path].numpy()) for path in values}
    for path, value in values.items():
        variables[path].assign(value)
    return held


def _layers(pair: Pair) -> tuple[Any, Any | None, Any] | None:
    """The pair's wrappers (``first``, ``second``) and BatchNormalization, or None where the module doc leaves it."""
    from qdq.keras.wrappers import QuantizeWrapper

    first, second = pair.first.ref, pair.second.ref
    norm = pair.norm.ref if pair.norm is not None else None
    if not all(isinstance(w, QuantizeWrapper) and type(w.layer).__name__ in _CONVS for w in (first, second)):
        return None
    if norm is not None and (getattr(norm, "gamma", None) is None or getattr(norm, "beta", None) is None):
        return None
    if any(len(getattr(layer, "_inbound_nodes", [])) != 1 for layer in (first, second, norm) if layer is not None):
        return None
    return first, norm, second


def _channel_axis(layer: Any) -> int:
    return 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1


def _depthwise(layer: Any) -> bool:
    return type(layer).__name__.startswith("Depthwise")


def _torch_kernel(layer: Any) -> tuple[np.ndarray, int]:
    """``layer``'s kernel as ``[out, in / groups, *kernel]`` and its groups."""
    kernel = np.asarray(layer.kernel.numpy(), np.float32)
    if _depthwise(layer):
        channels = kernel.shape[-2]
        return np.moveaxis(kernel.reshape(*kernel.shape[:-2], -1), -1, 0)[:, None], channels
    return np.moveaxis(kernel, (-1, -2), (0, 1)), int(getattr(layer, "groups", 1))


def _keras_kernel(layer: Any, weight: np.ndarray) -> np.ndarray:
    """A ``[out, in / groups, *kernel]`` weight in ``layer``'s kernel layout."""
    shape = tuple(layer.kernel.shape)
    if _depthwise(layer):
        return np.moveaxis(weight[:, 0], 0, -1).reshape(shape)
    return np.moveaxis(weight, (0, 1), (-1, -2))


def _changed(first: Any, norm: Any | None, second: Any) -> list[Any]:
    """The variables a scaling rewrites."""
    owner = [norm.gamma, norm.beta] if norm is not None else [first.layer.kernel, first.layer.bias]
    return [v for v in (*owner, second.layer.kernel) if v is not None]


def _write(first: Any, norm: Any | None, second: Any, scales: np.ndarray) -> None:
    if norm is not None:
        gamma, beta = scaled_first(norm.gamma.numpy(), norm.beta.numpy(), scales)
        norm.gamma.assign(gamma)
        norm.beta.assign(beta)
    else:
        layer = first.layer
        bias = layer.bias.numpy() if layer.bias is not None else None
        rows, shifted = scaled_first(_torch_kernel(layer)[0], bias, scales)
        layer.kernel.assign(_keras_kernel(layer, rows))
        if shifted is not None:
            layer.bias.assign(shifted)
    weight, groups = _torch_kernel(second.layer)
    second.layer.kernel.assign(_keras_kernel(second.layer, scaled_second(weight, groups, scales)))
