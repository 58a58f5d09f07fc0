"""The target an export writes for: the one the model was quantized for, checked against the one asked for.

Both front ends' exports (:func:`qdq.export.export_onnx`, :func:`qdq.keras.export_onnx`) call
:func:`export_target`, so a model quantized for one target is refused for another with the same message.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

from typing import Any

from qdq.errors import QdqExportError
from qdq.targets.marks import check_not_superseded, placed_target
from qdq.targets.registry import DEFAULT_TARGET, get_target, resolve_target
from qdq.targets.target import Target

__all__ = ["export_target"]


def export_target(model: Any, requested: str | Target | None) -> Target:
    """The target to export ``model`` for: ``requested``, which must be the one it was quantized for; None: that
    one, else the default target.

    Raises:
        QdqExportError: the model is stale (placement replaced it), or was quantized for another target.
    """
    check_not_superseded(model, QdqExportError)
    placed = placed_target(model)
    if requested is None:
        return get_target(placed or DEFAULT_TARGET)
    target = resolve_target(requested)
    if placed is not None and placed != target.name:
        raise QdqExportError(
            f"this model was quantized and placed for target {placed!r} and cannot be exported for "
            f"{target.name!r}: its quantizers are where {placed} needs them. Export it with target={placed!r} (or "
            f"no target), or quantize a fresh copy of the float model for target={target.name!r}."
        )
    return target
