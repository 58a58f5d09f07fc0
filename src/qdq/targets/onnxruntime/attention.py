"""Attention on ONNX Runtime's CPU provider: which attention-matmul inputs it runs in int8, and where the softmax
scale goes.

ORT runs ``DQ(Q) · DQ(Kᵀ)`` as ``MatMulIntegerToFloat`` and ``DQ(softmax) · DQ(V) -> Q`` as ``QLinearMatMul``,
at every head size and sequence length: all four quantizers, any shape. ``MatMulIntegerToFloat`` has no
output scale, so a ``Mul`` by the softmax scale after ``Q·Kᵀ`` runs as its own pass over the
``[batch, heads, sequence, sequence]`` scores (ORT's own quantizer leaves a float ``FusedMatMul`` there, which
takes it). This target multiplies the query by the scale before its quantizer instead (``scale_query``):
for a power-of-two scale (head sizes 4, 16, 64, 256) the same numbers, and the rewrite folds that ``Mul``
into the query's QuantizeLinear (:mod:`qdq.targets.onnxruntime.passes.scaled_inputs`), so no op is left.

``QGemm`` adds an int32 bias by writing it over its whole output before accumulating: for the key, query and value
projections (int8 outputs, so the bias cannot move to a float ``Add``) that pass costs a large share of the GEMM
(benchmarks/RESULTS.md, code_figures). The key's bias changes no softmax and the value's can join the output
Linear's bias (``fold_biases``, :mod:`qdq.placement.attention_biases`): two of the three projections run without one
(the rewrite drops a bias of zeros, :mod:`qdq.targets.onnxruntime.passes.zero_biases`).
"""

from __future__ import annotations

from qdq.graphs.ops import ATTENTION_SITES
from qdq.targets.target import AttentionFacts

__all__ = ["ONNXRUNTIME_ATTENTION"]

ONNXRUNTIME_ATTENTION = AttentionFacts(quantized=ATTENTION_SITES, scale_query=True, fold_biases=True)
