"""``quantize_model``: the Keras 3 entry point, NVIDIA TF2 toolkit compatible.

``qmodel = quantize_model(model, quantization_mode="full", quantization_spec=None, custom_qdq_cases=None)``
returns a new model whose quantized layers are :class:`~qdq.keras.wrappers.QuantizeWrapper` s named
``quant_<layer>``; ``model`` itself is left untouched (its weights are copied).

Which layers get Q/DQ:

* ``"full"``: every layer that has a wrapper (Conv2D, DepthwiseConv2D, Dense, AveragePooling2D,
  GlobalAveragePooling2D), plus MaxPooling2D / BatchNormalization / Add / Multiply / Concatenate where a
  spec entry or a case names them (by layer name, or by class with ``is_keras_class=True``).
* ``"partial"``: only the layers a spec entry or a case names.

A name entry with ``quantize_input=False, quantize_weight=False`` and no index leaves that layer float.
Cases (:class:`~qdq.keras.cases.CustomQDQInsertionCase`) see the original model and the user's spec and
return entries that are added after the user's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.graphs.keras import quantized_by_default
from qdq.keras.graph import check_graph_model, producers
from qdq.keras.placement import LayerPlan, place
from qdq.keras.spec import LayerConfig, QuantizationSpec
from qdq.targets import get_target
from qdq.validate import check_num_bits

__all__ = ["QUANTIZATION_MODES", "quantize_model"]

QUANTIZATION_MODES = ("full", "partial")


def quantize_model(
    model: Any,
    quantization_mode: str = "full",
    quantization_spec: QuantizationSpec | None = None,
    custom_qdq_cases: Sequence[Any] | None = None,
    *,
    num_bits: int = 8,
    weight_bits: int | None = None,
    target: str | None = None,
) -> Any:
    """A copy of ``model`` with Q/DQ wrappers on the layers the mode, spec and cases select.

    Args:
        model: a built Functional or Sequential Keras 3 model (TensorFlow backend).
        quantization_mode: ``"full"`` or ``"partial"`` (needs a spec or a case).
        quantization_spec: layers to add (``"full"``) or to quantize (``"partial"``), or to keep float.
        custom_qdq_cases: :class:`~qdq.keras.cases.CustomQDQInsertionCase` instances, e.g.
            ``[ResNetV1QDQCase()]`` for TensorRT's residual fusion.
        num_bits: width of the integer grids, 2..8 (8: int8; 4 simulates int4 and exports as int8 Q/DQ behind
            a clip to the 16 levels, as the PyTorch export does).
        weight_bits: width of the kernels' grid when it differs (W4A8: ``num_bits=8, weight_bits=4``).
        target: the runtime the model is quantized for (:mod:`qdq.targets`): its placement rules, the ones the
            PyTorch path runs, run on the model's graph view from the toolkit's plan (:mod:`qdq.keras.placement`).
            ``"tensorrt"``: Q/DQ on inputs and weights, and on the inputs of each residual add but the one
            TensorRT fuses (the same choice as the PyTorch path and as
            :class:`~qdq.keras.cases.ResidualConnectionQDQCase`); ``"onnxruntime"``: also the conv outputs, every
            input of adds, one range around pools, unsigned post-ReLU ranges (what ORT's int8 kernels need). The
            model
            remembers it; :func:`qdq.keras.export_onnx` exports for it. None (default): the toolkit's placement
            alone (the spec and the cases), exportable for any target.

    Returns:
        The quantized model. Calibrate it (:func:`qdq.keras.calibrate`) before training or export.

    Raises:
        QdqConfigError: a subclassed model; an unknown mode; a spec name that matches no layer; a class
            or layer qdq has no quantized wrapper for; an input index a layer does not have.
    """
    from qdq.keras.wrappers import wrapper_for

    check_graph_model(model, "quantize_model")
    for bits in (num_bits, num_bits if weight_bits is None else weight_bits):
        if check_num_bits(bits) > 8:
            raise QdqConfigError(f"qdq.keras quantizes to at most 8 bits (int8 / uint8 Q/DQ in ONNX), got {bits}.")
    chosen_target = get_target(target) if target is not None else None  # an unknown name raises, listing them
    if quantization_mode not in QUANTIZATION_MODES:
        raise QdqConfigError(
            f"quantization_mode must be one of {QUANTIZATION_MODES}, got {quantization_mode!r}."
            f"{did_you_mean(str(quantization_mode), QUANTIZATION_MODES)}"
        )
    spec = _combined_spec(model, quantization_spec, custom_qdq_cases)
    if quantization_mode == "partial" and not len(spec):
        raise QdqConfigError("quantization_mode='partial' quantizes only the layers a spec or case names; give one.")
    _validate(model, spec, wrapper_for)
    plans = _plans(model, spec, quantization_mode, wrapper_for)
    if chosen_target is not None:
        model, plans = place(model, plans, chosen_target)
    return _wrapped_copy(model, plans, (num_bits, num_bits if weight_bits is None else weight_bits), target)


def _combined_spec(model: Any, user: QuantizationSpec | None, cases: Sequence[Any] | None) -> QuantizationSpec:
    """The user's entries, then each case's (the user's spec object is not modified)."""
    from qdq.keras.cases import CustomQDQInsertionCase

    if user is not None and not isinstance(user, QuantizationSpec):
        raise QdqTypeError(f"quantization_spec must be a QuantizationSpec, got {type(user).__name__}.")
    spec = user.copy() if user is not None else QuantizationSpec()
    view = user.copy() if user is not None else QuantizationSpec()
    for case in cases or ():
        if not isinstance(case, CustomQDQInsertionCase):
            raise QdqTypeError(f"custom_qdq_cases takes CustomQDQInsertionCase instances, got {type(case).__name__}.")
        found = case.case(model, view)
        if found is None:
            continue
        if not isinstance(found, QuantizationSpec):
            raise QdqTypeError(
                f"{type(case).__name__}.case must return a QuantizationSpec, got {type(found).__name__}."
            )
        spec.extend(found)
    return spec


def _validate(model: Any, spec: QuantizationSpec, wrapper_for: Any) -> None:
    from qdq.keras.wrappers import WRAPPERS

    names = {layer.name: layer for layer in model.layers}
    for entry in spec:
        if entry.is_keras_class:
            if entry.name not in WRAPPERS:
                raise QdqConfigError(
                    f"QuantizationSpec names the Keras class {entry.name!r}, which qdq has no quantized wrapper for. "
                    f"Supported: {sorted(WRAPPERS)}; add one with qdq.keras.register_wrapper."
                    f"{did_you_mean(entry.name, list(WRAPPERS))}"
                )
            continue
        layer = names.get(entry.name)
        if layer is None:
            raise QdqConfigError(
                f"QuantizationSpec names layer {entry.name!r}, but model {model.name!r} has no layer of that name."
                f"{did_you_mean(entry.name, list(names))}"
            )
        if _is_float_entry(entry):
            continue
        if wrapper_for(layer) is None:
            raise QdqConfigError(
                f"QuantizationSpec names layer {entry.name!r} of class {type(layer).__name__}, which qdq has no "
                f"quantized wrapper for. Supported classes: {sorted(WRAPPERS)}."
            )
        if entry.quantization_index is not None:
            n_inputs = max(1, len(producers(layer)))
            bad = [i for i in entry.quantization_index if i >= n_inputs]
            if bad:
                raise QdqConfigError(
                    f"QuantizationSpec: layer {entry.name!r} has {n_inputs} input(s); quantization_index {bad} "
                    "is out of range."
                )


def _is_float_entry(entry: LayerConfig) -> bool:
    return not entry.quantize_input and not entry.quantize_weight and entry.quantization_index is None


def _plans(model: Any, spec: QuantizationSpec, mode: str, wrapper_for: Any) -> dict[str, LayerPlan]:
    named, classes = spec.by_name(), spec.classes()
    plans: dict[str, LayerPlan] = {}
    for layer in model.layers:
        wrapper = wrapper_for(layer)
        if wrapper is None:
            continue
        entry = named.get(layer.name)
        class_name = type(layer).__name__
        if entry is not None:
            if _is_float_entry(entry):
                continue
            indices = None if entry.quantization_index is None else tuple(entry.quantization_index)
            plans[layer.name] = LayerPlan(
                entry.quantize_input or entry.quantization_index is not None, indices, entry.quantize_weight
            )
        elif class_name in classes or (mode == "full" and quantized_by_default(layer)):
            plans[layer.name] = LayerPlan(True, None, True)
        plan = plans.get(layer.name)
        if plan is not None and getattr(wrapper, "shared_input_range", False):  # one range for its inputs
            n_inputs = max(1, len(producers(layer)))
            plans[layer.name] = replace(plan, ties={i: layer.name for i in plan.positions(n_inputs)})
    return plans


def _wrapped_copy(model: Any, plans: dict[str, LayerPlan], bits: tuple[int, int], target: str | None) -> Any:
    """Clone ``model`` with new layers (wrapped where planned), then copy every layer's weights."""
    from qdq.keras._backend import keras
    from qdq.keras.wrappers import QuantizeWrapper, wrapper_for

    def clone(layer: Any) -> Any:
        fresh = type(layer).from_config(layer.get_config())
        plan = plans.get(layer.name)
        if plan is None:
            return fresh
        wrapper = wrapper_for(layer) or QuantizeWrapper  # the placement rules may quantize any layer's input
        return wrapper(
            fresh, plan.quantize_inputs, plan.input_indices, plan.quantize_weight, num_bits=bits[0],
            weight_bits=bits[1], unsigned_indices=sorted(plan.unsigned), target=target, range_ties=dict(plan.ties),
        )  # fmt: skip

    quantized = keras().models.clone_model(model, clone_function=clone)
    originals = {layer.name: layer for layer in model.layers}
    for layer in quantized.layers:
        inner = getattr(layer, "layer", layer) if layer.name not in originals else layer
        source = originals.get(inner.name)
        if source is not None and source.weights:
            inner.set_weights(source.get_weights())
    return quantized
