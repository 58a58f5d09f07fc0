"""Per-layer runtime precision of a model compiled by OpenVINO.

OpenVINO's CPU plugin turns a Q/DQ graph into its own layers and picks, per layer, the precision it
executes in; the compiled model's runtime graph records it in each node's ``rt_info``
(``layerType`` and ``runtimePrecision``). A Convolution that executes in ``u8``/``i8`` consumed the
quantized data; one in ``f32``/``bf16`` did not. :func:`qdq.runtime.openvino.precision_report` fills
a :class:`PrecisionReport` from a compiled model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from qdq.runtime._text import markdown_table

__all__ = ["COMPUTE_LAYER_TYPES", "INT8_PRECISIONS", "LayerPrecision", "PrecisionReport"]

COMPUTE_LAYER_TYPES = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")
"""OpenVINO CPU layer types that carry the weights (where int8 pays off)."""

INT8_PRECISIONS = frozenset({"u8", "i8"})


@dataclass(frozen=True)
class LayerPrecision:
    """One layer of the runtime graph: its name, OpenVINO layer type and execution precision."""

    name: str
    layer_type: str
    precision: str


@dataclass(frozen=True)
class PrecisionReport:
    """Runtime precision of every layer of a compiled model.

    ``inference_precision`` is the compiled model's ``INFERENCE_PRECISION_HINT`` ("f32", "bf16"...):
    the type OpenVINO computes non-quantized layers in.
    """

    model: str
    inference_precision: str
    layers: tuple[LayerPrecision, ...]

    def counts(self, layer_type: str = "Convolution") -> dict[str, int]:
        """How many layers of ``layer_type`` run at each precision, e.g. ``{"u8": 20}``."""
        return dict(Counter(layer.precision for layer in self.layers if layer.layer_type == layer_type))

    @property
    def compute_layers(self) -> tuple[LayerPrecision, ...]:
        """The layers whose type is in :data:`COMPUTE_LAYER_TYPES`."""
        return tuple(layer for layer in self.layers if layer.layer_type in COMPUTE_LAYER_TYPES)

    @property
    def float_compute_layers(self) -> tuple[LayerPrecision, ...]:
        """Compute layers that did not run at u8/i8."""
        return tuple(layer for layer in self.compute_layers if layer.precision not in INT8_PRECISIONS)

    def to_markdown(self) -> str:
        """A table of compute layer types by runtime precision, and the compute layers left in float."""
        present = [t for t in COMPUTE_LAYER_TYPES if self.counts(t)]
        precisions = sorted({layer.precision for layer in self.compute_layers})
        rows = []
        for layer_type in present:
            counts = self.counts(layer_type)
            rows.append([layer_type, *(counts.get(p, 0) for p in precisions), sum(counts.values())])
        lines = [
            f"OpenVINO runtime precision: {self.model} (inference precision {self.inference_precision})",
            "",
            markdown_table(["layer type", *precisions, "total"], rows or [["(none)", 0]]),
        ]
        floats = self.float_compute_layers
        if floats and len(floats) < len(self.compute_layers):
            shown = ", ".join(f"{layer.name} ({layer.precision})" for layer in floats[:10])
            more = f", … (+{len(floats) - 10})" if len(floats) > 10 else ""
            lines += ["", f"compute layers not in int8: {shown}{more}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()
