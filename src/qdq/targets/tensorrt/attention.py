"""Attention on TensorRT: its fused int8 multi-head-attention kernels, and when they apply.

TensorRT picks a fused int8 MHA kernel when both inputs of each attention matmul are quantized (Q and K
before ``Q·Kᵀ``; the softmax output and V before ``softmax·V``), the head size is 16, 32 or 64 and the
sequence is at most 512 long (SM >= 75; notes: transformers.md). Outside those shapes the Q/DQ on the
matmuls only force reformatting around unfused matmuls (NVIDIA's ModelOpt drops them beyond 512; users find
such INT8 ViTs slower than FP16), so the four quantizers stay off there.

The head size and the sequence length are shapes, which placement (a trace, no data) does not know: they are
the ones calibration sees (:class:`~qdq.targets.target.AttentionFacts`; the longest query or key sequence of
any calibration batch). Calibrate on the sequence length you deploy with. LayerNorm, GELU and Softmax stay
float (TensorRT fuses them in higher precision): no rule adds a quantizer there.
"""

from __future__ import annotations

from qdq.graphs.ops import ATTENTION_SITES
from qdq.targets.target import AttentionFacts

__all__ = ["FUSED_HEAD_SIZES", "MAX_FUSED_LENGTH", "TENSORRT_ATTENTION"]

FUSED_HEAD_SIZES = (16, 32, 64)
MAX_FUSED_LENGTH = 512

TENSORRT_ATTENTION = AttentionFacts(
    quantized=ATTENTION_SITES,
    head_sizes=FUSED_HEAD_SIZES,
    max_length=MAX_FUSED_LENGTH,
    reason="TensorRT's fused int8 attention takes head sizes 16/32/64 and sequences up to 512; elsewhere Q/DQ "
    "on the attention matmuls only add reformatting",
)
