"""Pass 8, dense layers: ``MatMul(x, W) [+ constant bias]`` with a dequantized constant weight becomes
``Gemm(x, DQ(W [N, K]), bias, transB=1)``, ORT's ``QGemm`` pattern (pass 5 then makes its bias int32).

* A 2-D ``x`` (how Keras writes Dense): ``MatMul(x, DQ(W [K, N]))``; the weight is stored transposed.
* An N-D ``x = DQ(Q(t))`` (a transformer's Linear on ``[batch, sequence, K]``, which torch exports as
  ``MatMul(x, Transpose(DQ(W [N, K])))``): ``x`` is reshaped to ``[-1, K]`` and the Gemm's output back to
  ``t``'s leading dimensions and ``N``. ONNX Runtime moves the input's DequantizeLinear past the Reshape
  (the Reshape then moves int8 data) and fuses ``QGemm``: the bias is added in the int8 kernel (as int32) and a
  following QuantizeLinear is folded into its output, where ``MatMulIntegerToFloat`` (what ``DQ -> MatMul``
  becomes) leaves a float bias ``Add`` and a standalone QuantizeLinear. The input's Q/DQ pair is not touched.
  Left as a MatMul where ``t`` is a layout op's output read only by the Q (the attention context): reading
  its shape would keep ORT from moving that Q back into the attention's ``QLinearMatMul`` (the output is float
  there anyway: a residual add reads it).

The same product; the weight keeps its integers and scales (per-column scales move to axis 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute, set_axis
from qdq.graphs.onnx_types import default_opset
from qdq.targets.onnxruntime.passes._graph import ranks

if TYPE_CHECKING:
    import onnx

__all__ = ["matmuls_to_gemm"]

#: the first opset whose Shape takes ``start`` / ``end`` (the N-D form reads x's leading dimensions with it)
_SHAPE_SLICE_OPSET = 15


def _inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every tensor ONNX shape inference can tell (on a copy; the model keeps its value_info)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return {}
    return ranks(GraphIndex(inferred))


def _int8_weight_dq(g: GraphIndex, tensor: str, reader: Any) -> tuple[Any, np.ndarray, np.ndarray] | None:
    """The DQ of a 2-D int8 constant producing ``tensor``, read only by ``reader``, the constant and the DQ's
    (constant) scale."""
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear" or g.single_reader(dq.output[0]) is not reader:
        return None
    w, scale = g.const_input(dq, 0), g.const_input(dq, 1)
    if w is None or scale is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8):
        return None
    return dq, w, scale


def _dense_weight(g: GraphIndex, matmul: Any) -> tuple[Any, np.ndarray, np.ndarray, bool] | None:
    """``(DQ, integers, scale, stored_transposed)`` of ``matmul``'s weight, per tensor or per output column N:
    ``DQ(W [K, N])`` (stored_transposed False) or ``Transpose(DQ(W [N, K]))`` (True)."""
    found = _int8_weight_dq(g, matmul.input[1], matmul)
    if found is not None:
        dq, w, scale = found
        per_column = attribute(dq, "axis", 1) % 2 == 1
        return (dq, w, scale, False) if scale.ndim == 0 or per_column else None
    transpose = g.producer.get(matmul.input[1])
    if transpose is None or transpose.op_type != "Transpose" or g.single_reader(transpose.output[0]) is not matmul:
        return None
    if list(attribute(transpose, "perm", [1, 0])) != [1, 0]:
        return None
    found = _int8_weight_dq(g, transpose.input[0], transpose)
    if found is None:
        return None
    dq, w, scale = found
    per_row = attribute(dq, "axis", 1) % 2 == 0
    return (dq, w, scale, True) if scale.ndim == 0 or per_row else None


def _bias_add(g: GraphIndex, matmul: Any, columns: int) -> tuple[Any, str] | None:
    """The ``Add`` of a constant ``[N]`` bias that alone reads ``matmul``'s output, and the bias's name."""
    add = g.single_reader(matmul.output[0])
    if add is None or add.op_type != "Add":
        return None
    other = [name for name in add.input if name != matmul.output[0]]
    bias = g.array(other[0]) if len(other) == 1 else None
    return (add, other[0]) if bias is not None and bias.shape == (columns,) else None


def _leading_shape_source(g: GraphIndex, tensor: str) -> str | None:
    """A float tensor of ``tensor``'s shape whose leading dimensions the N-D form can read without stopping a
    fusion, or None. ``tensor`` must be ``DQ(Q(x))``: reading ``Q(x)`` or ``DQ(Q(x))`` would keep that pair
    from moving past the Reshape into ``QGemm``; reading ``x`` is free where ``x`` is not a layout op's output
    read by the Q alone (there ORT moves the Q back into the int8 kernel before it: the attention context)."""
    dq = g.producer.get(tensor)
    q = g.producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if q is None or q.op_type != "QuantizeLinear":
        return None
    source = g.producer.get(q.input[0])
    moves_data = source is not None and source.op_type in ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
    return None if moves_data and len(g.consumers.get(q.input[0], [])) == 1 else q.input[0]


def matmuls_to_gemm(model: onnx.ModelProto, g: GraphIndex) -> int:
    """``MatMul(x, W) [+ bias]`` by a dequantized constant weight becomes a ``Gemm`` (see the module doc)."""
    from onnx import helper

    matmuls = [n for n in g.graph.node if n.op_type == "MatMul"]
    known = _inferred_ranks(model) if matmuls else {}
    reshape_ok = default_opset(model) >= _SHAPE_SLICE_OPSET
    done, converted = [], 0
    for matmul in matmuls:
        rank = known.get(matmul.input[0])
        lead_from = _leading_shape_source(g, matmul.input[0]) if rank is not None and rank > 2 else None
        found = _dense_weight(g, matmul) if rank == 2 or (lead_from is not None and reshape_ok) else None
        if found is None:
            continue
        dq, w, scale, stored_transposed = found
        if stored_transposed:
            done.append(g.producer[matmul.input[1]])  # the Transpose: Gemm's transB reads W [N, K] as it is
        else:
            g.set_input(dq, 0, g.add_const(dq.input[0] + "_transposed", np.ascontiguousarray(w.T)))
            if scale.ndim == 1:
                set_axis(dq, 0)
        rows, columns = (w.shape[1], w.shape[0]) if stored_transposed else w.shape
        x, output = matmul.input[0], matmul.output[0]
        bias = _bias_add(g, matmul, columns)
        if bias is not None:
            output = bias[0].output[0]
            done.append(bias[0])
        name = matmul.name or "matmul"
        nodes = []
        if lead_from is not None:  # rank > 2 (found: with the source of x's leading dimensions)
            flat = g.unique(x + "_2d")
            nodes.append(helper.make_node("Reshape", [x, g.add_const(name + "_rows", np.array([-1, rows]))],
                                          [flat], name=name + "/Reshape_2d"))  # fmt: skip
            x, gemm_out = flat, g.unique(output + "_2d")
        else:
            gemm_out = output
        inputs = [x, dq.output[0]] + ([bias[1]] if bias is not None else [])
        nodes.append(helper.make_node("Gemm", inputs, [gemm_out], name=name + "/Gemm", transB=1))
        if lead_from is not None:
            lead, shape = g.unique(output + "_leading"), g.unique(output + "_shape")
            last = g.add_const(name + "_columns", np.array([columns]))
            nodes += [
                helper.make_node("Shape", [lead_from], [lead], name=name + "/Shape", start=0, end=-1),
                helper.make_node("Concat", [lead, last], [shape], name=name + "/Concat", axis=0),
                helper.make_node("Reshape", [gemm_out, shape], [output], name=name + "/Reshape_back"),
            ]
        for new in nodes:
            g.insert(matmul, new)
        done.append(matmul)
        converted += 1
    g.remove(done)
    return converted
