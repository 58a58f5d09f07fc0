"""Residual LayerNorms kept apart from their add: ``LayerNormalization(Add(x, skip))`` reads the sum through a
``Reshape`` to ``[-1, hidden]`` and writes its output back to the sum's shape.

ONNX Runtime fuses ``Add -> LayerNormalization`` (and ``Add(bias) -> Add -> LayerNormalization``) into its
``SkipLayerNormalization`` contrib op when the add's two inputs have matching 3-D shapes and the sum has no other
reader. Its CPU kernel is a scalar loop per row, several times the time of the float ``Add`` and the vectorized
``LayerNormalization`` kernel together, so keeping them apart makes int8 (and float) BERTs faster
(benchmarks/RESULTS.md, transformers_int8 and code_figures). The fusion only matches an ``Add`` feeding the
LayerNorm directly, so a ``Reshape`` between them keeps them apart whatever shape information ORT has; Reshape is a
view in ORT (no copy). Normalizing a ``[B * S, H]`` view over its last axis is the same arithmetic as over ``[B, S,
H]``: the result is bit-identical.

Applies to a LayerNorm over the last axis (``axis=-1``, one output) of an ``Add`` it is the only reader of (the
form ORT fuses: post-LN BERT's residual adds, a pre-LN model's final norm). Runs after :mod:`.float_biases`, which
looks for the ``Add -> LayerNormalization`` form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import add_const, attr, const_input, hand_over, make_node, single_reader, source

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["keep_layernorms_apart"]


def keep_layernorms_apart(graph: ir.Graph) -> int:
    """Put a ``Reshape`` to 2-D between each residual ``Add`` and the LayerNorm reading it (module doc);
    returns how many LayerNorms now read a reshaped sum."""
    count = 0
    for norm in [n for n in graph if _residual_norm(n)]:
        _reshape_around(graph, norm)
        count += 1
    return count


def _residual_norm(node: ir.Node) -> bool:
    if node.op_type != "LayerNormalization" or attr(node, "axis", -1) != -1:
        return False
    if len([o for o in node.outputs if o.name]) != 1:  # Mean / InvStdDev outputs would change shape
        return False
    add = source(node.inputs[0])
    scale = const_input(node, 1)
    return (
        add is not None
        and add.op_type == "Add"
        and single_reader(node.inputs[0]) is node
        and (scale is not None and scale.ndim == 1)
    )


def _reshape_around(graph: ir.Graph, norm: ir.Node) -> None:
    total, out, scale = norm.inputs[0], norm.outputs[0], const_input(norm, 1)
    assert total is not None and scale is not None  # _residual_norm: an Add's sum, a constant 1-D scale
    stem = norm.name or "layernorm"
    rows = add_const(graph, stem + "_rows", np.array([-1, int(scale.shape[0])], np.int64))
    shape = make_node(graph, "Shape", [total], f"{total.name}_shape", name=stem + "/Shape")
    flat = make_node(graph, "Reshape", [total, rows], f"{total.name}_rows", name=stem + "/Reshape_rows")
    back = make_node(graph, "Reshape", [None, shape.outputs[0]], f"{out.name}_rows", name=stem + "/Reshape_back")
    graph.insert_before(norm, [shape, flat])
    graph.insert_after(norm, back)
    norm.replace_input_with(0, flat.outputs[0])
    hand_over(out, back)  # a graph output keeps its name, type and shape
    out.shape = None  # the norm now writes the rows
