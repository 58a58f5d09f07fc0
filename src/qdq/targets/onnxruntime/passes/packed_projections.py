"""Packed projections: a Linear whose output is cut into parts that are each quantized on their own (timm's packed
``qkv``: one ``[3·H·D, C]`` weight, the output reshaped to ``[..., 3, H, D]``, permuted and unbound into Q, K and
V, each read by its own quantizer) becomes one ``Gemm`` per part.

Exported, the packed form is ``Gemm -> Reshape -> Transpose -> Slice -> Squeeze -> Q`` per part: ONNX Runtime runs
the ``Gemm`` with a float output (its quantizers come after the cut, in three scales), ``Split`` moves the
float output and each part gets a standalone ``QuantizeLinear``. One ``Gemm`` per part, on the weight rows (and
bias entries) of that part, is followed by its own quantizer: ORT folds each Q into its ``QGemm`` (``DQ -> Gemm
-> Q``; the Q moves back through the Reshape and Transpose), and the cut, the float ``Split`` and the three
standalone Qs are gone. The same numbers: each output column of a Linear is computed from its own weight row and
bias entry (per-row weight scales are sliced with the rows), and the parts are the column blocks the ``Slice``
read; per-part, the Reshape and Transpose are the original ones without the cut axis.

Matched (after :mod:`.gemm`, whose ``Gemm`` reads a ``Reshape`` of ``DQ(Q(x))`` to ``[-1, K]`` and is reshaped back
to ``[..., N]``, and before :mod:`.biases`, while the bias is a float constant): a ``Gemm`` (``transB=1``, weight
``DQ`` of an int8 constant per tensor or per row) whose output reaches, through that reshape back, one ``Reshape``
to a constant shape ``[*leading, *parts]`` (no 0 in it; ``prod(parts) = N``) and one ``Transpose``, read only by
``Slice`` nodes, each taking one index of the axis that came from ``parts[0]`` and read by a ``Squeeze`` of that
axis, whose output only QuantizeLinear nodes read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.ir_graph import (
    add_const,
    attr,
    const_input,
    make_node,
    only_readers,
    readers,
    remove,
    single_reader,
    source,
)

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["split_packed_projections"]


def _only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    node = single_reader(value)
    return node if node is not None and node.op_type == op_type else None


def _reshaped_back(gemm: ir.Node) -> ir.Node | None:
    """The gemm pass's Reshape of ``gemm``'s 2-D output back to ``[..., N]`` (its shape a Concat it alone reads)."""
    back = _only_reader(gemm.outputs[0], "Reshape")
    concat = source(back.inputs[1]) if back is not None else None
    if concat is None or concat.op_type != "Concat" or single_reader(concat.outputs[0]) is not back:
        return None
    return back


def _slice_index(node: ir.Node, axis: int, length: int) -> int | None:
    """The one index ``node`` (a Slice) takes along ``axis`` (of size ``length``), else None."""
    if node.op_type != "Slice" or len(node.inputs) < 4:
        return None
    starts, ends, axes = (const_input(node, i) for i in (1, 2, 3))
    steps = const_input(node, 4) if len(node.inputs) > 4 and node.inputs[4] is not None else np.ones(1, np.int64)
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if any(v.size != 1 for v in (starts, ends, axes, steps)):
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    start = start + length if start < 0 else start
    if int(axes.reshape(-1)[0]) != axis or int(steps.reshape(-1)[0]) != 1 or not 0 <= start < length:
        return None
    return start if min(end, length) == start + 1 or (end < 0 and end + length == start + 1) else None


def _squeezed(node: ir.Node, axis: int) -> ir.Node | None:
    squeeze = _only_reader(node.outputs[0], "Squeeze")
    if squeeze is None or len(squeeze.inputs) < 2:
        return None
    axes = const_input(squeeze, 1)
    if axes is None or [int(a) for a in axes.reshape(-1)] != [axis]:
        return None
    return squeeze if only_readers(squeeze.outputs[0], ("QuantizeLinear",)) else None


#: a Gemm's weight: its DQ, W [N, K], scale, zero point
_Weight = tuple["ir.Node", np.ndarray, np.ndarray, np.ndarray]


def _weight(gemm: ir.Node) -> _Weight | None:
    """``(DQ, W [N, K], scale, zero point)`` of a ``transB=1`` Gemm's weight, per tensor or per row."""
    if attr(gemm, "transB", 0) != 1 or attr(gemm, "transA", 0) != 0:
        return None
    dq = source(gemm.inputs[1])
    if dq is None or dq.op_type != "DequantizeLinear" or single_reader(dq.outputs[0]) is not gemm:
        return None
    w, scale, zp = const_input(dq, 0), const_input(dq, 1), const_input(dq, 2)
    if w is None or scale is None or zp is None or w.ndim != 2:
        return None
    per_row = scale.ndim == 1 and scale.size == w.shape[0] and attr(dq, "axis", 1) == 0
    return (dq, w, scale, zp) if scale.size == 1 or per_row else None


def _parts(gemm: ir.Node, columns: int) -> dict[str, Any] | None:
    """The packed pattern after ``gemm`` (module doc): the nodes, the constant shape, perm, cut axis, branches."""
    back = _reshaped_back(gemm)
    if back is None:
        return None
    reshape = _only_reader(back.outputs[0], "Reshape")
    shape = const_input(reshape, 1) if reshape is not None else None
    transpose = _only_reader(reshape.outputs[0], "Transpose") if reshape is not None else None
    if shape is None or transpose is None or np.any(shape == 0):
        return None
    lead = len(shape) - next((n for n in range(1, len(shape) + 1) if np.prod(shape[-n:]) == columns), 0)
    parts = [int(d) for d in shape[lead:]]
    if lead == 0 or lead == len(shape) or np.prod(parts) != columns or min(parts) <= 0 or parts[0] < 2:
        return None
    perm = [int(p) for p in attr(transpose, "perm", [])]
    if sorted(perm) != list(range(len(shape))) or transpose.outputs[0].is_graph_output():
        return None
    cut = perm.index(lead)
    branches: dict[int, Any] = {}
    for node in readers(transpose.outputs[0]):
        index = _slice_index(node, cut, parts[0])
        squeeze = _squeezed(node, cut) if index is not None else None
        if index is None or squeeze is None or index in branches:
            return None
        branches[index] = (node, squeeze)
    if not branches:
        return None
    nodes = [back, source(back.inputs[1]), reshape, transpose]
    return {"shape": shape, "lead": lead, "parts": parts, "perm": perm, "branches": branches, "nodes": nodes}


def _part_nodes(
    graph: ir.Graph, gemm: ir.Node, weight_of: _Weight, found: dict[str, Any], index: int, out: ir.Value
) -> list[ir.Node]:
    """``Gemm`` of part ``index`` (its weight rows and bias entries), its Reshape and Transpose, whose output then
    replaces ``out``; ``weight_of``: the Gemm's weight (:func:`_weight`)."""
    dq, w, scale, zp = weight_of
    size = int(np.prod(found["parts"][1:]))
    rows = slice(index * size, (index + 1) * size)
    stem = f"{gemm.name or 'gemm'}/part{index}"
    per_row = scale.size > 1
    weight = [
        add_const(graph, f"{stem}/w", np.ascontiguousarray(w[rows])),
        add_const(graph, f"{stem}/w_scale", scale[rows]) if per_row else dq.inputs[1],
        add_const(graph, f"{stem}/w_zero_point", zp[rows]) if per_row else dq.inputs[2],
    ]
    new_dq = make_node(graph, "DequantizeLinear", weight, f"{stem}/weight", name=f"{stem}/weight", **dq.attributes)
    new_dq.metadata_props.update(dq.metadata_props)
    inputs = [gemm.inputs[0], new_dq.outputs[0]]
    bias = const_input(gemm, 2)
    if bias is not None:
        inputs.append(add_const(graph, f"{stem}/bias", bias.reshape(-1)[rows]))
    nodes = [new_dq, make_node(graph, "Gemm", inputs, f"{stem}_2d", name=stem, transB=1)]
    lead, shape = found["lead"], found["shape"]
    perm = [p - (p > lead) for p in found["perm"] if p != lead]
    target = add_const(graph, f"{stem}_shape", np.concatenate([shape[:lead], shape[lead + 1 :]]).astype(np.int64))
    nodes.append(make_node(graph, "Reshape", [nodes[-1].outputs[0], target], f"{stem}_shaped", name=f"{stem}/Reshape"))
    if perm != sorted(perm):
        nodes.append(
            make_node(graph, "Transpose", [nodes[-1].outputs[0]], f"{stem}_out", name=f"{stem}/Transpose", perm=perm)
        )
    out.replace_all_uses_with(nodes[-1].outputs[0])
    return nodes


def _split(graph: ir.Graph, gemm: ir.Node) -> bool:
    """Split ``gemm`` when it is a packed projection; whether it was."""
    weight = _weight(gemm)
    bias = const_input(gemm, 2) if len(gemm.inputs) > 2 and gemm.inputs[2] is not None else np.zeros(1, np.float32)
    found = _parts(gemm, weight[1].shape[0]) if weight is not None and bias is not None else None
    if weight is None or found is None:
        return False
    doomed = [gemm, weight[0], *found["nodes"]]
    for index, (slice_node, squeeze) in sorted(found["branches"].items()):
        graph.insert_before(gemm, _part_nodes(graph, gemm, weight, found, index, squeeze.outputs[0]))
        doomed += [slice_node, squeeze]
    concat = found["nodes"][1]
    shape_of = source(concat.inputs[0])  # the Shape feeding the reshape back's Concat
    if shape_of is not None and shape_of.op_type == "Shape" and single_reader(shape_of.outputs[0]) is concat:
        doomed.append(shape_of)
    remove(graph, doomed)
    return True


def split_packed_projections(graph: ir.Graph) -> int:
    """One ``Gemm`` per quantized part of each packed projection (module doc); returns how many were split."""
    return sum(_split(graph, gemm) for gemm in list(graph) if gemm.op_type == "Gemm")
