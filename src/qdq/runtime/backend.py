"""One backend per runtime, and the functions that find them by name.

A :class:`Backend` is everything qdq knows about running ONNX files on one runtime: its :class:`Runtime` class
(:meth:`Backend.open`), what it needs installed (:meth:`Backend.available`, :attr:`Backend.install`), what it
reports about a file (:meth:`Backend.int8_coverage`: the weighted layers on int8 kernels and those left float with
the reason; :meth:`Backend.report`, its own detailed report), its checks (:attr:`Backend.rule_check`), the load
options it takes beyond the common ones (:attr:`Backend.precisions`, :meth:`Backend.reference_variants`) and what
is known about where it departs from PyTorch (:meth:`Backend.divergence_cause`). The CLI and the application ask a
backend these questions instead of comparing runtime names.

Backends are registered by name in :mod:`qdq.runtime_registry` (the three built-in ones there, as the locations
of their ``BACKEND`` objects: :mod:`qdq.runtime.ort`, :mod:`qdq.runtime.openvino`, :mod:`qdq.runtime.tensorrt`;
another with :func:`register_runtime` from any code). :func:`get_backend` turns a name, an alias or a registered
entry into the backend, importing its module the first time.

The facts a runtime shares with the targets made for it (ONNX Runtime's fusion facts, TensorRT's rule check, the
uint8 weight encoding) are recorded on those targets, which placement and export read too; a backend reads them
from the targets registered as ``"native"`` on it (:meth:`Backend.native_fact`), never from a target's package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.runtime.base import Runtime
from qdq.runtime.coverage import Coverage
from qdq.runtime_registry import (
    RUNTIME_REGISTRY,
    RuntimeEntry,
    register_runtime_entry,
    runtime_entry,
    unregister_runtime_entry,
)
from qdq.targets import Target
from qdq.targets.registry import native_fact
from qdq.targets.target import BlockWeights

__all__ = [
    "Backend",
    "backends",
    "get_backend",
    "get_runtime_class",
    "load_runtime",
    "register_runtime",
    "runtime_names",
    "timing_backend",
    "unregister_runtime",
]

T = TypeVar("T")


class Backend:
    """One runtime: its runtime class, what it needs installed, what it reports about a file, its checks.

    Subclass it for a runtime with reports (the built-in ones do), or register a plain one for a :class:`Runtime`
    class alone (``register_runtime("name", MyRuntime)``): it opens files and reports no coverage.

    Args:
        name: the registry name; the runtime class's ``name`` must be the same (or empty).
        runtime_class: the :class:`Runtime` subclass, or its location ``"module:Class"`` (imported on first use).
        package: the Python package the runtime needs (None: nothing beyond qdq's own dependencies).
        install: the command that installs it (said when it is missing).
        description: one line for listings.
        precisions: the values of the ``precision`` load option it takes (empty: it takes none).
        divergence_causes: op type feeding the first quantizer where the runtime departs from PyTorch ->
            the known cause, established by measurement (:meth:`divergence_cause`).
        block_weight_bits: the weight widths of ONNX Runtime's ``com.microsoft`` ``MatMulNBits`` the runtime has
            kernels for (empty: none), which :func:`qdq.tune` tries for the MatMuls a configuration leaves float
            (:meth:`block_weight_matmuls`, :meth:`with_block_weights`).
        compiles: opening a file builds an engine for a device (TensorRT: seconds to minutes a file); qdq then
            times files on it only where the user asks (``tune``, ``bench``), never inside a calibration.
    """

    def __init__(
        self,
        name: str,
        runtime_class: type[Runtime] | str,
        *,
        package: str | None = None,
        install: str = "",
        description: str = "",
        precisions: tuple[str, ...] = (),
        divergence_causes: Mapping[str, str] | None = None,
        block_weight_bits: tuple[int, ...] = (),
        compiles: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise QdqTypeError(f"a backend's name is a non-empty string, got {name!r}.")
        if not isinstance(runtime_class, str) and not (isinstance(runtime_class, type)
                                                       and issubclass(runtime_class, Runtime)):  # fmt: skip
            raise QdqTypeError(f"backend {name!r}: runtime_class is a Runtime subclass or 'module:Class', got "
                               f"{runtime_class!r}.")  # fmt: skip
        self.name = name
        self._runtime_class = runtime_class
        self.package = package
        self.install = install or (f"pip install {package}" if package else "")
        self.description = description
        self.precisions = tuple(precisions)
        self.divergence_causes = dict(divergence_causes or {})
        self.block_weight_bits = tuple(block_weight_bits)
        self.compiles = compiles

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- the runtime ----------------------------------------------------------------------------------

    @property
    def runtime_class(self) -> type[Runtime]:
        """The :class:`Runtime` subclass that loads files on this runtime."""
        found = self._runtime_class
        if isinstance(found, str):
            module, _, attribute = found.partition(":")
            found = getattr(importlib.import_module(module), attribute)
            if not (isinstance(found, type) and issubclass(found, Runtime)):
                raise QdqTypeError(f"backend {self.name!r}: {self._runtime_class!r} is not a Runtime subclass.")
            self._runtime_class = found
        if found.name not in ("", self.name):
            raise QdqConfigError(f"backend {self.name!r}: its runtime class {found.__name__} is named {found.name!r}.")
        return found

    @property
    def entry(self) -> RuntimeEntry:
        """This runtime's registered entry (what targets name)."""
        return runtime_entry(self.name)

    def available(self) -> bool:
        """Whether the runtime's Python package can be imported here (it is not imported; a device the runtime
        needs, TensorRT's GPU, is looked for when a file is opened)."""
        if self.package is None:
            return True
        if self.package in sys.modules:
            return sys.modules[self.package] is not None
        try:
            return importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):
            return False

    def open(self, onnx_path: str | Path, **options: Any) -> Runtime:
        """Load ``onnx_path`` on this runtime, ready to run (``options``: the runtime class's ``load`` options:
        ``threads``, ``batch``, and its own such as ``precision``).

        Raises:
            QdqConfigError: a missing or non-ONNX file, a file its target says this runtime cannot run, a bad option.
            QdqBackendUnavailable: the runtime's package (or its device) is not available.
        """
        return self.runtime_class.load(onnx_path, **options)

    # -- what it says about a file ------------------------------------------------------------------------

    def int8_coverage(self, onnx_path: str | Path, *, threads: int | None = None, **options: Any) -> Coverage | None:
        """Which weighted layers of ``onnx_path`` this runtime runs on int8 kernels, and those it leaves float with
        the reason, as the runtime itself reports it; None when it reports nothing (this base class)."""
        return None

    def report(
        self, onnx_path: str | Path, *, threads: int | None = None, batch: int | None = None, **options: Any
    ) -> object | None:
        """The runtime's own report on ``onnx_path`` (printable), as ``qdq bench`` prints it: by default its
        :meth:`int8_coverage` (``batch`` is for runtimes that compile per batch size)."""
        return self.int8_coverage(onnx_path, threads=threads, **options)

    @property
    def rule_check(self) -> Callable[[Any], Any] | None:
        """``rule_check(model_or_path) -> report``: the runtime's rules checked on any ONNX graph (``qdq check``),
        or None when qdq knows none for it (this base class)."""
        return None

    def divergence_cause(self, op_type: str) -> str | None:
        """The known cause when this runtime departs from PyTorch first at a quantizer fed by ``op_type``."""
        return self.divergence_causes.get(op_type)

    # -- block-quantized weights -------------------------------------------------------------------------

    def block_weight_matmuls(self, model: Any) -> list[str]:
        """The MatMuls of ``model`` (an ``onnx.ModelProto``) that run in float on a constant weight, which this runtime
        can run with block-quantized weights; none where it declares no width (:attr:`block_weight_bits`) or no target
        made for it records the rewrite (:attr:`qdq.targets.Target.block_weights`)."""
        rewrite = self._block_weights()
        return [] if rewrite is None else list(rewrite.matmuls(model))

    def with_block_weights(self, model: Any, nodes: Sequence[str], bits: int) -> Any:
        """A copy of ``model`` with the MatMuls ``nodes`` on ``bits``-bit block weights, as this runtime runs them.

        Raises:
            QdqConfigError: a width this runtime has no kernels for, or no rewrite recorded for it.
        """
        rewrite = self._block_weights()
        if rewrite is None or bits not in self.block_weight_bits:
            widths = list(self.block_weight_bits)
            raise QdqConfigError(f"runtime {self.name!r} runs block-quantized weights of {widths} bits (by a rewrite "
                                 f"a target made for it records), not {bits}.")  # fmt: skip
        return rewrite.convert(model, nodes, bits)

    def _block_weights(self) -> BlockWeights | None:
        return self.native_fact(lambda target: target.block_weights) if self.block_weight_bits else None

    # -- load options --------------------------------------------------------------------------------------

    def check_precision(self, precision: str) -> None:
        """Raise ``QdqConfigError`` unless ``precision`` is a value of the ``precision`` load option it takes."""
        if precision not in self.precisions:
            taken = f"one of {list(self.precisions)}" if self.precisions else "no precision option"
            raise QdqConfigError(f"runtime {self.name!r} takes {taken}, got precision {precision!r}.")

    def reference_variants(self) -> tuple[dict[str, Any], ...]:
        """The load options of each row an FP32 reference is timed in (``qdq bench --fp32``): one row by default."""
        return ({},)

    # -- facts it shares with targets -------------------------------------------------------------------

    def native_fact(self, fact: Callable[[Target], T | None]) -> T | None:
        """``fact(target)`` of the first registered target made for this runtime (``"native"``) that records one."""
        return native_fact(self.name, fact)


def register_runtime(
    backend: Backend | str,
    runtime_class: type[Runtime] | str | None = None,
    *,
    aliases: tuple[str, ...] = (),
    override: bool = False,
) -> RuntimeEntry:
    """Register a runtime: ``register_runtime(backend)``, or ``register_runtime("name", RuntimeClass)`` for a plain
    :class:`Backend` around a :class:`Runtime` subclass (or its location ``"module:Class"``).

    Targets may name it once it is registered (:class:`qdq.targets.RuntimeSupport`); ``load_runtime``,
    ``qdq bench --runtime``, ``qdq verify --runtime`` and the application take its name.

    Returns:
        Its registered entry.

    Raises:
        QdqConfigError: the name (or an alias) is taken and ``override`` is False.
        QdqTypeError: neither a backend nor a name with a runtime class.
    """
    if isinstance(backend, str):
        if runtime_class is None:
            raise QdqTypeError(f"register_runtime({backend!r}, ...) needs the runtime class (or a Backend alone).")
        backend = Backend(backend, runtime_class)
    elif not isinstance(backend, Backend) or runtime_class is not None:
        raise QdqTypeError("register_runtime takes a Backend, or a name and a Runtime class.")
    return register_runtime_entry(RuntimeEntry(backend.name, backend, aliases=aliases), override=override)


def unregister_runtime(name: str) -> RuntimeEntry:
    """Remove the runtime ``name`` (targets naming it should be removed first); returns its entry."""
    return unregister_runtime_entry(name)


def get_backend(runtime: str | RuntimeEntry | Backend) -> Backend:
    """The backend of a registered runtime, given its name (an alias is accepted: ort, ov, trt) or entry.

    Raises:
        QdqConfigError: no runtime has that name; the message lists the registered ones.
    """
    if isinstance(runtime, Backend):
        return runtime
    entry = runtime if isinstance(runtime, RuntimeEntry) else runtime_entry(runtime)
    found = entry.backend
    if isinstance(found, str):
        module, _, attribute = found.partition(":")
        found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Backend) or found.name != entry.name:
        raise QdqTypeError(f"runtime {entry.name!r} is registered with {found!r}, not a Backend of that name.")
    return found


def timing_backend(runtime: str | None) -> Backend | None:
    """The backend of ``runtime`` where it is installed here and loads a file without building an engine (a file
    timed in seconds); None for None, a runtime not installed, or one that compiles (TensorRT)."""
    if runtime is None:
        return None
    backend = get_backend(runtime)
    return backend if backend.available() and not backend.compiles else None


def backends() -> tuple[Backend, ...]:
    """The backends of every registered runtime, by name."""
    return tuple(get_backend(name) for name in runtime_names())


def runtime_names() -> list[str]:
    """Names of the registered runtimes (installed or not), sorted."""
    return sorted(RUNTIME_REGISTRY)


def get_runtime_class(name: str) -> type[Runtime]:
    """The :class:`Runtime` subclass of the runtime ``name`` (aliases: ort, ov, trt).

    Raises:
        QdqConfigError: no runtime has that name; the message lists the registered ones.
    """
    return get_backend(name).runtime_class


def load_runtime(onnx_path: str | Path, runtime: str = "onnxruntime", **options: Any) -> Runtime:
    """Load ``onnx_path`` on the runtime named ``runtime`` and return it ready to run (:meth:`Backend.open`).

    ``options`` go to that runtime's ``load`` (``threads``, ``batch``, and runtime-specific ones such
    as ``optimization_level`` for ONNX Runtime or ``precision`` for OpenVINO).

    Raises:
        QdqConfigError: unknown runtime name, missing file, or a file that is not ONNX.
        QdqBackendUnavailable: the runtime's package (or its device) is not available.
    """
    return get_backend(runtime).open(onnx_path, **options)
