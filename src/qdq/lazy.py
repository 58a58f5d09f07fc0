"""The one lazy-import helper: a package whose public names resolve on first access.

qdq's packages import nothing heavy when imported (``import qdq`` imports no torch, ``import qdq.keras`` no
TensorFlow): their ``__init__.py`` lists where each public name lives and hands the list to
:func:`lazy_names`, which returns the package's ``__getattr__`` and ``__dir__``::

    __getattr__, __dir__ = lazy_names(__name__, {"export_onnx": "qdq.export.onnx_export"})

A name is looked up in its module each time it is read (the module is imported once): a name whose value
changes stays current.

:class:`LazyCallable` is the same idea for one function: a registry in a lower layer names a built-in that a
higher layer implements (``qdq.calib.methods``: the pass over the model of the ``auto`` calibration method, in
``qdq.workflow.auto_calibration``) without importing that layer; the module is imported on the first call, by
whoever calls it (a caller in that higher layer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LazyCallable", "lazy_names"]


def lazy_names(
    package: str,
    names: Mapping[str, str],
    *,
    submodules: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
    moved: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, resolving its public names lazily.

    Args:
        package: the package's ``__name__``.
        names: public name -> the module defining it (imported on first access).
        submodules: submodules also reachable as attributes (``qdq.workflow.calibration``).
        aliases: public name -> the attribute of its module it stands for, when they differ.
        renamed: old name -> what it was renamed to; reading it raises ``AttributeError`` saying so.
        moved: a name that left the package -> the module it lives in now; reading it raises ``AttributeError``
            saying where to import it from.
    """
    subs = frozenset(submodules)
    alias = dict(aliases or {})
    renames = dict(renamed or {})
    homes = dict(moved or {})

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is not None:
            return getattr(importlib.import_module(module), alias.get(name, name))
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        if name in renames:
            raise AttributeError(f"{package}.{name} was renamed {package}.{renames[name]}.")
        if name in homes:
            raise AttributeError(f"{package}.{name} moved to {homes[name]}: from {homes[name]} import {name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*names, *subs})

    return __getattr__, __dir__


@dataclass(frozen=True)
class LazyCallable:
    """The function ``name`` of ``module``, imported on the first call (never at construction).

    Attributes:
        module: the module defining it (``"qdq.workflow.auto_calibration"``).
        name: the function's name there.
    """

    module: str
    name: str

    def resolve(self) -> Callable[..., Any]:
        """The function itself (imports its module)."""
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<lazy {self.module}.{self.name}>"
