"""Pass 9, the weight encoding, for CPUs whose int8 dot products saturate.

On x86 without VNNI, ORT's U8S8 kernels add pairs of ``u8 * s8`` products in int16 with saturation and silently
compute something else (:mod:`qdq.cpu`). With ``weights="uint8"`` every int8 weight whose integers leave
``[-64, 64]`` is stored as uint8 with zero point 128: the same dequantized values, run by ORT's U8U8 kernels,
which widen to int16 first and are exact. (ORT's own quantizer offers ``reduce_range``, 7-bit weights,
instead: a different model from the one trained.) The export records the encoding in the file
(:data:`WEIGHTS_METADATA_KEY`); :mod:`qdq.runtime` re-encodes in memory only a file that does not say
``"uint8"``, on a CPU that saturates."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.errors import QdqConfigError
from qdq.graphs.ir_graph import (
    add_const,
    attr,
    const,
    const_input,
    graphs_of,
    name_of,
    readers,
    readers_through,
    source,
    tidy,
)
from qdq.targets.onnxruntime.passes._graph import quantize_weight

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "WEIGHTS_METADATA_KEY",
    "WEIGHT_ENCODINGS",
    "encode_weights_uint8",
    "recorded_weights",
    "resolve_weights",
    "weights_to_uint8",
]

#: model metadata key recording how the export stored the weights (``"int8"`` or ``"uint8"``)
WEIGHTS_METADATA_KEY = "qdq.weights"
_LEGACY_KEYS = ("qdq.ort_weights",)  # what files of earlier qdq versions record


def recorded_weights(model: onnx.ModelProto) -> str | None:
    """The weight encoding the file records (``"int8"``, ``"uint8"``), or None (not a qdq file, or none said)."""
    found = {p.key: p.value for p in model.metadata_props}
    return next((found[key] for key in (WEIGHTS_METADATA_KEY, *_LEGACY_KEYS) if key in found), None)


#: the ``weights`` option of :func:`rewrite_for_onnxruntime`
WEIGHT_ENCODINGS = ("auto", "int8", "uint8")


#: ops whose constant input ORT multiplies as an int8 weight (QLinearConv, QGemm, QLinearMatMul)
_WEIGHT_READERS = frozenset({"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"})
_LAYOUT_OPS = frozenset({"Transpose", "Reshape"})


def _as_uint8(values: np.ndarray) -> np.ndarray:
    """int8 -> uint8 with the zero point moved by 128: ``q_u8 - zp_u8 == q_s8 - zp_s8`` for every value."""
    return (values.astype(np.int16) + 128).astype(np.uint8)


def _weight_reader_only(dq: ir.Node) -> bool:
    """Every reader of the DQ's output is a weighted op, looking through layout ops (the dynamo exporter writes
    a Linear on a 3-D input as ``DQ -> Transpose -> MatMul``, which ORT folds into one int8 weight)."""
    found = readers_through(dq.outputs[0], _LAYOUT_OPS)
    return bool(found) and all(r is not None and r.op_type in _WEIGHT_READERS for r in found)


def _int8_zero_point(node: ir.Node, shape: tuple[int, ...]) -> np.ndarray | None:
    """The node's int8 zero point (an omitted one is 0), or None when it is not a constant int8."""
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return np.zeros(shape, np.int8)
    zp = const_input(node, 2)
    return zp if zp is not None and zp.dtype == np.int8 else None


def _set_zero_point(node: ir.Node, value: ir.Value) -> None:
    if len(node.inputs) < 3:
        node.resize_inputs(3)
    node.replace_input_with(2, value)


def _stored_weights(dq: ir.Node) -> tuple[np.ndarray, ir.Node | None] | None:
    """The int8 integers a weight DQ reads, and the QuantizeLinear making them (None: a stored initializer)."""
    values = const(dq.inputs[0])
    if values is not None:
        return (values, None) if values.dtype == np.int8 else None
    q = source(dq.inputs[0])
    if q is None or q.op_type != "QuantizeLinear":
        return None
    w, scale = const_input(q, 0), const_input(q, 1)
    zp = _int8_zero_point(q, np.shape(scale)) if w is not None and scale is not None else None
    if w is None or scale is None or zp is None or np.any(zp != 0) or len(readers(q.outputs[0])) != 1:
        return None
    return quantize_weight(w, scale, np.dtype(np.int8), attr(q, "axis", 1)), q


def encode_weights_uint8(model: onnx.ModelProto, *, only_saturating: bool = True) -> int:
    """Re-encode the int8 weights of Conv / Gemm / MatMul as uint8 with zero point + 128, in place.

    The dequantized weights are bit for bit the same; ONNX Runtime then runs its U8U8 kernels, which never
    saturate, instead of the U8S8 ones, which saturate on x86 CPUs without VNNI (:mod:`qdq.cpu`). With
    ``only_saturating`` (default) a weight whose integers all lie in ``[-64, 64]`` stays int8 (it cannot
    saturate, and U8S8 is faster): 4-bit weights, for example. Handles stored int8 initializers
    (``int8 -> DQ``, the onnxruntime target) and ``Q(float weight) -> DQ`` (the tensorrt target).

    Returns:
        The number of weights re-encoded.
    """
    from qdq.graphs.onnx import on_ir

    # constants behind Identity nodes (TorchScript's shared zero points) become visible
    return int(on_ir(model, tidy, lambda ir_model: weights_to_uint8(ir_model.graph, only_saturating), tidy)[1])


def weights_to_uint8(graph: ir.Graph, only_saturating: bool = True) -> int:
    """:func:`encode_weights_uint8` as a pass on ``graph`` and its ``If`` branches (each new constant in the graph of
    the DQ reading it; the weights no longer read left for a tidy)."""
    import onnx_ir as ir

    from qdq.cpu import SAFE_WEIGHT_MAGNITUDE

    count = 0
    for dq in [node for g in graphs_of(graph) for node in g]:
        if dq.op_type != "DequantizeLinear" or not _weight_reader_only(dq):
            continue
        found = _stored_weights(dq)
        scale = const_input(dq, 1)
        shape = () if scale is None else np.shape(scale)  # np.shape(None): ()
        zp = _int8_zero_point(dq, shape) if found is not None else None
        weight = dq.inputs[0]
        if found is None or zp is None or weight is None:
            continue
        values, q = found
        if only_saturating and np.abs(values.astype(np.int16)).max(initial=0) <= SAFE_WEIGHT_MAGNITUDE:
            continue
        given = dq.inputs[2] if len(dq.inputs) > 2 else None  # an omitted zero point is 0
        zero_point = add_const(dq.graph or graph, name_of(given, "zero_point") + "_u8w", _as_uint8(zp))
        if q is None:
            dq.replace_input_with(0, add_const(dq.graph or graph, f"{weight.name}_u8", _as_uint8(values)))
        else:
            _set_zero_point(q, zero_point)
            q.outputs[0].type = ir.TensorType(ir.DataType.UINT8)
        _set_zero_point(dq, zero_point)
        count += 1
    return count


def resolve_weights(weights: str) -> str:
    if weights not in WEIGHT_ENCODINGS:
        raise QdqConfigError(
            f"weights must be one of {WEIGHT_ENCODINGS}, got {weights!r}: 'int8' for the fastest kernels on CPUs "
            "with VNNI (and ARM), 'uint8' for exact results on every CPU, 'auto' for whichever this CPU needs."
        )
    if weights == "auto":
        from qdq.cpu import int8_dot_saturates

        return "uint8" if int8_dot_saturates() else "int8"
    return weights
