"""Running int8 weights exactly on CPUs whose int8 dot products saturate (x86 without VNNI, :mod:`qdq.cpu`).

There, ONNX Runtime's U8S8 kernels and OpenVINO's int8 convolutions add pairs of ``u8 * s8`` products in int16
with saturation, and a weight of more than 64 levels can make them silently compute something else (seen on an
AVX2 EPYC, far off on both runtimes: benchmarks/RESULTS.md, code_figures). Before a backend compiles a model
on such a CPU, :func:`saturation_safe_model` re-encodes those weights as uint8 with zero point 128 (the
:class:`~qdq.targets.WeightEncoding` of a target made for the runtime: the ``"onnxruntime"`` target's, whose
export writes the same encoding when asked): the same dequantized values. ONNX Runtime runs them in its U8U8
kernels (int8 still, exact, somewhat slower); OpenVINO has no u8-weight int8 kernel and runs those layers in
float (exact, without the int8 speed-up). Weights of at most 64 levels (``weight_bits <= 7``) stay int8 and
run in the fast kernels, exactly, on both.

The export decides the encoding once and records it in the file (``qdq.weights``); a file that records
``"uint8"`` is loaded as it is. A file that records ``"int8"``, or says nothing (one qdq did not write), is
re-encoded in memory where this CPU saturates: the user who loads a foreign int8 file stays protected.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from qdq import cpu
from qdq.errors import QdqRuntimeWarning
from qdq.graphs import onnx_types
from qdq.runtime.model_info import load_onnx
from qdq.runtime_registry import RuntimeEntry
from qdq.targets import WeightEncoding
from qdq.targets.registry import native_fact

if TYPE_CHECKING:
    import onnx

__all__ = ["needs_uint8_weights", "saturation_safe_model", "weight_encoding"]


def needs_uint8_weights(uint8_weights: bool | None) -> bool:
    """``uint8_weights``, or when None, whether this CPU's int8 dot products saturate."""
    return cpu.int8_dot_saturates() if uint8_weights is None else bool(uint8_weights)


def weight_encoding(runtime: str | RuntimeEntry) -> WeightEncoding | None:
    """The uint8 weight encoding recorded by a registered target made for ``runtime`` (None: no target records one)."""
    return native_fact(runtime, lambda target: target.weight_encoding)


def saturation_safe_model(
    path: str | Path, uint8_weights: bool | None, runtime: str | RuntimeEntry
) -> tuple[onnx.ModelProto | None, int]:
    """The model at ``path`` with its saturating int8 weights stored as uint8, and how many were; ``(None,
    0)`` when the file runs as it is (nothing to re-encode, not asked to, no target made for ``runtime`` records a
    weight encoding, or over protobuf's 2 GB limit).

    Args:
        path: an ONNX file.
        uint8_weights: True: re-encode; False: never; None: when this CPU saturates, unless the file records
            uint8 weights.
        runtime: the runtime that will compile it (its targets' :func:`weight_encoding` is used).
    """
    encoding = weight_encoding(runtime)
    if encoding is None or not needs_uint8_weights(uint8_weights):
        return None, 0
    model = load_onnx(path, external_data=True)
    if uint8_weights is None and encoding.recorded(model) == "uint8":
        return None, 0  # the export stored them as uint8 already
    count = encoding.to_uint8(model)
    if count == 0:
        return None, 0
    if model.ByteSize() >= onnx_types.PROTOBUF_LIMIT:  # cannot be serialized in one piece
        warnings.warn(
            QdqRuntimeWarning(
                f"{Path(path).name} is over 2 GB, so its {count} saturating int8 weights are not re-encoded as "
                "uint8 in memory, and this CPU's int8 kernels may saturate on them. Export it re-encoded instead: "
                "export_onnx(..., target_options={'weights': 'uint8'}).",
                file=Path(path).name,
                kind="int8 weights not re-encoded: over 2 GB",
            ),
            stacklevel=3,
        )
        return None, 0
    return model, count
