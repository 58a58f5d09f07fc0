"""ONNX Runtime's CPU provider: which Q/DQ groups it turns into int8 kernels (read from onnxruntime 1.31's
optimized graphs; notes: ort-int8-notes.md).

Read by the ``"onnxruntime"`` target's placement rules (which activations a conv folds), its ONNX rewrite
(which Convs stay float) and, as the facts of the target made for ONNX Runtime, the ONNX Runtime backend
(:mod:`qdq.runtime.ort.fusion`: why a Q/DQ node stayed, why a weighted op stayed float).
"""

from __future__ import annotations

from qdq.targets.target import FusionFacts

__all__ = ["ONNXRUNTIME_FUSION"]

_ORT_INT8_KERNELS = {"QLinearConv", "ConvInteger", "QGemm", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat",
                     "DynamicQuantizeMatMul", "MatMulInteger16", "QAttention"}  # fmt: skip
_ORT_FLOAT_KERNELS = {"Conv", "FusedConv", "NhwcFusedConv", "ConvTranspose", "ConvTransposeWithDynamicPads", "Gemm",
                      "FusedGemm", "MatMul", "FusedMatMul", "TransposeMatMul"}  # fmt: skip
_ORT_LAYOUT_OPS = {"Transpose", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "ReorderInput",
                   "ReorderOutput"}  # fmt: skip

#: ONNX Runtime's CPU provider (read from onnxruntime 1.31's optimized graphs): its int8 kernels.
ONNXRUNTIME_FUSION = FusionFacts(
    int8_forms={
        "Conv": ("QLinearConv", (0, 1)),
        "FusedConv": ("QLinearConv", (0, 1)),
        "Gemm": ("QGemm", (0, 1)),
        "FusedGemm": ("QGemm", (0, 1)),
        "MatMul": ("QLinearMatMul", (0, 1)),
        "FusedMatMul": ("QLinearMatMul", (0, 1)),
        "Add": ("QLinearAdd", (0, 1)),
        "Mul": ("QLinearMul", (0, 1)),
        "Concat": ("QLinearConcat", None),
        "Sigmoid": ("QLinearSigmoid", (0,)),
        "LeakyRelu": ("QLinearLeakyRelu", (0,)),
        "Softmax": ("QLinearSoftmax", (0,)),
        "GlobalAveragePool": ("QLinearGlobalAveragePool", (0,)),
        "AveragePool": ("QLinearAveragePool", (0,)),
        "Where": ("QLinearWhere", (1, 2)),
    },
    int8_kernels=frozenset(_ORT_INT8_KERNELS),
    float_kernels=frozenset(_ORT_FLOAT_KERNELS),
    folded_activations=frozenset({"Relu", "Clip"}),
    int8_data_movers=frozenset({"MaxPool", "Resize", "Slice", "Gather", "Split", "Pad", "DepthToSpace"}),
    layout_ops=frozenset(_ORT_LAYOUT_OPS),
    mover_modes={"Resize": frozenset({"nearest"})},  # a linear or cubic Resize stays float between its DQ and Q
)
