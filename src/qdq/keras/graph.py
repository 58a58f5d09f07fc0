"""Checking and searching a Functional/Sequential Keras 3 model (the layer graph walk, ``producers`` and
``consumers``, is :mod:`qdq.graphs.keras`)."""

from __future__ import annotations

from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.graphs.keras import consumers, producers
from qdq.keras._backend import keras

__all__ = ["check_graph_model", "consumers", "find_layer", "producers"]

_GRAPH_MODELS = ("Functional", "Sequential")


def check_graph_model(model: Any, who: str = "qdq.keras") -> None:
    """Raise unless ``model`` is a built Functional or Sequential Keras 3 model."""
    k = keras()
    if not isinstance(model, k.Model):
        raise QdqTypeError(f"{who} needs a Keras 3 model (keras.Model), got {type(model).__name__}.")
    kind = type(model).__name__
    if kind not in _GRAPH_MODELS:
        raise QdqConfigError(
            f"{who} needs a Functional or Sequential Keras model; {kind!r} is a subclassed model, whose layer "
            "graph Keras cannot see or clone. Rebuild it with the Functional API (keras.Input -> layers -> "
            "keras.Model(inputs, outputs)), or quantize its Functional parts."
        )
    if not model.built or not getattr(model, "inputs", None):
        raise QdqConfigError(
            f"{who}: the {kind} model {model.name!r} has no inputs yet; give its first layer an input shape "
            "(keras.Input(shape=...)) or call model.build(input_shape) first."
        )


def find_layer(model: Any, name: str) -> Any:
    """The layer named ``name``; a clear error (with a suggestion) when there is none."""
    from qdq.errors import did_you_mean

    for layer in model.layers:
        if layer.name == name:
            return layer
    hint = did_you_mean(name, [layer.name for layer in model.layers])
    raise QdqConfigError(f"model {model.name!r} has no layer named {name!r}.{hint}")
