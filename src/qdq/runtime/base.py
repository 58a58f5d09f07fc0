"""A model loaded on a runtime (:class:`Runtime`, the interface every runtime class implements) and its timing
result (:class:`BenchmarkResult`).

Each runtime's class belongs to its backend (:class:`qdq.runtime.Backend`, registered by name in
:mod:`qdq.runtime_registry`); the backend modules import their heavy package (``onnxruntime``...) only inside
``load``, so ``import qdq.runtime`` stays cheap, and a runtime that is not installed fails only when it is used,
with :class:`~qdq.errors.QdqBackendUnavailable` naming the pip command that installs it
(:func:`import_backend`).
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import ClassVar, TypeVar

import numpy as np

from qdq.errors import QdqBackendUnavailable, QdqConfigError, QdqTypeError
from qdq.runtime.model_info import ModelInfo, TensorSpec

__all__ = ["BenchmarkResult", "Inputs", "Runtime", "check_common_options", "import_backend"]

Inputs = Mapping[str, np.ndarray] | np.ndarray
"""A feed: a mapping from input name to array, or one array for a single-input model."""

_R = TypeVar("_R", bound="Runtime")


class Runtime(ABC):
    """A compiled ONNX model on one backend, ready to run.

    Create one with :func:`~qdq.runtime.load_runtime` (or ``Backend.open``, or ``SomeRuntime.load``), call
    :meth:`run`, and :meth:`close` it (or use it as a context manager) before loading the next one when timing: idle
    sessions of some backends keep worker threads spinning (see :mod:`qdq.runtime.benchmark`).

    Common ``load`` options, accepted by every backend:
        threads: intra-op worker threads (``None``: the backend's default).
        batch: the batch size the model will run at. Backends that specialise shapes (OpenVINO,
            TensorRT) compile for it; ONNX Runtime ignores it.
    """

    name: ClassVar[str] = ""
    """The registry name of the backend, e.g. ``"onnxruntime"``."""

    def __init__(self, info: ModelInfo, *, threads: int | None = None, batch: int | None = None) -> None:
        self.info = info
        self.threads = threads
        self.batch = batch
        #: what the file's target says about running it here (:func:`qdq.runtime.target_check.target_advice`)
        self.advice: str | None = None
        #: how the runtime computes this file where it departs from what was asked (ONNX Runtime runs a float16
        #: Q/DQ file without graph optimizations, as TensorRT computes it); None: as asked
        self.how: str | None = None
        self._closed = False

    @classmethod
    @abstractmethod
    def load(cls, onnx_path: str | Path, *, threads: int | None = None, batch: int | None = None) -> Runtime:
        """Compile ``onnx_path`` for this backend and return a runtime ready to :meth:`run`.

        A runtime class adds its own keyword options after the common ones (``precision`` for OpenVINO,
        ``optimization_level`` for ONNX Runtime...); :meth:`qdq.runtime.Backend.open` passes them on.
        """

    @property
    @abstractmethod
    def precision(self) -> str:
        """What the model computes in, as run by this backend: ``"int8"``, ``"fp32"``, ``"int8+bf16"``..."""

    @property
    def path(self) -> Path:
        """The ONNX file this runtime was loaded from."""
        return self.info.path

    @property
    def input_specs(self) -> tuple[TensorSpec, ...]:
        """Name, shape and dtype of each graph input, in graph order."""
        return self.info.inputs

    @property
    def input_names(self) -> list[str]:
        """Names of the graph inputs, in graph order."""
        return [spec.name for spec in self.info.inputs]

    @property
    def output_names(self) -> list[str]:
        """Names of the graph outputs, in the order :meth:`run` returns them."""
        return list(self.info.outputs)

    def run(self, inputs: Inputs) -> list[np.ndarray]:
        """Run one inference and return the outputs (host arrays) in graph order."""
        return self._run(self._feed(inputs))

    def bind(self, inputs: Inputs) -> Callable[[], object]:
        """Return a zero-argument callable that runs one inference on ``inputs``.

        Benchmarks time this callable. Backends with device memory override it to copy the inputs
        to the device once, so that the timed call measures inference, not host transfers.
        """
        feed = self._feed(inputs)

        def call() -> list[np.ndarray]:
            self._ensure_open()
            return self._run(feed)

        return call

    def time_ms(self, call: Callable[[], object]) -> float:
        """Run ``call`` (from :meth:`bind`) once and return how long it took by this runtime's clock, in ms.

        The host's wall clock here; a backend whose device keeps its own time (or a test's modelled runtime)
        overrides it. Benchmarks and :func:`qdq.tune` time every inference through this method.
        """
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        """Release the session or compiled model. Further :meth:`run` calls raise."""
        if not self._closed:
            self._release()
            self._closed = True

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"threads={self.threads}, batch={self.batch}"
        return f"{type(self).__name__}({str(self.path)!r}, {state})"

    @abstractmethod
    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one inference on a validated feed."""

    @abstractmethod
    def _release(self) -> None:
        """Drop the backend objects (session, compiled model, engine)."""

    def _ensure_open(self) -> None:
        if self._closed:
            raise QdqConfigError(f"{self!r} is closed; load the model again")

    def _feed(self, inputs: Inputs) -> dict[str, np.ndarray]:
        """Check a feed against the graph inputs and return it as a name -> contiguous array dict."""
        self._ensure_open()
        names = self.input_names
        if isinstance(inputs, np.ndarray):
            if len(names) != 1:
                raise QdqTypeError(f"the model has {len(names)} inputs {names}; pass a dict of arrays, not one array")
            inputs = {names[0]: inputs}
        if not isinstance(inputs, Mapping):
            raise QdqTypeError(f"inputs must be a numpy array or a dict of arrays, got {type(inputs).__name__}")
        missing = [n for n in names if n not in inputs]
        unknown = [n for n in inputs if n not in names]
        if missing or unknown:
            raise QdqConfigError(
                f"inputs do not match the model: missing {missing}, unknown {unknown}; the model's inputs are {names}"
            )
        return {n: np.ascontiguousarray(inputs[n]) for n in names}


@dataclass(frozen=True)
class BenchmarkResult:
    """Latency statistics of one model on one backend, all times in milliseconds per inference.

    Build it with :meth:`from_times`; ``p90_ms`` is the 90th percentile (linear interpolation).
    """

    label: str
    backend: str
    precision: str
    batch: int
    threads: int | None
    warmup: int
    iterations: int
    min_ms: float
    median_ms: float
    p90_ms: float
    mean_ms: float
    times_ms: tuple[float, ...] = field(default=(), repr=False)
    note: str = field(default="", compare=False)

    @classmethod
    def from_times(
        cls,
        times_ms: list[float] | tuple[float, ...],
        *,
        label: str,
        backend: str,
        precision: str,
        batch: int,
        threads: int | None,
        warmup: int,
        note: str = "",
    ) -> BenchmarkResult:
        """Summarise per-inference wall times (ms) into min / median / p90 / mean; ``note``: the runtime's
        advice on the file (:attr:`Runtime.advice`)."""
        if not times_ms:
            raise QdqConfigError("no timings to summarise: iterations must be >= 1")
        times = np.asarray(times_ms, dtype=np.float64)
        return cls(
            label=label,
            backend=backend,
            precision=precision,
            batch=batch,
            threads=threads,
            warmup=warmup,
            iterations=len(times),
            min_ms=float(times.min()),
            median_ms=float(np.median(times)),
            p90_ms=float(np.percentile(times, 90)),
            mean_ms=float(times.mean()),
            times_ms=tuple(float(t) for t in times),
            note=note,
        )

    def speedup_over(self, baseline: BenchmarkResult, stat: str = "median") -> float:
        """How many times faster this result is than ``baseline`` (> 1: faster), by ``stat`` ("min"...)."""
        return getattr(baseline, f"{stat}_ms") / getattr(self, f"{stat}_ms")


def check_common_options(threads: int | None, batch: int | None) -> None:
    """Validate the ``threads`` and ``batch`` load options shared by every backend."""
    for name, value in (("threads", threads), ("batch", batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise QdqConfigError(f"{name} must be a positive integer or None, got {value!r}")


def import_backend(module: str, install: str) -> ModuleType:
    """Import a backend's package, or raise :class:`QdqBackendUnavailable` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise QdqBackendUnavailable(
            f"the {module!r} package is needed for this runtime but cannot be imported ({err}); "
            f"install it with: {install}"
        ) from err
