"""Pass 8, dense layers: ``MatMul(x, DQ(W [K, N])) [+ constant bias]`` with a 2-D ``x`` (how Keras writes Dense)
becomes ``Gemm(x, DQ(W.T), bias, transB=1)``, ORT's ``QGemm`` pattern (pass 5 then makes its bias int32). The
same product; the transposed weight keeps its integers and scales."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute, set_axis
from qdq.targets.onnxruntime.passes._graph import ranks

if TYPE_CHECKING:
    import onnx

__all__ = ["matmuls_to_gemm"]

def _inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every tensor ONNX shape inference can tell (on a copy; the model keeps its value_info)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return {}
    return ranks(GraphIndex(inferred))


def _dense_weight(g: GraphIndex, matmul: Any) -> tuple[Any, np.ndarray] | None:
    """The DQ of a 2-D int8 constant ``[K, N]`` read only by ``matmul`` (per tensor or per column N), and it."""
    dq = g.producer.get(matmul.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or g.single_reader(dq.output[0]) is not matmul:
        return None
    w, scale = g.const_input(dq, 0), g.const_input(dq, 1)
    if w is None or scale is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8):
        return None
    if scale.ndim == 1 and attribute(dq, "axis", 1) % 2 != 1:
        return None
    return dq, w


def _bias_add(g: GraphIndex, matmul: Any, columns: int) -> tuple[Any, str] | None:
    """The ``Add`` of a constant ``[N]`` bias that alone reads ``matmul``'s output, and the bias's name."""
    add = g.single_reader(matmul.output[0])
    if add is None or add.op_type != "Add":
        return None
    other = [name for name in add.input if name != matmul.output[0]]
    bias = g.array(other[0]) if len(other) == 1 else None
    return (add, other[0]) if bias is not None and bias.shape == (columns,) else None


def matmuls_to_gemm(model: onnx.ModelProto, g: GraphIndex) -> int:
    """``MatMul(x, DQ(W [K, N])) [+ bias]`` with a 2-D ``x`` becomes ``Gemm(x, DQ(W.T), bias, transB=1)``.

    The same product, written as ORT's QGemm pattern (Keras Dense layers export as MatMul + Add; QGemm takes
    a float output where no Q follows, like the classifier). The transposed weight keeps its integers, and its
    per-column scales move to axis 0.
    """
    from onnx import helper

    matmuls = [n for n in g.graph.node if n.op_type == "MatMul"]
    known = _inferred_ranks(model) if matmuls else {}
    done = []
    for matmul in matmuls:
        found = _dense_weight(g, matmul) if known.get(matmul.input[0]) == 2 else None
        if found is None:
            continue
        dq, w = found
        dq.input[0] = g.add_const(dq.input[0] + "_transposed", np.ascontiguousarray(w.T))
        if g.array(dq.input[1]).ndim == 1:  # type: ignore[union-attr]
            set_axis(dq, 0)
        inputs, output = [matmul.input[0], dq.output[0]], matmul.output[0]
        bias = _bias_add(g, matmul, w.shape[1])
        if bias is not None:
            inputs.append(bias[1])
            output = bias[0].output[0]
            done.append(bias[0])
        gemm = helper.make_node("Gemm", inputs, [output], name=(matmul.name or "matmul") + "/Gemm", transB=1)
        g.insert(matmul, gemm)
        done.append(matmul)
    g.remove(done)
    return len(done) - sum(n.op_type == "Add" for n in done)
