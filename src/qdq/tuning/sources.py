"""What :func:`qdq.tune` searches on: the FP32 ONNX file (given, or a float PyTorch or Keras model exported for the
target, :func:`qdq.export.export_float_onnx` / :func:`qdq.keras.export_float_onnx`), the batches as its feeds, the
tuning and held-out splits, and what computes each tensor of the file (:func:`made_by`)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
from torch import nn

from qdq.errors import QdqConfigError
from qdq.frontends import front_end_of
from qdq.onnx_in.data import graph_inputs
from qdq.targets import Target
from qdq.tuning.budget import Batch

__all__ = ["Source", "made_by", "onnx_source", "splits"]

Source = tuple[Path, Iterable[Batch], list[Batch], list[Batch] | None]
"""The FP32 file, and the calibration, evaluation and held-out batches as its feeds."""

#: the metadata key under which torch's dynamo exporter records a node's module path
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def onnx_source(model: str | Path | nn.Module, calibration: Iterable[Any], evaluation: Sequence[Any],
                holdout: Sequence[Any] | None, folder: Path, target: Target) -> Source:  # fmt: skip
    """The FP32 ONNX file the search runs on, and the batches as its feeds: ``model`` as it is when it is a path;
    a model of a registered front end (:mod:`qdq.frontends`: PyTorch, Keras) exported for ``target`` (into
    ``folder``) by it, with its batches converted by it.

    Raises:
        QdqConfigError: a model no front end takes; no calibration batch.
    """
    if isinstance(model, str | Path):
        return Path(model), calibration, list(evaluation), None if holdout is None else list(holdout)
    batches = list(calibration)
    front_end = front_end_of(model)
    if not batches:
        raise QdqConfigError("tune needs calibration data: pass at least one batch.")
    source = front_end.export_float_onnx(model, batches[0], folder / "fp32.onnx", target)
    names = [value.name for value in graph_inputs(source)]

    def feeds(data: Iterable[Any]) -> list[Batch]:
        return [front_end.feed(batch, model, names) for batch in data]

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
