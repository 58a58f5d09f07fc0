"""Front ends as registered objects: what a tool working on ONNX files (:func:`qdq.tune`) needs from a kind of model.

A :class:`FrontEnd` says which models it takes, exports a float one to the FP32 ONNX file of a target, and turns the
user's batches (with labels or not) into feeds of that file's inputs. ``"torch"`` (a ``torch.nn.Module``) and
``"keras"`` (a Keras model; TensorFlow imported only where the user holds one) are registered; a new kind of model is
one :func:`register_front_end`. An ONNX file needs none: it is the file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.registry import Registry
from qdq.targets import Target

__all__ = ["FRONT_ENDS", "FrontEnd", "front_end_of", "register_front_end"]

Feed = dict[str, Any]


@dataclass(frozen=True)
class FrontEnd:
    """One kind of model.

    Attributes:
        name: the registry key (``"torch"``, ``"keras"``).
        accepts: ``accepts(model)``: whether ``model`` is of this kind.
        export_float_onnx: ``export_float_onnx(model, example_batch, path, target) -> path``: the float model as the
            FP32 ONNX file of the quantized files made for ``target``.
        feed: ``feed(batch, model, input_names) -> {input name: array}``, the batch's labels (if any) under
            ``"labels"``.
    """

    name: str
    accepts: Callable[[Any], bool]
    export_float_onnx: Callable[[Any, Any, Path, Target], Path]
    feed: Callable[[Any, Any, list[str]], Feed]


FRONT_ENDS: Registry[str, FrontEnd] = Registry("front end")


def register_front_end(front_end: FrontEnd, *, override: bool = False) -> FrontEnd:
    """Register ``front_end`` under its name (``override=True`` replaces one of that name)."""
    return FRONT_ENDS.register(front_end.name, front_end, override=override)


def front_end_of(model: Any) -> FrontEnd:
    """The registered front end that takes ``model`` (the first, in registration order).

    Raises:
        QdqConfigError: none does.
    """
    for name in FRONT_ENDS:
        front_end = FRONT_ENDS.get(name)
        if front_end.accepts(model):
            return front_end
    raise QdqConfigError(f"no front end takes a {type(model).__name__}: pass an FP32 ONNX file, a float "
                         f"torch.nn.Module or a float Keras model (the registered front ends: {list(FRONT_ENDS)}).")


# --- PyTorch ----------------------------------------------------------------------------------------------------


def _torch_export(model: nn.Module, batch: Any, path: Path, target: Target) -> Path:
    from qdq.export.onnx_export import export_float_onnx

    return export_float_onnx(model, batch, path, target)


def _torch_feed(batch: Any, model: nn.Module, names: list[str]) -> Feed:
    """``batch`` (qdq's batch convention: inputs, or (inputs, labels)) as the graph's feed."""
    from qdq.utils.batches import split_labels
    from qdq.workflow.verification import onnx_feed

    inputs, labels = split_labels(batch, model)
    feed: Feed = onnx_feed(inputs, names)
    if labels is not None:
        feed["labels"] = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else labels
    return feed


# --- Keras ------------------------------------------------------------------------------------------------------


def _is_keras(model: Any) -> bool:
    """Whether ``model`` is a Keras model (keras is imported already where a user holds one)."""
    model_class = getattr(sys.modules.get("keras"), "Model", None)
    return isinstance(model_class, type) and isinstance(model, model_class)


def _keras_export(model: Any, batch: Any, path: Path, target: Target) -> Path:
    from qdq.keras.export import export_float_onnx

    return export_float_onnx(model, path, target)


def _keras_feed(batch: Any, model: Any, names: list[str]) -> Feed:
    """A Keras batch as the graph's feed: inputs (an array, or a list of arrays in the model's input order) or an
    ``(inputs, labels)`` pair."""
    labels = None
    pair = isinstance(batch, tuple | list) and len(batch) == 2
    if pair and (len(names) == 1 or isinstance(batch[0], tuple | list | dict)):
        batch, labels = batch
    if isinstance(batch, dict):
        arrays = [batch[name] for name in names if name in batch]
    else:
        arrays = list(batch) if isinstance(batch, tuple | list) else [batch]
    if len(arrays) != len(names):
        raise QdqConfigError(f"a batch gives {len(arrays)} input(s) but the Keras model's export has {names}: pass "
                             "an array, a list of arrays in the model's input order, or (inputs, labels).")  # fmt: skip
    feed: Feed = {name: np.asarray(array, np.float32) for name, array in zip(names, arrays)}
    if labels is not None:
        feed["labels"] = np.asarray(labels)
    return feed


register_front_end(FrontEnd("torch", lambda model: isinstance(model, nn.Module), _torch_export, _torch_feed))
register_front_end(FrontEnd("keras", _is_keras, _keras_export, _keras_feed))
