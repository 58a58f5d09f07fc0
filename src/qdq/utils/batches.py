"""How qdq feeds a batch to a model: the one convention of calibration, PTQ, QAT, verification and export.

A **batch** is one of

* a tensor: the model's one input, ``model(x)``;
* a mapping (a ``dict``, a tokenizer's ``BatchEncoding``): keyword arguments, ``model(**batch)``, the
  Hugging Face convention; entries whose value is ``None`` are left out;
* a tuple or list: positional arguments, ``model(*batch)``.

**Labels.** Data loaders over labelled data yield ``(inputs, labels)`` pairs. A tuple is read as such a pair,
and everything after its first element is dropped as labels (never passed to the model), when

1. its first element is itself a tuple, list or mapping: ``((ids, mask), labels)``,
   ``({"input_ids": ids}, labels)``; the first element is then the batch, read by the three rules above;
2. or the model's ``forward`` takes fewer positional arguments than the tuple has: a one-input CNN given
   ``(images, labels)`` takes ``images``.

A tuple that would pass what looks like labels (a 1-D integer tensor with one entry per sample) to an
*optional* positional parameter of ``forward`` is ambiguous, ``forward(x, mask=None)`` given ``(x, y)``,
and raises :class:`~qdq.errors.QdqConfigError` rather than guess: write it ``((x,), y)`` (inputs with labels)
or as a dict. Anything else (a string, ``None``, an object) raises with the same hint. For other layouts
the workflow functions take ``forward_fn(model, batch)``.

**ONNX names.** :func:`onnx_input_names` names the graph inputs of an exported model: keyword arguments by
their keyword; positional ones ``input`` (one) or ``input_0``, ``input_1``... The same function tells
:func:`qdq.verify` which batch entry feeds which graph input.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.errors import QdqConfigError

__all__ = [
    "ModelInputs",
    "call_model",
    "flatten_outputs",
    "indexed_names",
    "model_inputs",
    "onnx_input_names",
    "output_names",
    "sample_count",
    "sample_slice",
    "split_labels",
]

_HINT = (
    "A batch is a tensor (one input), a tuple (positional arguments), a dict (keyword arguments), or an "
    "(inputs, labels) pair whose inputs are one of these; pass forward_fn=lambda model, batch: ... for "
    "another layout."
)


@dataclass
class ModelInputs:
    """The arguments one batch gives a model: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> ModelInputs:
        """The same arguments with every tensor moved to ``device``."""
        move = _mover(torch.device(device))
        return ModelInputs(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()})

    def __call__(self, model: nn.Module) -> Any:
        """Call ``model`` with these arguments."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(ONNX input name, tensor)`` of every tensor argument, in export order (see :func:`onnx_input_names`)."""
        return zip(onnx_input_names(self), self._tensor_values())

    def _tensor_values(self) -> list[torch.Tensor]:
        values = [a for a in self.args if isinstance(a, torch.Tensor)]
        return values + [v for v in self.kwargs.values() if isinstance(v, torch.Tensor)]

    @property
    def batch_size(self) -> int | None:
        """Dimension 0 of the first tensor argument (None without one)."""
        first = next(iter(self._tensor_values()), None)
        return int(first.shape[0]) if first is not None and first.dim() else None


def _mover(device: torch.device) -> Callable[[Any], Any]:
    def move(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) else value

    return move


def model_inputs(batch: Any, model: nn.Module | None = None) -> ModelInputs:
    """The arguments ``batch`` gives ``model`` (labels dropped), by the convention of the module doc.

    ``model`` is needed only to read a tuple: its ``forward`` signature tells positional arguments from
    labels. Without it, a tuple is all positional arguments unless its first element is a container.

    Raises:
        QdqConfigError: a batch of another kind, an empty one, or an ambiguous tuple (the message says how
            to write it).
    """
    inputs, _ = split_labels(batch, model)
    return inputs


def split_labels(batch: Any, model: nn.Module | None = None, *, labelled: bool = False) -> tuple[ModelInputs, Any]:
    """``(inputs, labels)`` of ``batch``: labels are what the convention drops (None when there are none).

    Labels are returned as the batch holds them: one object for a pair, a tuple for several. With
    ``labelled`` (training data: :func:`qdq.qat`) a tuple's **last** element is its labels, whatever the
    signature: ``(x, y)``, ``(ids, mask, labels)``; a dict batch holds its labels under the model's own key
    (a Hugging Face model then returns its loss).
    """
    if isinstance(batch, torch.Tensor):
        return ModelInputs((batch,)), None
    if isinstance(batch, Mapping):
        return _keywords(batch), None
    if not isinstance(batch, tuple | list):
        raise QdqConfigError(f"cannot feed a batch of type {type(batch).__name__} to the model. {_HINT}")
    if not batch:
        raise QdqConfigError(f"got an empty batch (an empty {type(batch).__name__}). {_HINT}")
    first, rest = batch[0], tuple(batch[1:])
    if isinstance(first, tuple | list | Mapping):
        inputs, _ = split_labels(first, model)
        return inputs, _one(rest)
    if labelled and len(batch) > 1:
        return _positional(batch[:-1]), batch[-1]
    capacity, required = _positional_capacity(model)
    if len(batch) > capacity:
        if capacity == 0:
            raise QdqConfigError(
                f"{type(model).__name__}.forward takes no positional argument; pass the batch as a dict."
            )
        return _positional(batch[: int(capacity)]), _one(tuple(batch[int(capacity) :]))
    _check_unambiguous(batch, required, model)
    return _positional(batch), None


def _one(labels: tuple[Any, ...]) -> Any:
    if not labels:
        return None
    return labels[0] if len(labels) == 1 else labels


def _keywords(batch: Mapping[Any, Any]) -> ModelInputs:
    bad = [k for k in batch if not isinstance(k, str)]
    if bad:
        raise QdqConfigError(f"a dict batch holds keyword arguments: its keys must be strings, got {bad[:3]}.")
    kwargs = {k: v for k, v in batch.items() if v is not None}
    if not kwargs:
        raise QdqConfigError(f"got a dict batch with no value (every entry is None). {_HINT}")
    return ModelInputs((), kwargs)


def _positional(values: tuple[Any, ...] | list[Any]) -> ModelInputs:
    for index, value in enumerate(values):
        if value is None or isinstance(value, str | bytes):
            raise QdqConfigError(f"positional argument {index} of the batch is {value!r}. {_HINT}")
    return ModelInputs(tuple(values))


def _forward_of(model: nn.Module) -> Any:
    """The ``forward`` that runs: through DistributedDataParallel / DataParallel and ``torch.compile``."""
    while True:
        wrapper = isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel)
        inner = getattr(model, "module" if wrapper else "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model.forward
        model = inner


def _positional_capacity(model: nn.Module | None) -> tuple[float, int]:
    """(how many positional arguments ``model.forward`` takes (inf with ``*args``), how many it requires)."""
    if model is None:
        return math.inf, 0
    try:
        parameters = inspect.signature(_forward_of(model)).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward without a signature
        return math.inf, 0
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    capacity = math.inf if any(p.kind is p.VAR_POSITIONAL for p in parameters) else len(positional)
    return capacity, sum(p.default is p.empty for p in positional)


def _looks_like_labels(value: Any, batch_size: int | None) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype is not torch.bool
        and (batch_size is None or value.shape[0] == batch_size)
    )


def _check_unambiguous(batch: tuple[Any, ...] | list[Any], required: int, model: nn.Module | None) -> None:
    first = batch[0]
    batch_size = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else None
    for index in range(max(required, 1), len(batch)):
        if _looks_like_labels(batch[index], batch_size):
            name = type(model).__name__ if model is not None else "the model"
            raise QdqConfigError(
                f"ambiguous batch: element {index} of this {len(batch)}-tuple looks like labels (a 1-D integer "
                f"tensor, one per sample) but {name}.forward would take it as its optional positional argument "
                f"{index}. Write ((inputs...), labels) to pass labels, or a dict of keyword arguments."
            )


def call_model(model: nn.Module, batch: Any, device: torch.device | None = None) -> Any:
    """``model`` called on ``batch`` (labels dropped), its tensors moved to ``device`` (default: the model's)."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return model_inputs(batch, model).to(device)(model)


def flatten_outputs(outputs: Any) -> list[Any]:
    """A model's outputs as a flat list, in the order an ONNX export lists them.

    Tensors and arrays as they are; tuples and lists element by element; mappings (a Hugging Face
    ``ModelOutput``, a dict) value by value in their order, ``None`` values left out.
    """
    if isinstance(outputs, Mapping):
        return [o for v in outputs.values() if v is not None for o in flatten_outputs(v)]
    if isinstance(outputs, tuple | list):
        return [o for v in outputs if v is not None for o in flatten_outputs(v)]
    return [outputs]


def output_names(outputs: Any) -> list[str]:
    """ONNX names of a model's outputs: a mapping's keys (``logits``; ``hidden_states_0``... for a tuple
    entry), else ``output`` for one output and ``output_0``, ``output_1``... for several."""
    if isinstance(outputs, Mapping):
        names: list[str] = []
        for key, value in outputs.items():
            count = len(flatten_outputs(value)) if value is not None else 0
            names += [str(key)] if count == 1 else [f"{key}_{i}" for i in range(count)]
        return names
    return indexed_names("output", len(flatten_outputs(outputs)))


def indexed_names(stem: str, count: int) -> list[str]:
    """``[stem]`` for one, ``[stem_0, stem_1, ...]`` for several."""
    return [stem] if count == 1 else [f"{stem}_{i}" for i in range(count)]


def onnx_input_names(inputs: ModelInputs) -> list[str]:
    """Names of the graph inputs an export of ``inputs`` has, in order: its tensor positional arguments
    (``input``, or ``input_0``, ``input_1``...), then its tensor keyword arguments by keyword.

    Raises:
        QdqConfigError: a keyword collides with a positional name.
    """
    positional = indexed_names("input", sum(isinstance(a, torch.Tensor) for a in inputs.args))
    keywords = [k for k, v in inputs.kwargs.items() if isinstance(v, torch.Tensor)]
    clash = sorted(set(positional) & set(keywords))
    if clash:
        raise QdqConfigError(f"keyword argument(s) {clash} collide with the names of positional inputs.")
    return positional + keywords


def sample_count(batch: Any) -> int | None:
    """Samples in ``batch``: dimension 0 of its first tensor of at least one dimension (depth first through
    tuples, lists and mappings), or None without one (a batch :func:`sample_slice` cannot cut)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else ()
    return next((n for n in map(sample_count, values) if n is not None), None)


def sample_slice(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start`` to ``stop`` (a Python slice) of ``batch``: every tensor whose dimension 0 has
    :func:`sample_count`'s size cut to those rows, through tuples, lists and mappings (a mapping comes back a
    ``dict``); everything else (other tensors, scalars, strings) as it is. Dimension 0 is taken as the samples' axis,
    as everywhere in the batch convention (a sequence-first tensor would be cut in time)."""
    size = sample_count(batch)
    if size is None or (start <= 0 and stop >= size):
        return batch
    return _cut(batch, size, slice(start, stop))


def _cut(value: Any, size: int, rows: slice) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() and value.shape[0] == size else value
    if isinstance(value, Mapping):
        return {key: _cut(v, size, rows) for key, v in value.items()}
    if isinstance(value, tuple | list):
        parts = [_cut(v, size, rows) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)  # a namedtuple: by field
    return value
