"""Float biases where ORT adds them for free: a ``Gemm`` whose float output only a ``Gelu`` reads (a transformer's
first MLP Linear), or only a residual ``Add`` that a ``LayerNormalization`` reads (the attention output and second
MLP Linears), keeps its bias as a float ``Add`` after it instead of an int32 bias inside ``QGemm``.

``QGemm`` adds an int32 bias by first writing it into every row of its ``[M, N]`` int32 output and then accumulating
the product onto it: a full extra pass over the output, costly at transformer sizes. Before a residual add the float
``Add`` is no slower than that pass (faster on ViT-S; the same on BERT, whose residual adds :mod:`.layernorms` keeps
apart from their LayerNorm). Before a ``Gelu`` the ``Add`` goes on the Gemm's 2-D output, before the Reshape back to
``[..., N]``: ORT would fuse ``Add -> Gelu`` into ``BiasGelu``, whose CPU kernel is slower than the ``Add`` and the
``Gelu`` apart. A 2-D Gemm read by the Gelu directly (no Reshape between) keeps the fused form. The figures:
benchmarks/RESULTS.md, code_figures. The bias is the exact float bias PyTorch adds (no rounding to ``s_x * s_w``).
Where a quantizer follows the Gemm (its output is int8), the bias has to be inside the int8 kernel and this pass
does not apply.

Runs after :mod:`.gemm` (whose ``Gemm`` may be followed by a ``Reshape`` back to ``[..., N]``) and before
:mod:`.biases`, while the bias is still a float constant.
"""

from __future__ import annotations

from typing import Any

from qdq.graphs.onnx import GraphIndex

__all__ = ["biases_to_float_adds"]


def _fused_reader_input(g: GraphIndex, gemm: Any) -> str | None:
    """The tensor a bias ``Add`` goes after: when only ``Gelu`` nodes read ``gemm``'s output (or its one
    ``Reshape``), ``gemm``'s output itself (before the Reshape: no ``BiasGelu``); when only one ``Add`` whose sum a
    ``LayerNormalization`` reads does, the tensor that ``Add`` reads; else None."""
    tensor = gemm.output[0]
    reshape = g.single_reader(tensor)
    if reshape is not None and reshape.op_type == "Reshape":
        tensor = reshape.output[0]
    if g.only_readers(tensor, ("Gelu",)):
        return gemm.output[0]
    adds = g.only_readers(tensor, ("Add",))
    if adds is None or len(adds) != 1:
        return None
    norms = [r for r in g.consumers.get(adds[0].output[0], []) if r.op_type == "LayerNormalization"]
    return tensor if norms else None


def biases_to_float_adds(g: GraphIndex) -> int:
    """Move each float bias of a Gemm read by a ``Gelu`` or a residual ``Add`` to an ``Add`` after it (module doc)."""
    from onnx import helper

    adds = []
    for gemm in [n for n in g.graph.node if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]]:
        bias = g.const_input(gemm, 2)
        tensor = _fused_reader_input(g, gemm) if bias is not None and bias.ndim == 1 else None
        if tensor is None:
            continue
        biased = g.unique(tensor + "_biased")
        g.rewire(tensor, biased)
        name = (gemm.name or "gemm") + "/bias_Add"
        adds.append(helper.make_node("Add", [tensor, gemm.input[2]], [biased], name=name))
        g.set_input(gemm, 2, None)
    for add in adds:
        g.insert(g.producer[add.input[0]], add, after=True)
    return len(adds)
