"""The ``"tensorrt"`` target: TensorRT's explicit quantization (Q/DQ), on GPU; TensorRT 10 and 11.

TensorRT fuses a ``DequantizeLinear`` into the op after it and a ``QuantizeLinear`` into the op before it, and
quantizes nothing the graph does not (notes: anchors §4). So Q/DQ go on the inputs and weights of weighted
ops (module replacement does that), never on their outputs: TensorRT fuses BatchNorm and the activation into
the conv by itself. Placement adds what module replacement cannot reach (``RULES``, in order):

* ``residual_add`` (``residual_add="skip"``): the inputs of a residual add other than the one TensorRT fuses
  into the conv that produces it (:mod:`qdq.targets.common.residual`);
* ``concat``: one scale for every input of a concatenation (:mod:`qdq.targets.common.concat`);
* ``attention``: the target's attention facts for each quantized attention (:mod:`qdq.targets.common.attention`).

Attention (captured by placement, :mod:`qdq.placement.capture`): Q, K, the softmax output and V quantized
where TensorRT's fused int8 attention applies, else float (:mod:`.attention`, ``TENSORRT_ATTENTION``). In a
transformer the Linear layers get input and per-channel weight quantizers (module replacement) and the
residual adds their shortcut input (``residual_add``); LayerNorm, GELU and Softmax stay float.

The package, one concept per module:

* :mod:`.rewrite`: the export's ONNX rewrite (``rewrite_for_tensorrt``): refuses what TensorRT cannot build
  (uint8, Casts after DQs), warns about half-quantized ops, and with the ``float`` option writes the float part
  in FP16/BF16 for TensorRT 11 (:mod:`.float_types`, with :mod:`.float_scales`, :mod:`.float_ranges`,
  :mod:`.float_rewrite`; :mod:`.float_fidelity` measures the result against the float32 export);
* :mod:`.check` (``check_tensorrt``, ``qdq check``) and :mod:`.engine_rules` (one module per rule family):
  TensorRT's explicit-quantization and strong-typing rules, on any ONNX graph; the target's ``rule_check``, which
  the TensorRT runtime (:mod:`qdq.runtime.tensorrt`) runs before building.

Export options (``target_options``; defaults in ``TENSORRT.export``): ``float`` (``"float32"`` by default:
the graph is float32 outside its Q/DQ, bit-exact with the PyTorch model and run by every runtime;
``"float16"``/``"bfloat16"`` for TensorRT 11, which builds low precision only where the file says so),
``calibration_data``, ``keep_io_types``, ``data_max`` (:func:`~.rewrite.rewrite_for_tensorrt`). With
``QuantConfig(target="tensorrt", target_options={"float": "float16"})`` the model's quantizers get float16
steps (``step_type``), so that PyTorch quantizes on the file's grid.

OpenVINO runs the same graph (float32) with every convolution in u8; ONNX Runtime runs it, but fuses a Conv
into ``QLinearConv`` only when its output is quantized, so its Convs stay float there.

Adding a placement rule: write it (a :class:`~qdq.targets.rules.PlacementRule`: one function of the graph
view, :mod:`qdq.graphs.view`, run for PyTorch, Keras and ONNX models alike) in a module of this package and
append it to ``RULES`` below.
Adding an engine rule: see :mod:`.engine_rules`.
"""

from __future__ import annotations

from qdq.runtime_registry import OPENVINO_RUNTIME, ORT_RUNTIME, TENSORRT_RUNTIME
from qdq.targets.common.attention import ATTENTION
from qdq.targets.common.concat import CONCAT
from qdq.targets.common.residual import RESIDUAL_ADD
from qdq.targets.common.tail import OUTPUT_TAIL
from qdq.targets.target import ExportDefaults, RuntimeSupport, Target
from qdq.targets.tensorrt.attention import TENSORRT_ATTENTION
from qdq.targets.tensorrt.check import check_tensorrt
from qdq.targets.tensorrt.rewrite import DEFAULT_FLOAT, rewrite_for_tensorrt, step_type

__all__ = ["RULES", "RUNTIMES", "TENSORRT"]

RULES = (RESIDUAL_ADD, CONCAT, ATTENTION, OUTPUT_TAIL)

RUNTIMES = (
    RuntimeSupport(TENSORRT_RUNTIME, "native"),
    RuntimeSupport(OPENVINO_RUNTIME, "native"),
    RuntimeSupport(
        ORT_RUNTIME,
        "runs",
        "ONNX Runtime runs a Conv as QLinearConv only when its output is quantized, and the tensorrt target "
        "quantizes the inputs and weights of Convs only, so they run in float between Q/DQ conversions",
    ),
)

TENSORRT = Target(
    name="tensorrt",
    description="TensorRT explicit quantization (the same graph runs in u8 on OpenVINO)",
    placement_rules=RULES,
    residual_add="skip",
    onnx_rewrite=rewrite_for_tensorrt,
    export=ExportDefaults(opset=None, options={"float": DEFAULT_FLOAT}),
    runtimes=RUNTIMES,
    step_type=step_type,
    attention=TENSORRT_ATTENTION,
    rule_check=check_tensorrt,
)
