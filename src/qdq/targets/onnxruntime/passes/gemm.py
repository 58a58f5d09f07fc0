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

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import (
    add_const,
    attr,
    const,
    const_input,
    inferred_dims,
    make_node,
    readers,
    remove,
    single_reader,
    source,
    take_place,
)
from qdq.targets.onnxruntime.passes._graph import rank

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["matmuls_to_gemm"]

#: the first opset whose Shape takes ``start`` / ``end`` (the N-D form reads x's leading dimensions with it)
_SHAPE_SLICE_OPSET = 15

_Weight = tuple["ir.Node", np.ndarray, np.ndarray, "ir.Node | None"]


def _default_opset(graph: ir.Graph) -> int:
    """The version of the default ONNX domain ``graph`` imports (1 where it records none: a branch)."""
    return next((v for domain, v in graph.opset_imports.items() if domain in ("", "ai.onnx")), 1)


def _int8_weight_dq(value: ir.Value | None, reader: ir.Node) -> tuple[ir.Node, np.ndarray, np.ndarray] | None:
    """The DQ of a 2-D int8 constant producing ``value``, read only by ``reader``, the constant and the DQ's
    (constant) scale."""
    dq = source(value)
    if dq is None or dq.op_type != "DequantizeLinear" or single_reader(dq.outputs[0]) is not reader:
        return None
    w, scale = const_input(dq, 0), const_input(dq, 1)
    if w is None or scale is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8):
        return None
    return dq, w, scale


def _dense_weight(matmul: ir.Node) -> _Weight | None:
    """``(DQ, integers, scale, Transpose)`` of ``matmul``'s weight, per tensor or per output column N:
    ``DQ(W [K, N])`` (no Transpose: None) or ``Transpose(DQ(W [N, K]))`` (stored transposed)."""
    found = _int8_weight_dq(matmul.inputs[1], matmul)
    if found is not None:
        dq, w, scale = found
        per_column = attr(dq, "axis", 1) % 2 == 1
        return (dq, w, scale, None) if scale.ndim == 0 or per_column else None
    transpose = source(matmul.inputs[1])
    if transpose is None or transpose.op_type != "Transpose" or single_reader(transpose.outputs[0]) is not matmul:
        return None
    if list(attr(transpose, "perm", [1, 0])) != [1, 0]:
        return None
    found = _int8_weight_dq(transpose.inputs[0], transpose)
    if found is None:
        return None
    dq, w, scale = found
    per_row = attr(dq, "axis", 1) % 2 == 0
    return (dq, w, scale, transpose) if scale.ndim == 0 or per_row else None


def _bias_add(matmul: ir.Node, columns: int) -> tuple[ir.Node, ir.Value] | None:
    """The ``Add`` of a constant ``[N]`` bias that alone reads ``matmul``'s output, and the bias."""
    add = single_reader(matmul.outputs[0])
    if add is None or add.op_type != "Add":
        return None
    other = [v for v in add.inputs if v is not None and v is not matmul.outputs[0]]
    bias = const(other[0]) if len(other) == 1 else None
    return (add, other[0]) if bias is not None and bias.shape == (columns,) else None


def _leading_shape_source(value: ir.Value) -> ir.Value | None:
    """A float value of ``value``'s shape whose leading dimensions the N-D form can read without stopping a
    fusion, or None. ``value`` must be ``DQ(Q(x))``: reading ``Q(x)`` or ``DQ(Q(x))`` would keep that pair
    from moving past the Reshape into ``QGemm``; reading ``x`` is free where ``x`` is not a layout op's output
    read by the Q alone (there ORT moves the Q back into the int8 kernel before it: the attention context)."""
    dq = value.producer()
    q = source(dq.inputs[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    x = q.inputs[0] if q is not None and q.op_type == "QuantizeLinear" else None
    made = source(x)
    moves_data = made is not None and made.op_type in ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
    return None if x is None or (moves_data and len(readers(x)) == 1) else x


def matmuls_to_gemm(graph: ir.Graph, model: ir.Model) -> int:
    """``MatMul(x, W) [+ bias]`` by a dequantized constant weight becomes a ``Gemm`` (see the module doc), in
    ``graph``: ``model``'s main graph or one of its branches. Ranks come from ONNX shape inference on ``model`` for
    its main graph, from those recorded for a branch."""
    matmuls = [n for n in graph if n.op_type == "MatMul"]
    known = {name: len(d) for name, d in inferred_dims(model).items()} if matmuls and graph is model.graph else None
    reshape_ok = _default_opset(model.graph) >= _SHAPE_SLICE_OPSET
    converted = 0
    for matmul in matmuls:
        x = matmul.inputs[0]
        if x is None:
            continue
        x_rank = rank(x) if known is None else known.get(x.name or "")
        lead_from = _leading_shape_source(x) if x_rank is not None and x_rank > 2 else None
        found = _dense_weight(matmul) if x_rank == 2 or (lead_from is not None and reshape_ok) else None
        if found is not None:
            _to_gemm(graph, matmul, x, found, lead_from)
            converted += 1
    return converted


def _to_gemm(graph: ir.Graph, matmul: ir.Node, x: ir.Value, weight: _Weight, lead_from: ir.Value | None) -> None:
    """``matmul`` of ``x`` (and its bias Add) becomes a Gemm by ``weight`` [N, K]; with ``lead_from`` (rank > 2),
    between a Reshape to 2-D and one back to ``lead_from``'s leading dimensions."""
    import onnx_ir as ir

    dq, w, scale, transpose = weight
    done = [matmul] if transpose is None else [matmul, transpose]  # Gemm's transB reads W [N, K] as it is
    if transpose is None:
        dq.replace_input_with(0, add_const(graph, f"{dq.outputs[0].name}_transposed", np.ascontiguousarray(w.T)))
        dq.outputs[0].shape = None
        if scale.ndim == 1:
            dq.attributes["axis"] = ir.AttrInt64("axis", 0)
    rows, columns = w.shape if transpose is None else (w.shape[1], w.shape[0])
    output, bias = matmul.outputs[0], _bias_add(matmul, columns)
    if bias is not None:
        output = bias[0].outputs[0]
        done.append(bias[0])
    name = matmul.name or "matmul"
    stem = output.name or name
    nodes = []
    if lead_from is not None:
        rows_shape = add_const(graph, name + "_rows", np.array([-1, rows]))
        nodes.append(make_node(graph, "Reshape", [x, rows_shape], f"{x.name}_2d", name=name + "/Reshape_2d"))
        x = nodes[-1].outputs[0]
    inputs: list[ir.Value | None] = [x, dq.outputs[0], *([bias[1]] if bias is not None else [])]
    nodes.append(make_node(graph, "Gemm", inputs, f"{stem}_2d", name=name + "/Gemm", transB=1))
    if lead_from is not None:
        gemm, last = nodes[-1], add_const(graph, name + "_columns", np.array([columns]))
        lead = make_node(graph, "Shape", [lead_from], f"{stem}_leading", name=name + "/Shape", start=0, end=-1)
        shape = make_node(graph, "Concat", [lead.outputs[0], last], f"{stem}_shape", name=name + "/Concat", axis=0)
        back = make_node(graph, "Reshape", [gemm.outputs[0], shape.outputs[0]], stem, name=name + "/Reshape_back")
        nodes += [lead, shape, back]
    graph.insert_before(matmul, nodes)
    take_place(output, nodes[-1].outputs[0])
    remove(graph, done)
