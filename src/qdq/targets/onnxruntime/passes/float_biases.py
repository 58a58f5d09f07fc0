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

from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import const_input, make_node, only_readers, readers, single_reader

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["biases_to_float_adds"]


def _bias_after(gemm: ir.Node) -> ir.Node | None:
    """The node whose output a bias ``Add`` goes after: when only ``Gelu`` nodes read ``gemm``'s output (or its one
    ``Reshape``'s), ``gemm`` itself (before the Reshape: no ``BiasGelu``); when only one ``Add`` whose sum a
    ``LayerNormalization`` reads does, the node writing what that ``Add`` reads; else None."""
    writer = gemm
    reshape = single_reader(gemm.outputs[0])
    if reshape is not None and reshape.op_type == "Reshape":
        writer = reshape
    if only_readers(writer.outputs[0], ("Gelu",)):
        return gemm
    adds = only_readers(writer.outputs[0], ("Add",))
    if adds is None or len(adds) != 1:
        return None
    norms = [r for r in readers(adds[0].outputs[0]) if r.op_type == "LayerNormalization"]
    return writer if norms else None


def biases_to_float_adds(graph: ir.Graph) -> int:
    """Move each float bias of a Gemm read by a ``Gelu`` or a residual ``Add`` to an ``Add`` after it (module doc)."""
    count = 0
    for gemm in [n for n in graph if n.op_type == "Gemm" and len(n.inputs) > 2 and n.inputs[2] is not None]:
        bias = const_input(gemm, 2)
        writer = _bias_after(gemm) if bias is not None and bias.ndim == 1 else None
        if writer is None:
            continue
        value, name = writer.outputs[0], (gemm.name or "gemm") + "/bias_Add"
        add = make_node(graph, "Add", [None, gemm.inputs[2]], f"{value.name}_biased", name=name)
        value.replace_all_uses_with(add.outputs[0])
        add.replace_input_with(0, value)
        graph.insert_after(writer, add)
        gemm.resize_inputs(2)
        count += 1
    return count
