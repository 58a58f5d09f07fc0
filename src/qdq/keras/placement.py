"""Where a Keras model gets Q/DQ for a target: the target's placement rules on the Keras layer graph.

:func:`qdq.keras.quantize_model` first plans, per layer, which inputs and whether the kernel are quantized
(from the mode, the spec and the cases: the NVIDIA TF2 toolkit's rules). Then :func:`apply_rules` runs the
Keras form of each of the target's placement rules (:class:`qdq.targets.PlacementRule`) on those plans
(:class:`qdq.graphs.keras.KerasPlacement`), by stage (``keras_stage``), in the target's order within a stage.
A rule without a Keras form (``silu``, ``sigmoid_output``, ``float_recurrent``, the rules users register for
PyTorch) is skipped: a Keras swish, for example, runs in float between the conv's Q/DQ and the next one.

What each rule decides is documented with the rule, in the target packages (:mod:`qdq.targets.common`,
:mod:`qdq.targets.onnxruntime.rules`). Before the rules, :func:`split_activations` writes a conv's own
activation the target cannot fold into its int8 conv (swish, sigmoid...) as a separate ``Activation`` layer
after it, when a rule asks for it (``separates_activations``: ``conv_output``).
"""

from __future__ import annotations

from typing import Any

from qdq.errors import QdqConfigError
from qdq.graphs.keras import KerasPlacement, LayerPlan

__all__ = ["LayerPlan", "apply_rules", "placed_target", "split_activations"]

Plans = dict[str, LayerPlan]
_CONVS = ("Conv2D", "DepthwiseConv2D")
_ONNX_ACTIVATIONS = {"relu": "Relu", "relu6": "Clip"}
#: ONNX ops a conv's activation exports to that int8 conv kernels fold (ReLU, ReLU6)
FOLDED_ACTIVATIONS = frozenset({"Relu", "Clip"})


def apply_rules(model: Any, plans: Plans, target: Any) -> Plans:
    """The plans of ``model`` with ``target``'s (a :class:`qdq.targets.Target`) Keras rules applied (a new dict)."""
    ctx = KerasPlacement(model, dict(plans), target)
    rules = sorted(target.rules_for("keras"), key=lambda rule: rule.keras_stage)  # stable: the target's order
    for rule in rules:
        rule.keras(ctx)
    return ctx.plans


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


def _needs_split(layer: Any, folded: frozenset[str]) -> bool:
    activation = KerasPlacement.activation(layer)
    return type(layer).__name__ in _CONVS and activation != "linear" and _ONNX_ACTIVATIONS.get(activation) not in folded


def split_activations(model: Any, folded: frozenset[str] = FOLDED_ACTIVATIONS) -> Any:
    """``model`` with each Conv2D / DepthwiseConv2D activation an int8 conv cannot fold (one whose ONNX op is not
    in ``folded``: swish, sigmoid, ...) moved to an ``Activation`` layer right after it (named
    ``<conv>_activation``): the same function, weights copied; ``model`` itself when there is none to move."""
    from qdq.keras._backend import keras

    k = keras()
    split = {layer.name: KerasPlacement.activation(layer) for layer in model.layers if _needs_split(layer, folded)}
    if not split:
        return model
    if type(model).__name__ == "Sequential":  # call_function needs a Functional model
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
