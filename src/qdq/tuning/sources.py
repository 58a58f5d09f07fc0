"""What :func:`qdq.tune` searches on: the FP32 ONNX file (given, or a float PyTorch or Keras model exported for the
target, :func:`qdq.export.export_float_onnx` / :func:`qdq.keras.export_float_onnx`), the batches as its feeds, the
tuning and held-out splits, and what computes each tensor of the file (:func:`made_by`)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.export.onnx_export import export_float_onnx
from qdq.onnx_in.data import graph_inputs
from qdq.targets import Target
from qdq.tuning.budget import Batch
from qdq.utils.batches import split_labels
from qdq.workflow.verification import onnx_feed

__all__ = ["Source", "made_by", "onnx_source", "splits"]

Source = tuple[Path, Iterable[Batch], list[Batch], list[Batch] | None]
"""The FP32 file, and the calibration, evaluation and held-out batches as its feeds."""

#: the metadata key under which torch's dynamo exporter records a node's module path
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def onnx_source(model: str | Path | nn.Module, calibration: Iterable[Any], evaluation: Sequence[Any],
                holdout: Sequence[Any] | None, folder: Path, target: Target) -> Source:  # fmt: skip
    """The FP32 ONNX file the search runs on, and the batches as its feeds: ``model`` as it is when it is a path;
    a PyTorch or Keras model exported for ``target`` (into ``folder``) with its batches converted.

    Raises:
        QdqConfigError: a model of another kind; no calibration batch.
    """
    if isinstance(model, str | Path):
        return Path(model), calibration, list(evaluation), None if holdout is None else list(holdout)
    batches = list(calibration)
    if _is_keras(model):
        from qdq.keras.export import export_float_onnx as keras_export

        def export(out: Path) -> Path:
            return keras_export(model, out, target)

        convert: Callable[[Any, list[str]], Batch] = _keras_feed
    elif isinstance(model, nn.Module):

        def export(out: Path) -> Path:
            return export_float_onnx(model, batches[0], out, target)

        def convert(batch: Any, names: list[str]) -> Batch:
            return _torch_feed(batch, model, names)
    else:
        raise QdqConfigError(f"tune takes an FP32 ONNX file, a float torch.nn.Module or a float Keras model, not "
                             f"{type(model).__name__}.")  # fmt: skip
    if not batches:
        raise QdqConfigError("tune needs calibration data: pass at least one batch.")
    source = export(folder / "fp32.onnx")
    names = [value.name for value in graph_inputs(source)]

    def feeds(data: Iterable[Any]) -> list[Batch]:
        return [convert(batch, names) for batch in data]

    return source, feeds(batches), feeds(evaluation), None if holdout is None else feeds(holdout)


def splits(eval_data: Sequence[Batch], holdout: Sequence[Batch] | None) -> tuple[list[Batch], list[Batch]]:
    """The tuning and the held-out batches: ``eval_data`` and ``holdout``, or every other batch of ``eval_data``.

    Raises:
        QdqConfigError: too few batches for both.
    """
    data = list(eval_data)
    if holdout is not None:
        if not data or not list(holdout):
            raise QdqConfigError("tune needs evaluation and held-out batches: pass at least one of each.")
        return data, list(holdout)
    if len(data) < 2:
        raise QdqConfigError("tune holds out every other batch of eval_data: pass at least two batches, or "
                             "holdout_data=.")  # fmt: skip
    return data[0::2], data[1::2]


def made_by(path: Path) -> dict[str, str]:
    """Tensor name -> what computes it in the file at ``path`` as written (before qdq prepares it): its node's op
    type, with the module it belongs to where the exporter recorded its name scopes (torch's dynamo exporter), e.g.
    ``"Softmax in blocks.2.attn"``; ``"graph input"`` for an input."""
    model = onnx.load(str(path), load_external_data=False)
    found = {value.name: "graph input" for value in model.graph.input}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == _NAME_SCOPES), None)
        module = ""
        if scopes:
            try:
                scope_path = ast.literal_eval(scopes)
            except (ValueError, SyntaxError):
                scope_path = []
            module = str(scope_path[-2]) if isinstance(scope_path, list) and len(scope_path) >= 2 else ""
        for output in node.output:
            found[output] = f"{node.op_type} in {module}" if module else node.op_type
    return found


def _is_keras(model: Any) -> bool:
    """Whether ``model`` is a Keras model (keras is imported already where a user holds one)."""
    model_class = getattr(sys.modules.get("keras"), "Model", None)
    return isinstance(model_class, type) and isinstance(model, model_class)


def _keras_feed(batch: Any, names: list[str]) -> dict[str, Any]:
    """A Keras batch as the graph's feed: inputs (an array, or a list of arrays in the model's input order) or an
    ``(inputs, labels)`` pair, its labels under ``"labels"``."""
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
    feed: dict[str, Any] = {name: np.asarray(array, np.float32) for name, array in zip(names, arrays)}
    if labels is not None:
        feed["labels"] = np.asarray(labels)
    return feed


def _torch_feed(batch: Any, model: nn.Module, names: list[str]) -> dict[str, Any]:
    """``batch`` (qdq's batch convention) as the graph's feed (``names``: its inputs), its labels (if any) under
    ``"labels"``."""
    inputs, labels = split_labels(batch, model)
    feed: dict[str, Any] = onnx_feed(inputs, names)
    if labels is not None:
        feed["labels"] = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else labels
    return feed
