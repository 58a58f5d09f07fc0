"""The target a model remembers: the placed mark (``export_onnx`` defaults to it) and the stale mark.

A model placed for a target remembers the target's name (:func:`placed_target`) and the target options it was
placed with (:func:`placed_options`: ``QuantConfig(target_options=...)``, which ``export_onnx`` uses unless the
call overrides them). A model that placement replaced by a new one is marked stale (:func:`mark_superseded`):
running or exporting it raises, since it lacks the quantizers the returned model carries. Marks are names and
plain option values (strings, numbers), so a model pickles without its target.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qdq.errors import QdqConfigError
from qdq.registry import Registry

__all__ = [
    "MARK_PARTS",
    "check_not_superseded",
    "mark_placed",
    "mark_superseded",
    "placed_options",
    "placed_target",
    "superseded_by",
]

_TARGET_ATTR = "_qdq_target"  # set on a placed model: the target's name
_OPTIONS_ATTR = "_qdq_target_options"  # set on a placed model: the target options it was placed with
_SUPERSEDED_ATTR = "_qdq_superseded"  # set on a model placement replaced: the target's name


def _submodules(model: Any) -> list[Any] | None:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else None


#: front end -> ``parts(model)``: the parts of a model of its kind a mark may sit on (a torch model's submodules), or
#: None when ``model`` is not of its kind; tried in registration order. PyTorch's is built in; the Keras front end
#: registers its own (a model's layers: its quantize wrappers keep their target in a saved model).
MARK_PARTS: Registry[str, Callable[[Any], list[Any] | None]] = Registry("model parts")
MARK_PARTS.register("torch", _submodules)


def mark_placed(model: Any, target: str, options: Mapping[str, Any] | None = None) -> None:
    """Record on ``model`` (an ``nn.Module``, a Keras model or layer) that it was placed for the target named
    ``target`` with the target options ``options`` (kept by ``copy.deepcopy`` and pickling,
    ``torch.fx.GraphModule`` included)."""
    _set_mark(model, _TARGET_ATTR, target)
    _set_mark(model, _OPTIONS_ATTR, dict(options or {}))


def placed_options(model: Any) -> dict[str, Any]:
    """The target options ``model`` was placed with (empty when none, or when it was never placed): its own
    mark, else the one found on its submodules."""
    own = _mark(model, _OPTIONS_ATTR)
    if own is not None:
        return dict(own)
    found = [mark for m in _modules(model) if (mark := _mark(m, _OPTIONS_ATTR))]
    return dict(found[0]) if found else {}


def placed_target(model: Any) -> str | None:
    """The target ``model`` was placed for: its own mark, else the one mark found on its submodules (a placed
    model inside a wrapper); None when it was never placed.

    Raises:
        QdqConfigError: submodules placed for different targets.
    """
    own = _mark(model, _TARGET_ATTR)
    if own is not None:
        return own
    found = {mark for m in _modules(model) if (mark := _mark(m, _TARGET_ATTR)) is not None}
    if len(found) > 1:
        raise QdqConfigError(f"parts of this model were placed for different targets: {sorted(found)}.")
    return found.pop() if found else None


def mark_superseded(model: Any, target: str) -> None:
    """Mark ``model`` as replaced by the new model placement returned for ``target``: running it raises
    ``QdqConfigError`` (it lacks the added quantizers), and :func:`check_not_superseded` fails on it."""
    _set_mark(model, _SUPERSEDED_ATTR, target)
    if hasattr(model, "register_forward_pre_hook"):
        model.register_forward_pre_hook(_refuse_forward)


def superseded_by(model: Any) -> str | None:
    """The target of the placement that replaced ``model`` (or one of its submodules) by a new model, else None."""
    for module in (model, *_modules(model)):
        target = _mark(module, _SUPERSEDED_ATTR)
        if target is not None:
            return target
    return None


def check_not_superseded(model: Any, error: type[Exception] = QdqConfigError) -> None:
    """Raise ``error`` when ``model`` was replaced by the model placement returned (see :func:`mark_superseded`)."""
    target = superseded_by(model)
    if target is not None:
        raise error(_stale_message(target))


def _stale_message(target: str) -> str:
    return (
        f"This model was placed for target {target!r} into a new model, which carries the quantizers "
        f"{target} needs; this one lacks them. Use the model returned by quantize_model "
        f"(model = qdq.quantize_model(model, qdq.QuantConfig(target={target!r}))) or by apply_placement."
    )


def _refuse_forward(module: Any, args: Any) -> None:
    raise QdqConfigError(_stale_message(_mark(module, _SUPERSEDED_ATTR) or "?"))


def _modules(model: Any) -> list[Any]:
    """The parts a mark may sit on (:data:`MARK_PARTS`); none for a model no front end knows."""
    for name in MARK_PARTS:
        found = MARK_PARTS.get(name)(model)
        if found is not None:
            return found
    return []


def _set_mark(model: Any, key: str, value: Any) -> None:
    """An attribute; on a ``torch.fx.GraphModule`` also its ``meta`` dict, which its ``__deepcopy__`` keeps."""
    setattr(model, key, value)
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict) and "_graph" in vars(model):  # a GraphModule
        meta[key] = value


def _mark(model: Any, key: str) -> Any:
    value = getattr(model, key, None)
    meta = getattr(model, "meta", None)
    if value is None and isinstance(meta, dict) and "_graph" in vars(model):
        value = meta.get(key)
    return value
