"""The registered runtimes, by name: what ``load_runtime(path, "openvino")``, ``qdq bench --runtime`` and a target's
:class:`~qdq.targets.RuntimeSupport` resolve to.

Each runtime is one :class:`RuntimeEntry`: its name, the aliases users may type, and its backend (a
:class:`qdq.runtime.Backend`: the runtime class, what it reports about a file, its checks and caches), given as the
object or as the location ``"module:ATTRIBUTE"`` of one that is imported on first use. The registry sits below
:mod:`qdq.targets` and :mod:`qdq.runtime`, so that both read one list of names: a target names the runtimes it
supports by their entries (checked when the target is made), and :mod:`qdq.runtime` turns an entry into its
backend (:func:`qdq.runtime.get_backend`). This module imports nothing of the backends; the three built-in entries
are registered here, and ``qdq.runtime.register_runtime(backend)`` adds one from anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.registry import Registry

__all__ = [
    "OPENVINO_RUNTIME",
    "ORT_RUNTIME",
    "RUNTIME_REGISTRY",
    "TENSORRT_RUNTIME",
    "RuntimeEntry",
    "find_runtime_entry",
    "register_runtime_entry",
    "runtime_entry",
    "unregister_runtime_entry",
]


@dataclass(frozen=True)
class RuntimeEntry:
    """One registered runtime.

    Attributes:
        name: the registry name (``"onnxruntime"``), also what a :class:`~qdq.runtime.Runtime` of it reports.
        backend: its :class:`qdq.runtime.Backend`, or that object's location ``"module:ATTRIBUTE"``, imported the
            first time the backend is asked for (:func:`qdq.runtime.get_backend`).
        aliases: other names that resolve to it (``"ort"``).
    """

    name: str
    backend: Any = field(repr=False)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a runtime name is a non-empty string, got {self.name!r}.")
        if isinstance(self.backend, str) and ":" not in self.backend:
            raise QdqConfigError(
                f"runtime {self.name!r}: a backend location is 'module:ATTRIBUTE', got {self.backend!r}."
            )
        object.__setattr__(self, "aliases", tuple(self.aliases))


#: name -> RuntimeEntry.
RUNTIME_REGISTRY: Registry[str, RuntimeEntry] = Registry("runtime")


def register_runtime_entry(entry: RuntimeEntry, *, override: bool = False) -> RuntimeEntry:
    """Register ``entry`` under its name (``override=True`` replaces a registered one of that name).

    Raises:
        QdqConfigError: the name is taken (and ``override`` is False), or an alias names another runtime.
    """
    if not isinstance(entry, RuntimeEntry):
        raise QdqTypeError(f"register_runtime_entry needs a RuntimeEntry, got {type(entry).__name__}.")
    for alias in entry.aliases:
        other = find_runtime_entry(alias)
        if other is not None and other.name != entry.name:
            raise QdqConfigError(f"runtime alias {alias!r} of {entry.name!r} already names runtime {other.name!r}.")
    return RUNTIME_REGISTRY.register(entry.name, entry, override=override)


def unregister_runtime_entry(name: str) -> RuntimeEntry:
    """Remove the runtime ``name`` (an alias is accepted); returns its entry.

    A target made while it was registered keeps naming it; register targets after their runtimes, and remove
    them before.
    """
    return RUNTIME_REGISTRY.unregister(runtime_entry(name).name)


def find_runtime_entry(name: str) -> RuntimeEntry | None:
    """The registered runtime called ``name`` or with ``name`` among its aliases, or None."""
    found = RUNTIME_REGISTRY.find(name)
    if found is not None:
        return found
    return next((entry for _, entry in RUNTIME_REGISTRY.items() if name in entry.aliases), None)


def runtime_entry(name: str) -> RuntimeEntry:
    """The registered runtime called ``name`` (or an alias of it).

    Raises:
        QdqTypeError: ``name`` is not a string.
        QdqConfigError: no runtime has that name; the message lists the registered ones.
    """
    if not isinstance(name, str):
        raise QdqTypeError(f"a runtime is named by a string, got {type(name).__name__} {name!r}.")
    found = find_runtime_entry(name)
    if found is None:
        names = sorted(RUNTIME_REGISTRY)
        raise QdqConfigError(f"Unknown runtime {name!r}. Registered: {names}.{did_you_mean(name, names)}")
    return found


#: ONNX Runtime's CPU provider (:mod:`qdq.runtime.ort`).
ORT_RUNTIME = register_runtime_entry(RuntimeEntry("onnxruntime", "qdq.runtime.ort:BACKEND", aliases=("ort",)))
#: OpenVINO's CPU plugin (:mod:`qdq.runtime.openvino`).
OPENVINO_RUNTIME = register_runtime_entry(RuntimeEntry("openvino", "qdq.runtime.openvino:BACKEND", aliases=("ov",)))
#: TensorRT >= 10 on a CUDA GPU (:mod:`qdq.runtime.tensorrt`).
TENSORRT_RUNTIME = register_runtime_entry(RuntimeEntry("tensorrt", "qdq.runtime.tensorrt:BACKEND", aliases=("trt",)))
