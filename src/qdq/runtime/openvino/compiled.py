"""OpenVINO's CPU plugin: compile an ONNX model (Q/DQ or float), run it (:class:`OpenVinoRuntime`), report per-layer
precision (:func:`precision_report`).

OpenVINO runs a TensorRT-style Q/DQ graph (signed int8 Q/DQ on the inputs and weights of convs only)
with its convolutions in u8, without the rewrite ONNX Runtime needs. Two settings matter when it is
timed:

* ``INFERENCE_PRECISION_HINT``. On CPUs with bf16 support OpenVINO computes a float model in bf16
  unless told otherwise, so an "FP32" baseline is silently bf16. This backend defaults to ``"f32"``
  (a true FP32 baseline); ask for ``precision="bf16"`` to get the bf16 row, or ``None`` for the
  device's default.
* ``INFERENCE_NUM_THREADS`` (``threads``) and ``PERFORMANCE_HINT=LATENCY`` (one stream).

A model with dynamic input dimensions (qdq exports a symbolic batch) is compiled again for each input shape it
is run with (static shapes; the last :data:`STATIC_SHAPES_KEPT` kept), not run through OpenVINO's dynamic-shape
path. Seen on OpenVINO 2026.4: a quantized ViT's class-token concat (a Conv's output Q/DQ, Reshape, Transpose,
then Concat with a token expanded to the dynamic batch) comes out with the Transpose lost on the dynamic path
(most of the digit ViT's classes changed: benchmarks/RESULTS.md, code_figures), exact once the batch is static.
``batch=N`` fixes the batch once instead (what benchmarks use: one compilation).

``openvino`` is imported only when a model is compiled.
"""

from __future__ import annotations

import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqConfigError, QdqRuntimeWarning, did_you_mean
from qdq.runtime._text import first_line
from qdq.runtime.base import Runtime, check_common_options, import_backend
from qdq.runtime.model_info import ModelInfo, read_model_info
from qdq.runtime.openvino.precision import LayerPrecision, PrecisionReport
from qdq.runtime.saturation import saturation_safe_model
from qdq.runtime.target_check import target_advice
from qdq.runtime_registry import OPENVINO_RUNTIME

if TYPE_CHECKING:
    import openvino

__all__ = [
    "PRECISION_HINTS",
    "STATIC_SHAPES_KEPT",
    "OpenVinoRuntime",
    "precision_hint",
    "precision_report",
    "supported_precisions",
]

PRECISION_HINTS = {"f32": "f32", "fp32": "f32", "bf16": "bf16", "f16": "f16", "fp16": "f16"}
"""Accepted ``precision`` values and the ``INFERENCE_PRECISION_HINT`` each sets."""

_LABELS = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}

STATIC_SHAPES_KEPT = 4
"""Compiled static-shape variants a runtime keeps for a model with dynamic inputs (the least recently used goes)."""


def _ov() -> Any:
    return import_backend("openvino", "pip install openvino")


def precision_hint(precision: str) -> str:
    """The ``INFERENCE_PRECISION_HINT`` value for a ``precision`` option ("fp32" -> "f32"...).

    Raises:
        QdqConfigError: an unknown precision; the message lists the accepted ones.
    """
    if precision not in PRECISION_HINTS:
        raise QdqConfigError(
            f"unknown OpenVINO precision {precision!r}; choose one of {', '.join(PRECISION_HINTS)} or None."
            + did_you_mean(precision, PRECISION_HINTS)
        )
    return PRECISION_HINTS[precision]


def supported_precisions(device: str = "CPU") -> list[str]:
    """Inference precisions ``device`` can compute in, e.g. ``["f32", "bf16"]`` on AVX512-BF16 CPUs."""
    capabilities = _ov().Core().get_property(device, "OPTIMIZATION_CAPABILITIES")
    found = {"FP32": "f32", "BF16": "bf16", "FP16": "f16"}
    return [hint for cap, hint in found.items() if cap in capabilities]


class OpenVinoRuntime(Runtime):
    """A model compiled by OpenVINO, with one inference request."""

    name = OPENVINO_RUNTIME.name

    def __init__(
        self,
        info: ModelInfo,
        compiled: openvino.CompiledModel,
        *,
        threads: int | None,
        batch: int | None,
        model: openvino.Model | None = None,
        compile_static: Callable[[openvino.Model], openvino.CompiledModel] | None = None,
    ) -> None:
        super().__init__(info, threads=threads, batch=batch)
        #: the model as compiled by :meth:`load` (dynamic dimensions kept): its precisions, outputs
        self.compiled: openvino.CompiledModel | None = compiled
        self._request = compiled.create_infer_request()
        self.inference_precision: str = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self._model = model if model is not None and model.is_dynamic() else None
        self._compile_static = compile_static
        #: input shapes -> (compiled, request), most recently used last
        self._static: OrderedDict[tuple[tuple[int, ...], ...], tuple[Any, Any]] = OrderedDict()
        #: int8 weights stored as uint8 before compiling (``load``'s ``uint8_weights``): OpenVINO runs them in float
        self.reencoded_weights = 0

    @classmethod
    def load(
        cls,
        onnx_path: str | Path,
        *,
        threads: int | None = None,
        batch: int | None = None,
        precision: str | None = "f32",
        device: str = "CPU",
        uint8_weights: bool | None = None,
    ) -> OpenVinoRuntime:
        """Read and compile ``onnx_path``.

        Args:
            onnx_path: the ONNX file.
            threads: ``INFERENCE_NUM_THREADS`` (None: OpenVINO's default).
            batch: if given, a dynamic leading dimension is fixed to it before compiling (faster);
                the model then only accepts that batch size.
            precision: ``INFERENCE_PRECISION_HINT``: "f32" (default, true FP32), "bf16", "f16", or
                None for the device's default (bf16 on CPUs that support it).
            device: OpenVINO device name.
            uint8_weights: store int8 weights of more than 64 levels as uint8 before compiling (the same
                values; OpenVINO then runs those layers in float). None (default): on a CPU whose int8 dot
                products saturate (:mod:`qdq.runtime.saturation`), where OpenVINO's int8 kernels would give
                wrong results for them; a warning says how many layers that moves to float.
        """
        check_common_options(threads, batch)
        config = _compile_config(threads, precision)
        info = read_model_info(onnx_path)
        advice = target_advice(info, OPENVINO_RUNTIME)
        core = _ov().Core()
        model, reencoded = _read_model(core, info.path, uint8_weights)
        if batch is not None:
            _fix_batch(model, batch)
        try:
            compiled = core.compile_model(model, device, config)
        except RuntimeError as err:
            raise QdqConfigError(f"OpenVINO cannot compile {info.path.name}: {_last_line(err)}") from None
        runtime = cls(info, compiled, threads=threads, batch=batch, model=model,
                      compile_static=lambda static: core.compile_model(static, device, config))  # fmt: skip
        runtime.advice = advice
        runtime.reencoded_weights = reencoded
        return runtime

    @property
    def precision(self) -> str:
        """``"int8"`` for a Q/DQ graph (``"int8+bf16"`` if its float layers run in bf16), else the hint."""
        label = _LABELS.get(self.inference_precision, self.inference_precision)
        if not self.info.quantized:
            return label
        return "int8" if label == "fp32" else f"int8+{label}"

    def precision_report(self) -> PrecisionReport:
        """Per-layer runtime precision of the compiled model (see :mod:`qdq.runtime.openvino.precision`)."""
        self._ensure_open()
        assert self.compiled is not None
        layers = tuple(_layer(op) for op in self.compiled.get_runtime_model().get_ordered_ops())
        return PrecisionReport(self.path.name, self.inference_precision, layers)

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        assert self.compiled is not None  # callers check _ensure_open() first
        compiled, request = self._for_shapes(feed)
        try:
            result = request.infer(feed)
        except RuntimeError as err:
            raise QdqConfigError(f"OpenVINO cannot run {self.path.name}: {_last_line(err)}") from None
        return [np.array(result[port]) for port in compiled.outputs]

    def _for_shapes(self, feed: dict[str, np.ndarray]) -> tuple[Any, Any]:
        """The compiled model and request for the feed's shapes: static ones where the model is dynamic."""
        if self._model is None or self._compile_static is None:
            return self.compiled, self._request
        key = tuple(tuple(feed[port.get_any_name()].shape) for port in self._model.inputs)
        if key in self._static:
            self._static.move_to_end(key)
            return self._static[key]
        static = self._model.clone()
        try:
            static.reshape({port.get_any_name(): list(shape) for port, shape in zip(static.inputs, key)})
            compiled = self._compile_static(static)
        except RuntimeError as err:
            raise QdqConfigError(f"OpenVINO cannot run {self.path.name} on inputs of shapes {list(key)}: "
                                 f"{_last_line(err)}") from None  # fmt: skip
        self._static[key] = (compiled, compiled.create_infer_request())
        if len(self._static) > STATIC_SHAPES_KEPT:
            self._static.popitem(last=False)
        return self._static[key]

    def _release(self) -> None:
        self._request = None
        self.compiled = None
        self._static.clear()
        self._model = None


def precision_report(
    onnx_path: str | Path,
    *,
    precision: str | None = "f32",
    threads: int | None = None,
    batch: int | None = None,
    uint8_weights: bool | None = None,
) -> PrecisionReport:
    """Compile ``onnx_path`` with OpenVINO (options as :meth:`OpenVinoRuntime.load`) and return the runtime
    precision of each layer."""
    with OpenVinoRuntime.load(
        onnx_path, precision=precision, threads=threads, batch=batch, uint8_weights=uint8_weights
    ) as runtime:
        return runtime.precision_report()


def _read_model(core: openvino.Core, path: Path, uint8_weights: bool | None) -> tuple[openvino.Model, int]:
    """Read ``path``, with its saturating int8 weights as uint8 where asked or needed (a temporary copy); and how
    many weights were re-encoded."""
    safe, count = saturation_safe_model(path, uint8_weights, OPENVINO_RUNTIME)
    if safe is None:
        return core.read_model(str(path)), 0
    if uint8_weights is None:
        warnings.warn(
            QdqRuntimeWarning(
                f"{path.name}: {count} int8 weight(s) have more than 64 levels, which this CPU's int8 kernels (x86 "
                "without VNNI) saturate on; OpenVINO runs those layers in float to stay exact. Quantize weights to "
                "7 bits (weight_bits=7) to keep them in int8 on this CPU, or pass uint8_weights=False to run them "
                "as they are.",
                file=path.name,
                kind="int8 weights run in float: saturating kernels",
            ),
            stacklevel=3,
        )
    with tempfile.TemporaryDirectory(prefix="qdq-ov-") as tmp:
        copy = Path(tmp) / path.name
        copy.write_bytes(safe.SerializeToString())
        return core.read_model(str(copy)), count


def _compile_config(threads: int | None, precision: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision_hint(precision)
    return config


def _fix_batch(model: openvino.Model, batch: int) -> None:
    """Set a dynamic leading dimension of every input to ``batch`` (static shapes compile faster)."""
    ov = _ov()
    shapes = {}
    for port in model.inputs:
        shape = port.get_partial_shape()
        if shape.rank.is_static and shape.rank.get_length() > 0 and shape[0].is_dynamic:
            shape[0] = ov.Dimension(batch)
            shapes[port.get_any_name()] = shape
    if shapes:
        model.reshape(shapes)


def _layer(op: openvino.Node) -> LayerPrecision:
    info = op.get_rt_info()

    def read(key: str) -> str:
        return str(info[key].astype(str)) if key in info else "?"

    return LayerPrecision(op.get_friendly_name(), read("layerType"), read("runtimePrecision"))


def _last_line(err: BaseException) -> str:
    # OpenVINO prefixes the message with "Exception from src/...:NN:" lines; the cause comes last.
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else first_line(err)
