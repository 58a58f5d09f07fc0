"""Where a Keras model gets Q/DQ for a target: the target's rules on the model's graph view, as layer plans.

:func:`qdq.keras.quantize_model` first plans, per layer, which inputs and whether the kernel are quantized (the
mode, the spec and the cases: the NVIDIA TF2 toolkit's placement). With a target, :func:`place` builds the
graph view of the model with those plans as its existing quantizers (:func:`qdq.graphs.keras.build_view`), runs
the target's placement rules on it, the same rules the PyTorch and ONNX front ends run (:mod:`qdq.targets`), and
turns the decisions back into plans (:func:`plans_of`):

* a quantized input of a layer: that position of the layer's wrapper;
* a quantized value (every reader): the position of every layer reading it, one range;
* quantizers given one range: their positions are *tied* (:attr:`~qdq.graphs.keras.LayerPlan.ties`): calibrated
  together, one range;
* an op kept float: no wrapper.

Keras can quantize only what a layer reads. Where a decision needs a tensor inside a layer, the layer is split
first and the rules run again on the new model: a conv's own activation becomes an ``Activation`` layer after it
(``<conv>_activation``) when a quantizer goes between the two; a swish becomes ``x * sigmoid(x)`` (a sigmoid
``Activation`` and a ``Multiply``) when its sigmoid is quantized. Both are the same function, weights copied.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from qdq.errors import QdqConfigError
from qdq.graphs.keras import LayerPlan, activation_name, activation_type, build_view
from qdq.graphs.view import GraphView, Op
from qdq.targets.rules import apply_rules

__all__ = ["LayerPlan", "place", "plans_of", "split_activations", "split_layers"]

Plans = dict[str, LayerPlan]
_MAX_ROUNDS = 4


def place(model: Any, plans: Plans, target: Any) -> tuple[Any, Plans]:
    """``target``'s rules on ``model`` (a :class:`qdq.targets.Target`), from the toolkit's ``plans``: the model to
    wrap (``model`` itself, or a copy with layers split) and its plans."""
    for _ in range(_MAX_ROUNDS):
        view = build_view(model, plans, target)
        apply_rules(view, target.placement_rules)
        placed, activations, swishes = plans_of(view)
        if not activations and not swishes:
            return model, placed
        model = split_layers(model, activations, swishes)
    raise QdqConfigError(f"placing model {model.name!r} kept splitting layers; report this model to qdq.")


def plans_of(view: GraphView) -> tuple[Plans, set[str], set[str]]:
    """The layer plans of ``view``'s quantizers, and the layers to split first: weighted layers whose own activation
    must become a layer, ``swish`` activation layers whose sigmoid must become a layer (empty when none)."""
    positions: dict[str, dict[int, tuple[bool, str | None]]] = {}
    kernels: set[str] = set()
    activations: set[str] = set()
    swishes: set[str] = set()
    for number, quantizer in enumerate(view.quantizers()):
        reads: list[tuple[str, int, str]] = []
        for site in quantizer.sites:
            if site.value.constant and site.reader is not None:
                kernels.add(site.reader.ref.name)
                continue
            if site.reader is None and not site.value.boundary:
                _needs_split(site.value.producer, activations, swishes)
                continue
            for reader, index in [(site.reader, site.index)] if site.reader is not None else site.value.readers:
                if isinstance(reader.ref, tuple):
                    activations.add(reader.ref[0].name)
                else:
                    reads.append((reader.ref.name, index, site.value.name))
        tie = f"range_{number}" if len({value for _, _, value in reads}) > 1 else None
        for layer, index, _ in reads:
            positions.setdefault(layer, {})[index] = (quantizer.unsigned, tie)
    return _plans(view, positions, kernels), activations, swishes


def _needs_split(op: Op | None, activations: set[str], swishes: set[str]) -> None:
    """Record the split that makes a value inside ``op``'s layer a layer's input."""
    if op is None:
        return
    if isinstance(op.ref, tuple):
        activations.add(op.ref[0].name)  # a conv's own activation first
    elif op.type == "Silu" or op.inner:
        swishes.add(op.ref.name)
    else:  # the conv itself, before its own activation
        activations.add(op.ref.name)


def _plans(view: GraphView, positions: dict[str, dict[int, tuple[bool, str | None]]], kernels: set[str]) -> Plans:
    plans: Plans = {}
    floats = {name for name in view.float_ops}
    for name in sorted(set(positions) | kernels):
        if name in floats:
            continue
        chosen = positions.get(name, {})
        indices = tuple(sorted(chosen))
        plans[name] = LayerPlan(
            quantize_inputs=bool(indices),
            input_indices=indices or None,
            quantize_weight=name in kernels,
            unsigned=frozenset(i for i, (unsigned, _) in chosen.items() if unsigned),
            ties={i: tie for i, (_, tie) in chosen.items() if tie is not None},
        )
    return plans


def split_activations(model: Any, folded: frozenset[str] | None = None) -> Any:
    """``model`` with each conv's own activation an int8 conv cannot fold (one whose ONNX op is not in ``folded``,
    default ONNX Runtime's :attr:`~qdq.targets.FusionFacts.folded_activations`: swish, sigmoid, ...) moved to an
    ``Activation`` layer right after it (:func:`split_layers`)."""
    if folded is None:
        from qdq.targets.onnxruntime.fusion import ONNXRUNTIME_FUSION

        folded = ONNXRUNTIME_FUSION.folded_activations
    convs = ("Conv2D", "DepthwiseConv2D")
    names = {
        layer.name
        for layer in model.layers
        if type(layer).__name__ in convs and activation_type(activation_name(layer)) not in {"Identity", *folded}
    }
    return split_layers(model, names)


def split_layers(model: Any, activations: Set[str] = frozenset(), swishes: Set[str] = frozenset()) -> Any:
    """``model`` with the own activation of each layer in ``activations`` moved to an ``Activation`` layer right
    after it (``<layer>_activation``), and each swish ``Activation`` layer in ``swishes`` written as
    ``Multiply([x, Activation("sigmoid")(x)])`` (``<layer>_sigmoid``, ``<layer>``): the same function, weights
    copied; ``model`` itself when there is nothing to split."""
    from qdq.keras._backend import keras

    k = keras()
    if not activations and not swishes:
        return model
    if type(model).__name__ == "Sequential":  # call_function needs a Functional model
        model = k.Model(model.inputs, model.outputs, name=model.name)
    moved = {layer.name: activation_name(layer) for layer in model.layers if layer.name in activations}

    def clone(layer: Any) -> Any:
        config = layer.get_config()
        if layer.name in moved:
            config["activation"] = "linear"
        return type(layer).from_config(config)

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if layer.name in swishes:
            x = args[0]
            gate = k.layers.Activation("sigmoid", name=f"{layer.name}_sigmoid")(x)
            return k.layers.Multiply(name=f"{layer.name}_product")([x, gate])
        out = layer(*args, **kwargs)
        if layer.name in moved:
            out = k.layers.Activation(moved[layer.name], name=f"{layer.name}_activation")(out)
        return out

    copy = k.models.clone_model(model, clone_function=clone, call_function=call)
    for layer in model.layers:
        if layer.weights:
            copy.get_layer(layer.name).set_weights(layer.get_weights())
    return copy
