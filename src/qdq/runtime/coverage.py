"""What a runtime says about a file's int8 coverage: its weighted layers on int8 kernels, and those left float, each
with the reason.

Every backend reports in these terms (:meth:`qdq.runtime.Backend.int8_coverage`), read from what the runtime itself
made of the file: ONNX Runtime's optimized graph, OpenVINO's runtime precision per layer, TensorRT's strongly typed
network (which the graph's Q/DQ decide). A *weighted layer* is a Conv / ConvTranspose / Gemm / MatMul (OpenVINO:
Convolution, GroupConvolution, Deconvolution, FullyConnected, MatMul): where int8 pays.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from qdq.runtime._text import markdown_table

__all__ = ["Coverage", "FloatLayer"]


@dataclass(frozen=True)
class FloatLayer:
    """A weighted layer a runtime runs in float, and why (one sentence, as the runtime's report explains it)."""

    name: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class Coverage:
    """Which weighted layers of one file run on int8 kernels on one runtime.

    Attributes:
        runtime: the runtime's registered name.
        model: the file's name.
        int8: how many weighted layers run on int8 kernels.
        float_layers: the weighted layers left in float, each with its reason.
        float_between: a count of the float work the runtime leaves between its int8 kernels (ONNX Runtime:
            Q/DQ conversions; OpenVINO: elementwise layers run in float), or None when it reports none;
            ``float_between_what`` says what is counted.
    """

    runtime: str
    model: str
    int8: int
    float_layers: tuple[FloatLayer, ...] = ()
    float_between: int | None = None
    float_between_what: str = ""

    @property
    def n_float(self) -> int:
        """How many weighted layers run in float."""
        return len(self.float_layers)

    @property
    def total(self) -> int:
        """How many weighted layers the runtime runs (int8 and float)."""
        return self.int8 + self.n_float

    def reasons(self) -> dict[str, int]:
        """How many float layers each reason explains, the most frequent first."""
        return dict(Counter(layer.reason for layer in self.float_layers).most_common())

    @property
    def reason(self) -> str | None:
        """Why weighted layers run in float: the reason shared by most of them (None when none does)."""
        return next(iter(self.reasons()), None)

    def summary(self) -> str:
        """One line, e.g. ``"onnxruntime: 1 of 10 weighted layers on int8 kernels; 9 float: <reason>"``."""
        text = f"{self.runtime}: {self.int8} of {self.total} weighted layers on int8 kernels"
        if self.float_layers:
            others = len(self.reasons()) - 1
            more = f" (and {others} other reason{'s' if others > 1 else ''})" if others else ""
            text += f"; {self.n_float} float: {self.reason}{more}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The record a report keeps: ``int8_layers``, ``float_layers`` (counts), ``float_between``,
        ``float_between_what`` and ``fallback`` (:attr:`reason`)."""
        return {"int8_layers": self.int8, "float_layers": self.n_float, "float_between": self.float_between,
                "float_between_what": self.float_between_what or None, "fallback": self.reason}  # fmt: skip

    def to_markdown(self) -> str:
        """The summary line and a table of the float layers (one row per reason)."""
        lines = [f"int8 coverage of {self.model} on {self.summary()}"]
        if self.float_layers:
            rows = []
            for reason, count in self.reasons().items():
                names = [layer.name for layer in self.float_layers if layer.reason == reason]
                shown = ", ".join(names[:3]) + (f", … (+{len(names) - 3})" if len(names) > 3 else "")
                rows.append([reason, count, shown])
            lines += ["", markdown_table(["float because", "layers", "e.g."], rows)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()
