"""Independent numpy oracle for qdq's quantization formula (ONNX QuantizeLinear/DequantizeLinear)."""

from __future__ import annotations

import numpy as np


def bounds(num_bits: int, unsigned: bool, narrow: bool) -> tuple[int, int]:
    qmax = 2 ** (num_bits - 1 + int(unsigned)) - 1
    if unsigned:
        return 0, qmax
    return (-qmax if narrow else -qmax - 1), qmax


def quant_np(x, amax, num_bits=8, unsigned=False, narrow=False):
    """Integer values (float32 array) and float32 step, computed in float32 with numpy."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.asarray(amax, dtype=np.float32)
    qmin, qmax = bounds(num_bits, unsigned, narrow)
    tiny = amax <= np.float32(2.0**-24)
    step = np.where(tiny, np.float32(1.0), amax / np.float32(qmax)).astype(np.float32)
    q = np.clip(np.rint(x / step), qmin, qmax).astype(np.float32)
    q = np.where(np.broadcast_to(tiny, q.shape), np.float32(0.0), q).astype(np.float32)
    return q, step


def fake_quant_np(x, amax, num_bits=8, unsigned=False, narrow=False):
    q, step = quant_np(x, amax, num_bits, unsigned, narrow)
    return (q * step).astype(np.float32)
