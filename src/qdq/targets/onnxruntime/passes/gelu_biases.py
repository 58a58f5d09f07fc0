"""Biases before a GELU: a ``Gemm`` whose float output only a ``Gelu`` reads (a transformer's first MLP Linear)
keeps its bias as a float ``Add`` before the ``Gelu`` instead of an int32 bias inside ``QGemm``.

``QGemm`` adds an int32 bias by first writing it into every row of its ``[M, N]`` int32 output and then
accumulating the product onto it: a full extra pass over the output, which costs a third more than the product
itself for ``K = 384``, ``N = 1536`` (ViT-S's ``fc1``, measured in ORT's profile). ORT fuses ``Add(bias) -> Gelu``
into one ``BiasGelu`` kernel, which costs what the ``Gelu`` alone did: the bias is then free, and it is the exact
float bias PyTorch adds (no rounding to ``s_x * s_w``). Where a quantizer follows the Gemm (its output is int8),
the bias has to be inside the int8 kernel and this pass does not apply.

Runs after :mod:`.gemm` (whose ``Gemm`` may be followed by a ``Reshape`` back to ``[..., N]``) and before
:mod:`.biases`, while the bias is still a float constant.
"""

from __future__ import annotations

from typing import Any

from qdq.graphs.onnx import GraphIndex

__all__ = ["biases_before_gelu"]

_GELU = frozenset({"Gelu"})


def _gelu_input(g: GraphIndex, gemm: Any) -> str | None:
    """The tensor the ``Gelu`` reads: ``gemm``'s output or its one ``Reshape``, read by ``Gelu`` nodes only."""
    tensor = gemm.output[0]
    reshape = g.single_reader(tensor)
    if reshape is not None and reshape.op_type == "Reshape":
        tensor = reshape.output[0]
    readers = g.consumers.get(tensor, [])
    if not readers or tensor in g.outputs or any(r.op_type not in _GELU for r in readers):
        return None
    return tensor


def biases_before_gelu(g: GraphIndex) -> int:
    """Move each float bias of a Gemm read only by a ``Gelu`` to an ``Add`` before it (module doc)."""
    from onnx import helper

    adds = []
    for gemm in [n for n in g.graph.node if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]]:
        bias = g.const_input(gemm, 2)
        tensor = _gelu_input(g, gemm) if bias is not None and bias.ndim == 1 else None
        if tensor is None:
            continue
        biased = g.unique(tensor + "_biased")
        g.rewire(tensor, biased)
        name = (gemm.name or "gemm") + "/bias_Add"
        adds.append(helper.make_node("Add", [tensor, gemm.input[2]], [biased], name=name))
        del gemm.input[2]
    for add in adds:  # inserted last: inserting nodes can leave earlier node references stale
        g.insert(g.producer[add.input[0]], add, after=True)
    g.refresh()
    return len(adds)
