"""The ``"onnxruntime"`` target's ONNX rewrite: a qdq Q/DQ graph in the form ONNX Runtime's CPU provider runs
as int8 kernels.

ORT replaces ``DQ(x) + DQ(w) [+ DQ(bias)] -> Conv -> Q`` by ``QLinearConv`` (and similar groups by ``QGemm``,
``QLinearAdd``...; :mod:`qdq.targets.onnxruntime.fusion`). The rewrite keeps every quantized value of the model
and changes only the encoding, in passes (one module each, :mod:`qdq.targets.onnxruntime.passes`):

1. ``weights``: ``Q(W) -> DQ`` becomes an int8 initializer ``-> DQ``;
2. ``batchnorm`` / ``bias_adds``: a BatchNorm (a per-channel bias Add) after a Conv is folded into it;
3. ``zero_masks``: the 0/1 masks of zero-range quantizers after a Conv are folded into its weights;
4. ``uint8_activations``: int8 activations with zero point 0 become uint8 with zero point 128 (the same grid);
5. ``biases``: Conv / Gemm biases become int32 at ``s_x * s_w``; a Conv ORT cannot fuse keeps a float bias; a
   weight step too small for its bias's int32 code is widened (recorded as ``qdq.widened_weights``: JSON node ->
   the largest factor a step grew by);
6. ``duplicates``: equal Q/DQ pairs on one tensor merge, ``DQ -> Q`` with equal parameters goes;
7. ``pools``: a spatial ``ReduceMean`` becomes ``GlobalAveragePool``, a ``Flatten`` after it a ``Reshape``;
8. ``gemm``: ``MatMul`` of a 2-D input by a dequantized weight (Keras Dense) becomes ``Gemm``;
9. ``weight_encoding``: ``weights="uint8"`` stores weights as uint8 (exact on CPUs without VNNI);
10. ``attention_mask``: ``Where(mask, -inf, scores)`` before a Softmax becomes ``scores + Where(mask, -inf, 0)``;
11. ``scaled_inputs``: ``Mul(x, 2^k) -> Q`` becomes a Q of ``x`` with its scale divided by ``2^k`` (the attention's
    softmax scale on the query, folded; exact);
12. ``packed_projections``: a Linear whose output is cut into separately quantized parts (timm's packed ``qkv``)
    becomes one ``Gemm`` per part, each followed by its own quantizer (``QGemm`` with int8 output, no float
    ``Split``);
13. ``zero_biases``: a Gemm bias of zeros is dropped (the key and value projections after placement folded
    their biases, :mod:`qdq.placement.attention_biases`): ``QGemm`` would still pass its int32 bias over the output;
14. ``float_biases``: a Gemm read only by a ``Gelu``, or by a residual ``Add`` before a LayerNorm, keeps its float
    bias as an ``Add`` after it (before the Gelu's Reshape: ORT's ``BiasGelu`` is slower than the two apart), not
    as an int32 bias inside ``QGemm`` (an extra pass over its output);
15. ``layernorms``: a LayerNorm reads its residual ``Add`` through a ``Reshape`` to 2-D, so that ORT does not fuse
    the two into ``SkipLayerNormalization`` (a scalar kernel, several times slower than the two apart); then
    ``float_pools``: a ``GlobalAveragePool`` whose scales ORT's int8 kernel refuses keeps a float output;
16. ``shapes``: a ``Shape`` of a quantized tensor reads its int8 encoding (a float reader less: the product before
    it fuses, a dequantization done only for a shape goes);
17. ``pads``: ``DQ -> Pad -> Q`` of one grid pads the integers (ORT runs no Pad between Q/DQ on int8 data itself;
    the same-padding before TensorFlow-style convs).

The passes run on onnx_ir (one round trip for the whole rewrite, :func:`qdq.graphs.onnx.on_ir`), between two
tidy-ups by onnx_ir's own passes (identities bypassed, unused nodes and initializers removed). The exporter's
``value_info`` is dropped (the rewrite retypes tensors); ONNX Runtime infers types itself.

Then :mod:`~qdq.targets.onnxruntime.passes.float_convs` lists the Convs ORT still cannot fuse, with one warning
per cause. The branches of each ``If`` are rewritten the same way, each as a graph of its own (ORT fuses Q/DQ
groups inside them; a branch of ``quantize_onnx`` holds its Q/DQ constants); ``Loop`` bodies are not.

Adding a pass: a module in ``passes/`` with one function ``pass(graph: onnx_ir.Graph) -> int`` (edits made), written
with onnx_ir's methods and :mod:`qdq.graphs.ir_graph`, called from :func:`_rewrite_graph` at its place in the order,
and its count added to the result.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import graphs_of, subgraphs, tidy
from qdq.graphs.onnx import on_ir, set_metadata
from qdq.targets.onnxruntime.passes.attention_mask import masks_to_adds
from qdq.targets.onnxruntime.passes.batchnorm import fold_batchnorms
from qdq.targets.onnxruntime.passes.bias_adds import fold_bias_adds
from qdq.targets.onnxruntime.passes.biases import WIDENED_METADATA_KEY, bias_after_float_convs, quantize_biases
from qdq.targets.onnxruntime.passes.duplicates import merge_duplicate_pairs, remove_requantization
from qdq.targets.onnxruntime.passes.float_biases import biases_to_float_adds
from qdq.targets.onnxruntime.passes.float_convs import unfusable_conv_nodes, warn_float_convs
from qdq.targets.onnxruntime.passes.gemm import matmuls_to_gemm
from qdq.targets.onnxruntime.passes.layernorms import keep_layernorms_apart
from qdq.targets.onnxruntime.passes.packed_projections import split_packed_projections
from qdq.targets.onnxruntime.passes.pads import pads_on_int8
from qdq.targets.onnxruntime.passes.pools import flatten_pools, float_pools_out_of_range, global_pools
from qdq.targets.onnxruntime.passes.scaled_inputs import fold_scaled_inputs
from qdq.targets.onnxruntime.passes.shapes import shapes_of_int8
from qdq.targets.onnxruntime.passes.uint8_activations import activations_to_uint8
from qdq.targets.onnxruntime.passes.weight_encoding import WEIGHTS_METADATA_KEY, resolve_weights, weights_to_uint8
from qdq.targets.onnxruntime.passes.weights import fold_weight_quantizers
from qdq.targets.onnxruntime.passes.zero_biases import drop_zero_biases
from qdq.targets.onnxruntime.passes.zero_masks import drop_masks_of_zeros, fold_zero_masks

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = ["DEFAULT_WEIGHTS", "rewrite_for_onnxruntime"]

#: the weight encoding of an export that does not choose one: uint8 where the exporting CPU saturates
DEFAULT_WEIGHTS = "auto"


def rewrite_for_onnxruntime(model: onnx.ModelProto, *, weights: str = DEFAULT_WEIGHTS) -> dict[str, int]:
    """Rewrite ``model`` in place for ONNX Runtime's int8 kernels (see the module doc).

    Args:
        model: the exported Q/DQ graph.
        weights: how weights are stored (pass 9): ``"int8"`` (U8S8 kernels: the fastest on CPUs with VNNI
            and on ARM, saturating on other x86 CPUs), ``"uint8"`` (U8U8: exact on every CPU), or ``"auto"``
            (default): ``"uint8"`` when the CPU doing the export saturates (:func:`qdq.cpu.int8_dot_saturates`).
            The choice is made here, once, and recorded as model metadata ``qdq.weights``; :mod:`qdq.runtime`
            adapts only a file that does not record ``"uint8"`` (re-encoding it in memory on a CPU that saturates).

    Returns:
        How many of each rewrite were made: ``pools``, ``weights``, ``gemms``, ``batchnorms``, ``bias_adds``,
        ``masks``, ``uint8``, ``biases``, ``duplicates``, ``requantizations``, ``float_biases``,
        ``uint8_weights``, ``masks_to_adds``, ``scaled_inputs``, ``packed_projections``, ``zero_biases``,
        ``layernorms``, ``float_pools``, ``shapes``, ``pads``, ``widened_weights``; and ``float_convs``, the Convs
        ORT cannot fuse (warned).
    """
    encoding = resolve_weights(weights)
    counts, widened, left = on_ir(model, lambda ir_model: _rewrite_model(ir_model, encoding))[0]
    warn_float_convs(left)
    if widened:
        set_metadata(model, WIDENED_METADATA_KEY, json.dumps(widened, sort_keys=True))
    set_metadata(model, WEIGHTS_METADATA_KEY, encoding)
    del model.graph.value_info[:]  # the exporter's types are stale (int8 -> uint8)
    return counts


def _rewrite_model(model: ir.Model, encoding: str) -> tuple[dict[str, int], dict[str, float], list[ir.Node]]:
    """The rewrite on ``model``: counts, the widened weight steps, and the Convs left float in any of its graphs."""
    tidy(model)
    widened: dict[str, float] = {}
    counts = _rewrite_graph(model.graph, model, widened)
    counts["uint8_weights"] = weights_to_uint8(model.graph) if encoding == "uint8" else 0
    tidy(model)
    counts["float_convs"] = len(unfusable_conv_nodes(model.graph))
    counts["widened_weights"] = len(widened)
    return counts, widened, [conv for graph in graphs_of(model.graph) for conv in unfusable_conv_nodes(graph)]


def _rewrite_graph(graph: ir.Graph, model: ir.Model, widened: dict[str, float]) -> dict[str, int]:
    """The passes on ``graph``, then on the branches of its ``If`` nodes (each as a graph of its own)."""
    counts = {
        "pools": global_pools(graph) + flatten_pools(graph),
        "weights": fold_weight_quantizers(graph),
        "gemms": matmuls_to_gemm(graph, model),
        "batchnorms": fold_batchnorms(graph),
        "bias_adds": fold_bias_adds(graph),
        "masks": fold_zero_masks(graph) + drop_masks_of_zeros(graph),
        "duplicates": merge_duplicate_pairs(graph),
        "uint8": activations_to_uint8(graph),
        "masks_to_adds": masks_to_adds(graph),
        "scaled_inputs": fold_scaled_inputs(graph),
        "packed_projections": split_packed_projections(graph),
        "zero_biases": drop_zero_biases(graph),
        "float_biases": biases_to_float_adds(graph),
        "layernorms": keep_layernorms_apart(graph),
        "float_pools": float_pools_out_of_range(graph),
    }
    counts["requantizations"] = remove_requantization(graph)
    counts["shapes"] = shapes_of_int8(graph)
    counts["pads"] = pads_on_int8(graph)
    float_convs = unfusable_conv_nodes(graph)
    counts["float_biases"] += bias_after_float_convs(graph, float_convs)
    counts["biases"] = quantize_biases(graph, float_convs, widened)
    counts["branches"] = 0
    for node in [n for n in graph if n.op_type == "If"]:
        for branch in subgraphs(node):
            counts["branches"] += 1 + _rewrite_graph(branch, model, widened)["branches"]
    return counts
