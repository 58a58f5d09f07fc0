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

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute

__all__ = ["split_packed_projections"]


def _only_reader(g: GraphIndex, tensor: str, op_type: str) -> Any | None:
    node = g.single_reader(tensor)
    return node if node is not None and node.op_type == op_type else None


def _reshaped_back(g: GraphIndex, gemm: Any) -> Any | None:
    """The gemm pass's Reshape of ``gemm``'s 2-D output back to ``[..., N]``, or ``gemm`` for a 2-D Gemm."""
    back = _only_reader(g, gemm.output[0], "Reshape")
    if back is None:
        return None
    concat = g.producer.get(back.input[1])
    return back if concat is not None and concat.op_type == "Concat" else None


def _slice_index(g: GraphIndex, node: Any, axis: int, length: int) -> int | None:
    """The one index ``node`` (a Slice) takes along ``axis`` (of size ``length``), else None."""
    if node.op_type != "Slice" or len(node.input) < 4:
        return None
    starts, ends, axes = (g.const_input(node, i) for i in (1, 2, 3))
    steps = g.const_input(node, 4) if len(node.input) > 4 and node.input[4] else np.ones(1, np.int64)
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if any(v.size != 1 for v in (starts, ends, axes, steps)):
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    start = start + length if start < 0 else start
    if int(axes.reshape(-1)[0]) != axis or int(steps.reshape(-1)[0]) != 1 or not 0 <= start < length:
        return None
    return start if min(end, length) == start + 1 or (end < 0 and end + length == start + 1) else None


def _squeezed(g: GraphIndex, node: Any, axis: int) -> Any | None:
    squeeze = _only_reader(g, node.output[0], "Squeeze")
    if squeeze is None or len(squeeze.input) < 2:
        return None
    axes = g.const_input(squeeze, 1)
    if axes is None or [int(a) for a in axes.reshape(-1)] != [axis]:
        return None
    return squeeze if g.only_readers(squeeze.output[0], ("QuantizeLinear",)) else None


#: a Gemm's weight: its DQ, W [N, K], scale, zero point
_Weight = tuple[Any, np.ndarray, np.ndarray, np.ndarray]


def _weight(g: GraphIndex, gemm: Any) -> _Weight | None:
    """``(DQ, W [N, K], scale, zero point)`` of a ``transB=1`` Gemm's weight, per tensor or per row."""
    if attribute(gemm, "transB", 0) != 1 or attribute(gemm, "transA", 0) != 0:
        return None
    dq = g.producer.get(gemm.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or g.single_reader(dq.output[0]) is not gemm:
        return None
    w, scale, zp = g.const_input(dq, 0), g.const_input(dq, 1), g.const_input(dq, 2)
    if w is None or scale is None or zp is None or w.ndim != 2:
        return None
    per_row = scale.ndim == 1 and scale.size == w.shape[0] and attribute(dq, "axis", 1) == 0
    return (dq, w, scale, zp) if scale.size == 1 or per_row else None


def _parts(g: GraphIndex, gemm: Any, columns: int) -> dict[str, Any] | None:
    """The packed pattern after ``gemm`` (module doc): the nodes, the constant shape, perm, cut axis, branches."""
    back = _reshaped_back(g, gemm)
    if back is None:
        return None
    reshape = _only_reader(g, back.output[0], "Reshape")
    shape = g.const_input(reshape, 1) if reshape is not None else None
    transpose = _only_reader(g, reshape.output[0], "Transpose") if reshape is not None else None
    if shape is None or transpose is None or np.any(shape == 0):
        return None
    lead = len(shape) - next((n for n in range(1, len(shape) + 1) if np.prod(shape[-n:]) == columns), 0)
    parts = [int(d) for d in shape[lead:]]
    if lead == 0 or lead == len(shape) or np.prod(parts) != columns or min(parts) <= 0 or parts[0] < 2:
        return None
    perm = [int(p) for p in attribute(transpose, "perm", [])]
    if sorted(perm) != list(range(len(shape))) or transpose.output[0] in g.outputs:
        return None
    cut = perm.index(lead)
    branches: dict[int, Any] = {}
    for node in g.consumers.get(transpose.output[0], []):
        index = _slice_index(g, node, cut, parts[0])
        squeeze = _squeezed(g, node, cut) if index is not None else None
        if index is None or squeeze is None or index in branches:
            return None
        branches[index] = (node, squeeze)
    if not branches:
        return None
    nodes = [back, g.producer[back.input[1]], reshape, transpose]
    return {"shape": shape, "lead": lead, "parts": parts, "perm": perm, "branches": branches, "nodes": nodes}


def _part_nodes(g: GraphIndex, gemm: Any, weight_of: _Weight, found: dict[str, Any], index: int, out: str) -> list[Any]:
    """``Gemm`` of part ``index`` (its weight rows and bias entries), its Reshape and Transpose, producing ``out``;
    ``weight_of``: the Gemm's weight (:func:`_weight`)."""
    from onnx import helper

    dq, w, scale, zp = weight_of
    size = int(np.prod(found["parts"][1:]))
    rows = slice(index * size, (index + 1) * size)
    stem = f"{gemm.name or 'gemm'}/part{index}"
    per_row = scale.size > 1
    weight = [g.add_const(dq.input[0] + f"_part{index}", np.ascontiguousarray(w[rows]))]
    for i, values in ((1, scale), (2, zp)):
        weight.append(g.add_const(dq.input[i] + f"_part{index}", values[rows]) if per_row else dq.input[i])
    dequantized = g.unique(dq.output[0] + f"_part{index}")
    new_dq = helper.make_node("DequantizeLinear", weight, [dequantized], name=f"{stem}/weight")
    new_dq.attribute.extend(dq.attribute)
    new_dq.metadata_props.extend(dq.metadata_props)
    inputs = [gemm.input[0], new_dq.output[0]]
    bias = g.const_input(gemm, 2)
    if bias is not None:
        inputs.append(g.add_const(gemm.input[2] + f"_part{index}", bias.reshape(-1)[rows]))
    product = g.unique(stem + "_2d")
    nodes = [new_dq, helper.make_node("Gemm", inputs, [product], name=stem, transB=1)]
    lead, shape = found["lead"], found["shape"]
    perm = [p - (p > lead) for p in found["perm"] if p != lead]
    target = g.add_const(stem + "_shape", np.concatenate([shape[:lead], shape[lead + 1 :]]).astype(np.int64))
    shaped = out if perm == sorted(perm) else g.unique(stem + "_shaped")
    nodes.append(helper.make_node("Reshape", [product, target], [shaped], name=stem + "/Reshape"))
    if shaped != out:
        nodes.append(helper.make_node("Transpose", [shaped], [out], name=stem + "/Transpose", perm=perm))
    return nodes


def _split(g: GraphIndex, gemm: Any) -> bool:
    """Split ``gemm`` when it is a packed projection; whether it was."""
    weight = _weight(g, gemm)
    bias = g.const_input(gemm, 2) if len(gemm.input) > 2 and gemm.input[2] else np.zeros(1, np.float32)
    found = _parts(g, gemm, weight[1].shape[0]) if weight is not None and bias is not None else None
    if weight is None or found is None:
        return False
    doomed = [gemm, weight[0], *found["nodes"]]
    for index, (slice_node, squeeze) in sorted(found["branches"].items()):
        for node in _part_nodes(g, gemm, weight, found, index, squeeze.output[0]):
            g.insert(gemm, node)
        doomed += [slice_node, squeeze]
    shape_of = g.producer.get(found["nodes"][1].input[0])  # the Shape feeding the reshape back's Concat
    if shape_of is not None and shape_of.op_type == "Shape" and len(g.consumers.get(shape_of.output[0], [])) == 1:
        doomed.append(shape_of)
    g.remove(doomed)
    return True


def split_packed_projections(g: GraphIndex) -> int:
    """One ``Gemm`` per quantized part of each packed projection (module doc); returns how many were split."""
    count, tried = 0, set()
    while True:  # node references go stale when nodes are removed: look each Gemm up again after an edit
        gemm = next((n for n in g.graph.node if n.op_type == "Gemm" and n.output[0] not in tried), None)
        if gemm is None:
            return count
        tried.add(gemm.output[0])
        count += _split(g, gemm)
