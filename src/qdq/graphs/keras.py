"""What a Keras placement rule works on: a Functional/Sequential model's layer graph and a plan per layer.

:func:`qdq.keras.quantize_model` plans, per layer, which inputs and whether the kernel get Q/DQ
(:class:`LayerPlan`), then runs the target's placement rules (:class:`qdq.targets.PlacementRule`, their
``keras`` function) on a :class:`KerasPlacement`: the model, the plans, the target, and the questions rules
ask of the layer graph (producers, readers, the activation a layer applies, the weighted ops before a
tensor). A rule edits the plans only; the front end then wraps the layers.

This module reads Keras layers by their attributes and imports neither Keras nor TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["KerasPlacement", "LayerPlan", "consumers", "producers"]

_WEIGHTED = ("Conv2D", "DepthwiseConv2D", "Conv1D", "Conv3D", "SeparableConv2D", "Conv2DTranspose", "Dense")
_PASS_THROUGH = ("BatchNormalization", "Activation", "ReLU", "Dropout")
_NONNEG_ACTIVATIONS = frozenset({"relu", "relu6", "sigmoid", "softmax", "hard_sigmoid", "exponential"})
_ONNX_ACTIVATIONS = {"relu": "Relu", "relu6": "Clip"}  # what tf2onnx writes (ReLU6: Clip(0, 6))
_KEEP_SIGN = frozenset({"MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D", "GlobalMaxPooling2D",
                        "Flatten", "Reshape", "Dropout", "ZeroPadding2D", "Cropping2D", "UpSampling2D", "Permute",
                        "SpatialDropout2D", "Identity", "Add", "Multiply", "Concatenate"})  # fmt: skip


# --------------------------------------------------------------------------------------- the layer graph
def _first_node(layer: Any) -> Any | None:
    nodes = getattr(layer, "_inbound_nodes", [])
    return nodes[0] if nodes else None


def producers(layer: Any) -> list[Any]:
    """The layers whose outputs feed ``layer``, one per input position (first call of ``layer``)."""
    node = _first_node(layer)
    if node is None:
        return []
    return [tensor._keras_history.operation for tensor in node.input_tensors]


def consumers(model: Any, layer: Any) -> list[Any]:
    """The layers of ``model`` that take an output of ``layer`` (each once, in model order)."""
    members = {id(candidate) for candidate in model.layers}
    found: dict[int, Any] = {}
    for node in getattr(layer, "_outbound_nodes", []):
        operation = node.operation
        if id(operation) in members:
            found.setdefault(id(operation), operation)
    return list(found.values())


# ------------------------------------------------------------------------------------------- the plans
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


@dataclass
class KerasPlacement:
    """What a Keras placement rule works on.

    Attributes:
        model: the float Functional/Sequential model being quantized (not modified).
        plans: layer name -> :class:`LayerPlan` of the layers that get a wrapper; rules edit this dict.
        target: the :class:`qdq.targets.Target` the model is quantized for.
    """

    model: Any
    plans: dict[str, LayerPlan]
    target: Any
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    # --- reading the graph
    @property
    def layers(self) -> list[Any]:
        return list(self.model.layers)

    @staticmethod
    def class_name(layer: Any) -> str:
        return type(layer).__name__

    @staticmethod
    def producers(layer: Any) -> list[Any]:
        return producers(layer)

    def readers(self, layer: Any) -> list[tuple[Any, int, int]]:
        """``(consumer, input position, number of inputs)`` for every use of ``layer``'s output."""
        found = []
        for consumer in consumers(self.model, layer):
            parents = producers(consumer)
            found += [(consumer, i, len(parents)) for i, parent in enumerate(parents) if parent is layer]
        return found

    def single_use(self, layer: Any) -> Any | None:
        """The one layer reading ``layer`` (None: several, none, or ``layer`` is called more than once)."""
        found = consumers(self.model, layer)
        return found[0] if len(found) == 1 and len(getattr(layer, "_inbound_nodes", [])) == 1 else None

    @staticmethod
    def activation(layer: Any) -> str:
        """The name of the activation a layer applies (its own ``activation``; ReLU layers by their settings)."""
        kind = type(layer).__name__
        if kind == "ReLU":
            plain = not getattr(layer, "negative_slope", 0) and not getattr(layer, "threshold", 0)
            max_value = getattr(layer, "max_value", None)
            if plain and max_value is None:
                return "relu"
            return "relu6" if plain and max_value is not None and float(max_value) == 6.0 else "other"
        if kind == "Softmax":
            return "softmax"
        function = getattr(layer, "activation", None)
        return getattr(function, "__name__", "linear") if function is not None else "linear"

    def onnx_activation(self, layer: Any) -> str | None:
        """The ONNX op a layer's ReLU / ReLU6 exports to (``"Relu"``, ``"Clip"``), else None."""
        return _ONNX_ACTIVATIONS.get(self.activation(layer))

    @staticmethod
    def is_weighted(layer: Any) -> bool:
        """Conv (any dimension, depthwise, separable, transposed) or Dense."""
        return type(layer).__name__ in _WEIGHTED

    def follows_weighted(self, layer: Any) -> bool:
        """``layer``'s output is a weighted layer's, possibly through BatchNormalization / activation /
        dropout layers, and each layer on the way (the weighted one included) has no other reader."""
        for _ in range(6):
            if len(consumers(self.model, layer)) != 1:
                return False
            if self.is_weighted(layer):
                return True
            parents = producers(layer)
            if type(layer).__name__ not in _PASS_THROUGH or len(parents) != 1:
                return False
            layer = parents[0]
        return False

    def weighted_depth(self, layer: Any) -> int:
        """How many weighted layers the longest path from the model's input to ``layer`` (included) goes
        through (see :meth:`qdq.graphs.fx.PlacementContext.weighted_depth`)."""
        depths = self._memo.setdefault("depth", {})
        if layer.name not in depths:
            stack = [layer]
            while stack:  # iterative: a deep network would overflow Python's recursion
                top = stack[-1]
                pending = [p for p in producers(top) if p.name not in depths]
                if pending:
                    stack += pending
                    continue
                stack.pop()
                before = max((depths[p.name] for p in producers(top)), default=0)
                depths[top.name] = before + int(self.is_weighted(top))
        return depths[layer.name]

    def non_negative(self, layer: Any) -> bool:
        """Is ``layer``'s output >= 0 whatever the model's input (by the ops alone)?"""
        memo: dict[str, bool] = self._memo.setdefault("nonneg", {})
        if layer.name not in memo:
            memo[layer.name] = False  # a cycle guard; graphs are acyclic
            if self.activation(layer) in _NONNEG_ACTIVATIONS:
                memo[layer.name] = True
            elif type(layer).__name__ in _KEEP_SIGN:
                parents = producers(layer)
                memo[layer.name] = bool(parents) and all(self.non_negative(p) for p in parents)
        return memo[layer.name]

    # --- editing the plans
    def plan(self, layer: Any) -> LayerPlan | None:
        return self.plans.get(layer.name)

    def quantize_input(self, layer: Any, position: int, n_inputs: int) -> None:
        """Quantize input ``position`` of ``layer`` (a layer without a plan gets one that quantizes only it)."""
        plan = self.plans.get(layer.name) or LayerPlan(False, None, False)
        self.plans[layer.name] = plan.with_input(position, n_inputs)

    def quantize_all_inputs(self, layer: Any) -> None:
        plan = self.plans.get(layer.name) or LayerPlan(False, None, False)
        self.plans[layer.name] = replace(plan, quantize_inputs=True, input_indices=None)

    def set_unsigned(self, layer: Any, positions: frozenset[int]) -> None:
        self.plans[layer.name] = replace(self.plans[layer.name], unsigned=positions)
