"""Where the search's files are placed, scored and timed: the target, and the runtime its registered runtimes
allow (:func:`runtime_for`), asked through its :class:`~qdq.runtime.Backend` for everything (:class:`Engine`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdq.errors import QdqConfigError, QdqRuntimeWarning
from qdq.runtime import Backend, Runtime, get_backend
from qdq.runtime_registry import ORT_RUNTIME
from qdq.targets import Target

__all__ = ["Engine", "runtime_for"]


@dataclass(frozen=True)
class Engine:
    """The target files are placed for, the runtime's backend they are scored and timed on, its options.

    Attributes:
        target: the placement target.
        backend: the runtime's backend (:func:`runtime_for`).
        threads: the runtime's threads (and ONNX Runtime's for the FP32 reference).
        options: the runtime's load options (:meth:`qdq.runtime.Backend.open`).
        said: the kinds of runtime warning said already (:meth:`once`).
    """

    target: Target
    backend: Backend
    threads: int | None
    options: dict[str, Any]
    said: set[str] = field(default_factory=set)

    def open(self, path: Path, batch: int) -> Runtime:
        """``path`` loaded on the runtime for batches of up to ``batch`` (its warnings said once)."""
        with self.once():
            return self.backend.open(path, threads=self.threads, batch=batch, **self.options)

    def open_reference(self, path: Path) -> Runtime:
        """The FP32 file on ONNX Runtime's backend, whatever the runtime scoring the search: the reference outputs
        are the float model's own, computed in float32."""
        return get_backend(ORT_RUNTIME).open(path, threads=self.threads)

    @contextlib.contextmanager
    def once(self) -> Iterator[None]:
        """Pass on each kind of warning the runtime gives while loading the search's files once, not once per file:
        a runtime's warning about a file (:class:`~qdq.errors.QdqRuntimeWarning`) by its ``kind``, said without the
        file's name (the search's files are temporary); any other by its text."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for warning in caught:
            message = warning.message
            if isinstance(message, QdqRuntimeWarning):
                key, text = message.kind, message.text
            else:
                key = text = str(message)
            if key not in self.said:
                self.said.add(key)
                warnings.warn(f"tune: {text}", warning.category, stacklevel=3)


def runtime_for(target: Target, runtime: str | None) -> Backend:
    """The backend of ``runtime`` (default: ``target``'s first native runtime), checked: ``target`` supports it and
    it is installed here.

    Raises:
        QdqConfigError: no native runtime to default to; a runtime the target refuses or does not name; a runtime
            that is not installed.
    """
    usable = [support for support in target.runtimes if support.verdict != "refuses"]
    runtime = runtime or target.native_runtime
    if runtime is None:
        raise QdqConfigError(f"target {target.name!r} names no native runtime to time its files on: pass "
                             f"runtime= (one of {[s.runtime for s in usable]}).")  # fmt: skip
    backend = get_backend(runtime)
    support = target.support(backend.name)
    if support is None or support.verdict == "refuses":
        why = f": {support.reason}" if support is not None else ""
        raise QdqConfigError(f"target {target.name!r} does not run on {backend.name!r}{why}. tune scores and times "
                             f"on a runtime the target supports: {[s.runtime for s in usable]}.")  # fmt: skip
    if not backend.available():
        raise QdqConfigError(f"tune scores and times every configuration on runtime {backend.name!r}, which is not "
                             f"installed here: {backend.install or 'install its package'}; or pass runtime= one of "
                             f"{[s.runtime for s in usable]}.")  # fmt: skip
    return backend
