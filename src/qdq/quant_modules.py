"""The seed's opt-in monkey patch: ``quant_modules.initialize()`` / ``deactivate()``.

While active, ``torch.nn.Conv2d`` (and the other classes of the seed's default map) *are* the quantized
classes, so models built in that window come out quantized. Unlike the seed:

* ``initialize`` is idempotent (a second call re-patches from the true originals, never from a patched
  class) and ``deactivate`` restores exactly what was there;
* ``initialize`` returns a context manager: ``with quant_modules.initialize(): model = resnet50()``;
* nothing happens on import.

For a model that already exists prefer :func:`qdq.quantize_model`, which needs no patching.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.registry import QUANT_MODULES, default_float_types

__all__ = ["QuantPatch", "deactivate", "enable_onnx_export", "initialize", "is_active"]


def _default_map() -> list[tuple[types.ModuleType, str, type]]:
    """``(torch.nn, "Conv2d", QuantConv2d)``...: the ``torch.nn`` classes quantized by default (the seed's map,
    read from :data:`qdq.nn.registry.QUANT_MODULES`)."""
    return [
        (torch.nn, float_cls.__name__, QUANT_MODULES.get(float_cls))
        for float_cls in default_float_types()
        if float_cls.__module__.startswith("torch.nn")
    ]


class QuantPatch:
    """The active patch: a record of original attributes, and a context manager that undoes it."""

    def __init__(self) -> None:
        self._originals: dict[tuple[types.ModuleType, str], Any] = {}

    @property
    def active(self) -> bool:
        return bool(self._originals)

    def apply(self, entries: Iterable[tuple[types.ModuleType, str, type]]) -> None:
        for namespace, name, quant_cls in entries:
            key = (namespace, name)
            if key not in self._originals:
                self._originals[key] = getattr(namespace, name)
            setattr(namespace, name, quant_cls)

    def restore(self) -> None:
        for (namespace, name), original in self._originals.items():
            setattr(namespace, name, original)
        self._originals.clear()

    def __enter__(self) -> QuantPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        deactivate()


_PATCH = QuantPatch()


def _entries(
    float_module_list: Sequence[str] | None, custom_quant_modules: Iterable[tuple[Any, str, type]] | None
) -> list[tuple[types.ModuleType, str, type]]:
    defaults = _default_map()
    skip = set(float_module_list or ())
    known = {name for _, name, _ in defaults}
    unknown = skip - known
    if unknown:
        raise QdqConfigError(f"float_module_list names {sorted(unknown)} that are not patched; known: {sorted(known)}.")
    entries = [e for e in defaults if e[1] not in skip]
    for entry in custom_quant_modules or ():
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[1], str)):
            raise QdqTypeError(
                f"custom_quant_modules entries are (namespace, 'ClassName', QuantClass) tuples, got {entry!r}."
            )
        if not hasattr(entry[0], entry[1]):
            raise QdqConfigError(f"{entry[0]!r} has no attribute {entry[1]!r} to replace.")
        entries.append(entry)
    return entries


def initialize(
    float_module_list: Sequence[str] | None = None,
    custom_quant_modules: Iterable[tuple[Any, str, type]] | None = None,
) -> QuantPatch:
    """Replace ``torch.nn`` module classes by their quantized versions until :func:`deactivate`.

    Args:
        float_module_list: class names to leave float, e.g. ``["Linear"]``.
        custom_quant_modules: extra ``(namespace, "ClassName", QuantClass)`` replacements.

    Returns:
        The patch, usable as a context manager that deactivates on exit.
    """
    entries = _entries(float_module_list, custom_quant_modules)
    _PATCH.restore()
    _PATCH.apply(entries)
    return _PATCH


def deactivate() -> None:
    """Restore every attribute :func:`initialize` replaced. Safe to call when nothing is patched."""
    _PATCH.restore()


def is_active() -> bool:
    """True while a patch from :func:`initialize` is in place."""
    return _PATCH.active


def enable_onnx_export() -> contextlib.AbstractContextManager[None]:
    """Seed compatibility: a no-op context manager. Use :func:`qdq.export_onnx`, which checks readiness."""
    return contextlib.nullcontext()
