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

from typing import Any

import numpy as np

from qdq.graphs.onnx import GraphIndex, attribute

__all__ = ["keep_layernorms_apart"]


def keep_layernorms_apart(g: GraphIndex) -> int:
    """Put a ``Reshape`` to 2-D between each residual ``Add`` and the LayerNorm reading it (module doc);
    returns how many LayerNorms now read a reshaped sum."""
    count = 0
    for norm in [n for n in g.graph.node if _residual_norm(g, n)]:
        _reshape_around(g, norm)
        count += 1
    return count


def _residual_norm(g: GraphIndex, node: Any) -> bool:
    if node.op_type != "LayerNormalization" or attribute(node, "axis", -1) != -1:
        return False
    if len([o for o in node.output if o]) != 1:  # Mean / InvStdDev outputs would change shape
        return False
    add = g.producer.get(node.input[0])
    scale = g.const_input(node, 1)
    return (
        add is not None
        and add.op_type == "Add"
        and g.single_reader(node.input[0]) is node
        and (scale is not None and scale.ndim == 1)
    )


def _reshape_around(g: GraphIndex, norm: Any) -> None:
    from onnx import helper

    total, out = norm.input[0], norm.output[0]
    scale = g.const_input(norm, 1)
    assert scale is not None  # _residual_norm: a constant 1-D scale
    hidden = int(scale.shape[0])
    stem = norm.name or "layernorm"
    flat_shape = g.add_const(stem + "_rows", np.array([-1, hidden], np.int64))
    shape, flat, normed = g.unique(total + "_shape"), g.unique(total + "_rows"), g.unique(out + "_rows")
    g.insert(norm, helper.make_node("Shape", [total], [shape], name=stem + "/Shape"))
    g.insert(norm, helper.make_node("Reshape", [total, flat_shape], [flat], name=stem + "/Reshape_rows"))
    g.insert(norm, helper.make_node("Reshape", [normed, shape], [out], name=stem + "/Reshape_back"), after=True)
    g.set_input(norm, 0, flat)
    g.set_output(norm, 0, normed)
