"""The OpenVINO backend (registered as ``"openvino"``, alias ``"ov"``): models compiled by OpenVINO's CPU plugin,
their per-layer runtime precision, and the int8 coverage read from it.

* :mod:`.compiled`: :class:`OpenVinoRuntime` (a compiled model, static shapes per input shape),
  :func:`precision_report`, :func:`supported_precisions`, :func:`precision_hint`;
* :mod:`.precision`: :class:`PrecisionReport`: the execution precision of every layer of the runtime graph;
* :data:`BACKEND`: the :class:`~qdq.runtime.Backend` the registry resolves ``"openvino"`` to: its ``precision``
  option (``f32`` by default: a true FP32 baseline; ``bf16`` / ``f16``), the bf16 reference row ``qdq bench``
  adds where the CPU computes bf16, and what is known about where it departs from PyTorch.

``openvino`` is imported when a model is first compiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qdq.runtime.backend import Backend
from qdq.runtime.coverage import Coverage, FloatLayer
from qdq.runtime.model_info import load_onnx
from qdq.runtime.openvino.compiled import (
    PRECISION_HINTS,
    STATIC_SHAPES_KEPT,
    OpenVinoRuntime,
    precision_hint,
    precision_report,
    supported_precisions,
)
from qdq.runtime.openvino.precision import (
    COMPUTE_LAYER_TYPES,
    INT8_PRECISIONS,
    LayerPrecision,
    PrecisionReport,
)
from qdq.runtime.saturation import weight_encoding
from qdq.runtime_registry import OPENVINO_RUNTIME

__all__ = [
    "BACKEND",
    "COMPUTE_LAYER_TYPES",
    "DIVERGENCE_CAUSES",
    "ELEMENTWISE_LAYER_TYPES",
    "INT8_PRECISIONS",
    "PRECISION_HINTS",
    "REENCODED_REASON",
    "STATIC_SHAPES_KEPT",
    "LayerPrecision",
    "OpenVinoBackend",
    "OpenVinoRuntime",
    "PrecisionReport",
    "precision_hint",
    "precision_report",
    "supported_precisions",
]

#: OpenVINO CPU layer types of fused elementwise work (its JIT "snippets" and eltwise chains)
ELEMENTWISE_LAYER_TYPES = ("Subgraph", "Eltwise")

#: why a weighted layer runs in float when the file's int8 weights are stored as uint8 (re-encoded at load on a CPU
#: whose int8 dot products saturate, or by the export for such a CPU): OpenVINO has no u8-weight int8 kernel
REENCODED_REASON = "no VNNI: int8 weights re-encoded as uint8 (exact) run in float on OpenVINO"

#: known causes of a departure from PyTorch, by the op type feeding the first quantizer that departs (measured;
#: README, "Fidelity of the INT8 engines")
DIVERGENCE_CAUSES = {
    "Add": (
        "OpenVINO fuses this residual Add into the convolution before it (a sum post-op) and then does not round "
        "that convolution's output to its quantizer's grid: the engine equals the graph without that Q/DQ pair "
        "bit for bit. Half a step of that quantizer moves the codes after the Add; at 4-bit activations a "
        "step is coarse enough to change the class of some images"
    ),
}


class OpenVinoBackend(Backend):
    """OpenVINO's CPU plugin: its coverage and report are the runtime precision of each compiled layer."""

    def __init__(self) -> None:
        super().__init__(
            OPENVINO_RUNTIME.name, OpenVinoRuntime, package="openvino", install="pip install openvino",
            description="OpenVINO, CPU plugin (convolutions in u8)", precisions=tuple(PRECISION_HINTS),
            divergence_causes=DIVERGENCE_CAUSES,
        )  # fmt: skip

    def int8_coverage(  # type: ignore[override]  # its runtime's load options by name; the base takes any
        self,
        onnx_path: str | Path,
        *,
        threads: int | None = None,
        batch: int | None = None,
        precision: str | None = "f32",
        uint8_weights: bool | None = None,
    ) -> Coverage:
        """OpenVINO's int8 coverage of ``onnx_path`` (options as :meth:`OpenVinoRuntime.load`): its compute layers
        executing in u8/i8, those in float (OpenVINO records no reason; where the weights are uint8, re-encoded at
        load or by the export, that is why: :data:`REENCODED_REASON`), and its elementwise layers run in float as
        the float work between."""
        with OpenVinoRuntime.load(onnx_path, threads=threads, batch=batch, precision=precision,
                                  uint8_weights=uint8_weights) as runtime:  # fmt: skip
            report, reencoded = runtime.precision_report(), runtime.reencoded_weights
        encoding = weight_encoding(OPENVINO_RUNTIME)
        uint8 = reencoded > 0 or (encoding is not None and encoding.recorded(load_onnx(onnx_path)) == "uint8")
        floats = tuple(
            FloatLayer(layer.name, layer.layer_type, REENCODED_REASON if uint8 else
                       f"OpenVINO's CPU plugin runs it in {layer.precision} (its runtime graph records no reason)")
            for layer in report.float_compute_layers
        )  # fmt: skip
        elementwise = [x for x in report.layers
                       if x.layer_type in ELEMENTWISE_LAYER_TYPES and x.precision not in INT8_PRECISIONS]  # fmt: skip
        return Coverage(runtime=self.name, model=report.model, int8=len(report.compute_layers) - len(floats),
                        float_layers=floats, float_between=len(elementwise),
                        float_between_what="elementwise layers run in float between the int8 ones")  # fmt: skip

    def report(
        self, onnx_path: str | Path, *, threads: int | None = None, batch: int | None = None, **options: Any
    ) -> PrecisionReport:
        """The runtime precision of every layer of ``onnx_path`` compiled at ``batch`` (options: ``precision``...)."""
        return precision_report(onnx_path, threads=threads, batch=batch, **options)

    def check_precision(self, precision: str) -> None:
        """Raise ``QdqConfigError`` naming the accepted values unless ``precision`` is one (:func:`precision_hint`)."""
        precision_hint(precision)

    def reference_variants(self) -> tuple[dict[str, object], ...]:
        """An FP32 reference runs at f32, and at bf16 too where this CPU computes bf16."""
        rows: tuple[dict[str, object], ...] = ({"precision": "f32"},)
        return rows + (({"precision": "bf16"},) if "bf16" in supported_precisions() else ())


#: the backend of the ``"openvino"`` runtime
BACKEND = OpenVinoBackend()
