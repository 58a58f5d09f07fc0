"""The ``"onnxruntime"`` target: ONNX Runtime's CPU int8 kernels (``QLinearConv``, ``QGemm``, ``QLinearAdd``...).

ONNX Runtime turns a ``DQ -> op -> Q`` group into an int8 kernel only when every data input is dequantized
*and* the output quantized (:mod:`~qdq.targets.onnxruntime.fusion`; notes: ort-int8-notes.md). So this
target quantizes more than TensorRT's inputs and weights, and the model carries those quantizers, so that what
is calibrated and trained is what ONNX Runtime computes. Its rules (each written once against the graph view,
:mod:`qdq.graphs.view`, for every front end), in order:

* ``float_recurrent`` (:mod:`.rules.recurrent`): LSTM / GRU layers stay float (ORT's float LSTM kernel);
* ``residual_add`` with ``residual_add="both"`` (:mod:`qdq.targets.common.residual`; a transformer's residual
  adds, read by a LayerNorm, stay float: ORT has no int8 LayerNorm);
* ``conv_output`` (:mod:`.rules.conv_output`): every conv output quantized, after BN and a folded ReLU;
* ``silu_gate``, ``sigmoid_output`` (:mod:`.rules.sigmoid`), ``mul_inputs`` (:mod:`.rules.mul_inputs`): SiLU and
  squeeze-excitation gates as ``QLinearSigmoid`` / ``QLinearMul``;
* ``elementwise_output`` (:mod:`.rules.elementwise_output`): an add or product of quantized tensors has its
  output quantized (``QLinearAdd``, ``QLinearMul``);
* ``int8_concat`` (:mod:`.rules.int8_concat`): a concatenation read quantized gets every input quantized
  (``QLinearConcat``);
* ``data_movers`` (:mod:`.rules.data_movers`): MaxPool, Resize, Slice... of a quantized tensor keep one range
  on both sides, so ORT runs them on int8 data;
* ``one_range_per_tensor`` (:mod:`.rules.tensor_range`): the quantizers of one tensor share one range (ORT
  fuses a tensor with one Q);
* ``unsigned_activations`` (:mod:`.rules.unsigned`): non-negative tensors quantized as uint8, zero point 0;
* ``attention`` (:mod:`qdq.targets.common.attention`): all four attention quantizers at any shape, the softmax
  scale on the query before its quantizer (``scale_query``, :mod:`.attention`), which the rewrite folds into the
  query's QuantizeLinear.

The exported graph is rewritten by :func:`~qdq.targets.onnxruntime.rewrite.rewrite_for_onnxruntime` (one
pass per module, :mod:`.passes`); its one option, ``weights`` (the weight encoding), defaults to ``"auto"``. The
same encoding is the target's ``weight_encoding``: the CPU runtimes re-encode a file with it where the CPU's int8
dot products saturate (:mod:`qdq.runtime.saturation`). Its ``block_weights`` (:mod:`.passes.matmul_nbits`, not part of
the rewrite) write a float MatMul on a constant weight as ``MatMulNBits``, for the runtimes with those kernels.

Adding a rule: a module in ``rules/`` defining a :class:`~qdq.targets.rules.PlacementRule` (a function of the
graph view), listed in ``RULES`` below at its place. Adding a pass: see :mod:`qdq.targets.onnxruntime.rewrite`.
"""

from __future__ import annotations

from qdq.runtime_registry import OPENVINO_RUNTIME, ORT_RUNTIME, TENSORRT_RUNTIME
from qdq.targets.common.attention import ATTENTION
from qdq.targets.common.residual import RESIDUAL_ADD
from qdq.targets.common.tail import OUTPUT_TAIL
from qdq.targets.onnxruntime.attention import ONNXRUNTIME_ATTENTION
from qdq.targets.onnxruntime.fusion import ONNXRUNTIME_FUSION
from qdq.targets.onnxruntime.passes.matmul_nbits import float_weight_matmuls, matmul_nbits
from qdq.targets.onnxruntime.passes.weight_encoding import encode_weights_uint8, recorded_weights
from qdq.targets.onnxruntime.rewrite import DEFAULT_WEIGHTS, rewrite_for_onnxruntime
from qdq.targets.onnxruntime.rules.conv_output import CONV_OUTPUT
from qdq.targets.onnxruntime.rules.data_movers import DATA_MOVERS
from qdq.targets.onnxruntime.rules.elementwise_output import ELEMENTWISE_OUTPUT
from qdq.targets.onnxruntime.rules.int8_concat import INT8_CONCAT
from qdq.targets.onnxruntime.rules.mul_inputs import MUL_INPUTS
from qdq.targets.onnxruntime.rules.recurrent import FLOAT_RECURRENT
from qdq.targets.onnxruntime.rules.sigmoid import SIGMOID_OUTPUT, SILU_GATE
from qdq.targets.onnxruntime.rules.tensor_range import ONE_RANGE_PER_TENSOR
from qdq.targets.onnxruntime.rules.unsigned import UNSIGNED_ACTIVATIONS
from qdq.targets.target import BlockWeights, ExportDefaults, RuntimeSupport, Target, WeightEncoding

__all__ = ["ONNXRUNTIME", "ONNXRUNTIME_FUSION", "RULES", "RUNTIMES"]

RULES = (
    FLOAT_RECURRENT,
    RESIDUAL_ADD,
    CONV_OUTPUT,
    SILU_GATE,
    SIGMOID_OUTPUT,
    MUL_INPUTS,
    ELEMENTWISE_OUTPUT,
    INT8_CONCAT,
    DATA_MOVERS,
    ONE_RANGE_PER_TENSOR,
    UNSIGNED_ACTIVATIONS,
    ATTENTION,
    OUTPUT_TAIL,
)

RUNTIMES = (
    RuntimeSupport(ORT_RUNTIME, "native"),
    RuntimeSupport(OPENVINO_RUNTIME, "native"),  # its convolutions run in u8 there too (measured on a small CNN)
    RuntimeSupport(
        TENSORRT_RUNTIME,
        "refuses",
        "TensorRT builds signed int8 Q/DQ only, and this graph has uint8 activations and int32 biases written "
        "for ONNX Runtime's kernels",
    ),
)

ONNXRUNTIME = Target(
    name="onnxruntime",
    description="ONNX Runtime CPU int8 kernels (QLinearConv, QGemm, QLinearAdd, ...)",
    placement_rules=RULES,
    residual_add="both",
    onnx_rewrite=rewrite_for_onnxruntime,
    fusion=ONNXRUNTIME_FUSION,
    export=ExportDefaults(opset=None, options={"weights": DEFAULT_WEIGHTS}),
    runtimes=RUNTIMES,
    attention=ONNXRUNTIME_ATTENTION,
    weight_encoding=WeightEncoding(recorded=recorded_weights, to_uint8=encode_weights_uint8),
    block_weights=BlockWeights(matmuls=float_weight_matmuls, convert=matmul_nbits),
)
