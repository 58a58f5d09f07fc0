"""The last pass, shapes: the rewritten graph's value types and shapes recorded again, with symbolic dimensions.

The rewrite retypes tensors (int8 -> uint8), so the exporter's ``value_info`` is dropped. ONNX shape
inference would give every unknown dimension a fresh name (``unk__39``), and ONNX Runtime's transformer fusions
compare dimensions by name: ``SkipLayerNormalization`` (residual add + LayerNorm) forms only when both add inputs
are ``[batch, sequence, hidden]`` under the same names. ONNX Runtime's symbolic shape inference
(``onnxruntime.tools.symbolic_shape_infer``, which knows its contrib ops and merges equal dimensions) keeps
the input's names through the graph. Where it cannot infer a graph, no ``value_info`` is written (ONNX Runtime
infers types itself, only without those fusions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["record_symbolic_shapes"]


def record_symbolic_shapes(model: onnx.ModelProto) -> int:
    """Replace ``model``'s value_info by ONNX Runtime's symbolic inference; returns the tensors recorded."""
    del model.graph.value_info[:]  # stale types (int8 -> uint8)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception:  # an optional hint: whatever fails, ORT infers the types itself
        return 0
    if inferred is None:
        return 0
    model.graph.value_info.extend(inferred.graph.value_info)
    return len(model.graph.value_info)
