"""Where a Keras model gets Q/DQ for a target: the plan of each layer, and the target's placement rules.

:func:`qdq.keras.quantize_model` first plans, per layer, which inputs and whether the kernel are quantized
(from the mode, the spec and the cases: the NVIDIA TF2 toolkit's rules, which are TensorRT's). For
``target="tensorrt"`` that plan is final. Other targets name placement rules in their registration
(:mod:`qdq.targets`); this module implements them on the Keras layer graph, by the same names as the
PyTorch rules of :mod:`qdq.placement`:

* ``conv_output``: the output of each quantized Conv2D / DepthwiseConv2D, after its BatchNormalization and a
  ReLU / ReLU6 if any (ONNX Runtime folds them into ``QLinearConv``), is quantized: every layer reading it
  gets Q/DQ on that input (a layer without a registered wrapper, such as ZeroPadding2D or an ``Activation``
  of swish, gets a plain :class:`~qdq.keras.wrappers.QuantizeWrapper`). ``DQ -> Conv -> Q`` is what ORT
  runs as ``QLinearConv``; equal Q/DQ pairs of one tensor are merged at export;
* ``residual_add`` (with the target's ``residual_add="both"``), ``mul_inputs``, ``concat``: an Add, Multiply
  or Concatenate with one quantized input gets all of them quantized (``QLinearAdd``, ``QLinearMul``,
  ``QLinearConcat``); with ``"skip"`` the residual adds are left to the cases, as in the toolkit;
* ``unsigned_activations``: an input that is non-negative by construction (after ReLU, ReLU6, sigmoid or
  softmax, or pooling / padding / reshaping of such, or sums and products of such) is quantized unsigned:
  uint8 over ``[0, amax]``, step ``amax / 255``. ORT then drops the ReLU before it and fuses the Conv.

Before these rules, :func:`split_activations` writes a conv's own activation that ORT cannot fold (swish,
sigmoid, ...) as a separate ``Activation`` layer after it, so that ``conv_output`` can quantize between the
two. ``silu`` and ``sigmoid_output`` (ORT's int8 sigmoid for SiLU and squeeze-excitation gates) are
PyTorch-only: a Keras swish runs in float between the Conv's Q/DQ and the next one. A target naming a rule
that has no Keras implementation raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from qdq.errors import QdqConfigError
from qdq.keras.graph import consumers, producers

__all__ = ["KERAS_RULES", "LayerPlan", "apply_rules", "placed_target", "readers", "split_activations"]


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's wrapper quantizes.

    Attributes:
        quantize_inputs: whether inputs are quantized at all.
        input_indices: the positions quantized (None: every input).
        quantize_weight: the kernel (weighted layers).
        unsigned: positions quantized unsigned (uint8 over ``[0, amax]``).
    """

    quantize_inputs: bool
    input_indices: tuple[int, ...] | None
    quantize_weight: bool
    unsigned: frozenset[int] = frozenset()

    def positions(self, n_inputs: int) -> tuple[int, ...]:
        if not self.quantize_inputs:
            return ()
        return tuple(range(n_inputs)) if self.input_indices is None else self.input_indices

    def with_input(self, position: int, n_inputs: int) -> LayerPlan:
        """This plan with input ``position`` quantized too."""
        present = self.positions(n_inputs)
        if position in present:
            return self
        indices = tuple(sorted((*present, position)))
        return replace(self, quantize_inputs=True, input_indices=None if len(indices) == n_inputs else indices)


Plans = dict[str, LayerPlan]
_CONVS = ("Conv2D", "DepthwiseConv2D")
_MERGING = {"residual_add": ("Add",), "mul_inputs": ("Multiply",), "concat": ("Concatenate",)}
_NONNEG_ACTIVATIONS = frozenset({"relu", "relu6", "sigmoid", "softmax", "hard_sigmoid", "exponential"})
_FOLDED_ACTIVATIONS = frozenset({"relu", "relu6"})  # ORT: Relu and Clip(0, 6) folded into QLinearConv
_KEEP_SIGN = frozenset({"MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D", "GlobalMaxPooling2D",
                        "Flatten", "Reshape", "Dropout", "ZeroPadding2D", "Cropping2D", "UpSampling2D", "Permute",
                        "SpatialDropout2D", "Identity", "Add", "Multiply", "Concatenate"})  # fmt: skip
_TORCH_ONLY = frozenset({"silu", "sigmoid_output"})
# Keras applies the rules in this order, whatever the target lists: inputs the conv outputs add are then
# seen by the merging rules, and every quantized input by the unsigned one.
_ORDER = {"conv_output": 0, "residual_add": 1, "mul_inputs": 1, "concat": 1, "unsigned_activations": 2}


def readers(model: Any, layer: Any) -> list[tuple[Any, int, int]]:
    """``(consumer, input position, number of inputs)`` for every use of ``layer``'s output in ``model``."""
    found = []
    for consumer in consumers(model, layer):
        parents = producers(consumer)
        found += [(consumer, i, len(parents)) for i, parent in enumerate(parents) if parent is layer]
    return found


def _class(layer: Any) -> str:
    return type(layer).__name__


def _activation(layer: Any) -> str:
    """The name of the activation a layer applies (its own ``activation``; ReLU layers by their settings)."""
    if _class(layer) == "ReLU":
        plain = not getattr(layer, "negative_slope", 0) and not getattr(layer, "threshold", 0)
        max_value = getattr(layer, "max_value", None)
        if plain and max_value is None:
            return "relu"
        return "relu6" if plain and max_value is not None and float(max_value) == 6.0 else "other"
    if _class(layer) == "Softmax":
        return "softmax"
    function = getattr(layer, "activation", None)
    return getattr(function, "__name__", "linear") if function is not None else "linear"


def _single_use(model: Any, layer: Any) -> Any | None:
    """The one layer reading ``layer`` (None: several, none, or ``layer`` is called more than once)."""
    found = consumers(model, layer)
    return found[0] if len(found) == 1 and len(getattr(layer, "_inbound_nodes", [])) == 1 else None


def _conv_tail(model: Any, conv: Any) -> Any:
    """The layer whose output ORT's ``QLinearConv`` produces for ``conv``: after its BatchNormalization and a
    ReLU / ReLU6 (a layer or ``Activation``), each the only reader of the one before."""
    layer = conv
    if _activation(conv) not in _FOLDED_ACTIVATIONS:
        after = _single_use(model, layer)
        if after is not None and _class(after) == "BatchNormalization" and _activation(conv) == "linear":
            layer = after
        after = _single_use(model, layer)
        if after is not None and _class(after) in ("ReLU", "Activation") and _activation(after) in _FOLDED_ACTIVATIONS:
            layer = after
    return layer


def _planned(plans: Plans, layer: Any, position: int, n_inputs: int) -> None:
    plan = plans.get(layer.name) or LayerPlan(False, None, False)
    plans[layer.name] = plan.with_input(position, n_inputs)


def _conv_output(model: Any, plans: Plans) -> None:
    for layer in model.layers:
        plan = plans.get(layer.name)
        if _class(layer) not in _CONVS or plan is None or not (plan.quantize_weight and 0 in plan.positions(1)):
            continue
        for consumer, position, n_inputs in readers(model, _conv_tail(model, layer)):
            _planned(plans, consumer, position, n_inputs)


def _all_inputs_of(classes: tuple[str, ...]) -> Callable[[Any, Plans], None]:
    def rule(model: Any, plans: Plans) -> None:
        for layer in model.layers:
            plan = plans.get(layer.name)
            n_inputs = len(producers(layer))
            if _class(layer) in classes and plan is not None and plan.positions(n_inputs):
                plans[layer.name] = replace(plan, quantize_inputs=True, input_indices=None)

    return rule


def _non_negative(layer: Any, memo: dict[str, bool]) -> bool:
    """Is ``layer``'s output >= 0 whatever the model's input (by the ops alone)?"""
    if layer.name not in memo:
        memo[layer.name] = False  # a cycle guard; graphs are acyclic
        if _activation(layer) in _NONNEG_ACTIVATIONS:
            memo[layer.name] = True
        elif _class(layer) in _KEEP_SIGN:
            parents = producers(layer)
            memo[layer.name] = bool(parents) and all(_non_negative(p, memo) for p in parents)
    return memo[layer.name]


def _unsigned_activations(model: Any, plans: Plans) -> None:
    memo: dict[str, bool] = {}
    for layer in model.layers:
        plan = plans.get(layer.name)
        if plan is None:
            continue
        parents = producers(layer)
        unsigned = frozenset(i for i in plan.positions(len(parents)) if _non_negative(parents[i], memo))
        plans[layer.name] = replace(plan, unsigned=unsigned)


#: placement rule name (as the targets name them) -> its Keras implementation
KERAS_RULES: dict[str, Callable[[Any, Plans], None]] = {
    "conv_output": _conv_output,
    "mul_inputs": _all_inputs_of(_MERGING["mul_inputs"]),
    "concat": _all_inputs_of(_MERGING["concat"]),
    "unsigned_activations": _unsigned_activations,
}


def apply_rules(model: Any, plans: Plans, target: str) -> Plans:
    """The plans of ``model`` with ``target``'s placement rules applied (a new dict; ``"tensorrt"``: as is).

    Raises:
        QdqConfigError: the target names a rule with no Keras implementation.
    """
    from qdq.targets import get_target

    spec = get_target(target)
    plans = dict(plans)
    if spec.name == "tensorrt":
        return plans
    for name in sorted(spec.placement_rules, key=lambda rule: _ORDER.get(rule, 1)):
        if name in _TORCH_ONLY:
            continue
        if name == "residual_add":
            if spec.residual_add == "both":
                _all_inputs_of(_MERGING["residual_add"])(model, plans)
            continue
        rule = KERAS_RULES.get(name)
        if rule is None:
            raise QdqConfigError(
                f"target {target!r} places Q/DQ with the rule {name!r}, which qdq.keras does not implement "
                f"(Keras rules: {sorted(KERAS_RULES)} and residual_add)."
            )
        rule(model, plans)
    return plans


def placed_target(model: Any) -> str | None:
    """The target ``model``'s wrappers were placed for (``quantize_model(target=...)``; kept by ``.keras``
    files), or None for the toolkit's placement.

    Raises:
        QdqConfigError: wrappers placed for different targets.
    """
    from qdq.keras.wrappers import wrappers_of

    found = {w.target for w in wrappers_of(model) if w.target is not None}
    if len(found) > 1:
        raise QdqConfigError(f"the wrappers of model {model.name!r} were placed for targets {sorted(found)}.")
    return found.pop() if found else None


def _needs_split(layer: Any) -> bool:
    return _class(layer) in _CONVS and _activation(layer) not in _FOLDED_ACTIVATIONS | {"linear"}


def split_activations(model: Any) -> Any:
    """``model`` with each Conv2D / DepthwiseConv2D activation ORT cannot fold into ``QLinearConv`` (swish,
    sigmoid, ...) moved to an ``Activation`` layer right after it (named ``<conv>_activation``): the same
    function, weights copied; ``model`` itself when there is none to move."""
    from qdq.keras._backend import keras

    k = keras()
    split = {layer.name: _activation(layer) for layer in model.layers if _needs_split(layer)}
    if not split:
        return model
    if _class(model) == "Sequential":  # call_function needs a Functional model
        model = k.Model(model.inputs, model.outputs, name=model.name)

    def clone(layer: Any) -> Any:
        config = layer.get_config()
        if layer.name in split:
            config["activation"] = "linear"
        return type(layer).from_config(config)

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        out = layer(*args, **kwargs)
        if layer.name in split:
            out = k.layers.Activation(split[layer.name], name=f"{layer.name}_activation")(out)
        return out

    copy = k.models.clone_model(model, clone_function=clone, call_function=call)
    for layer in model.layers:
        if layer.weights:
            copy.get_layer(layer.name).set_weights(layer.get_weights())
    return copy
