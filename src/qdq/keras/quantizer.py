"""The fake-quant op of the Keras front end: symmetric signed integers, zero point 0, TensorRT style.

``fake_quant(x, amax, num_bits, axis)`` rounds ``x`` to the grid ``step * [qmin, qmax]`` with ``step =
amax / qmax`` (``qmax = 2**(num_bits-1) - 1``, ``qmin = -qmax - 1``: the full range, like the PyTorch
path, ONNX's QuantizeLinear and TensorRT) and returns the dequantized values. ``amax`` is the clipping
range in data units: a scalar, or one value per channel along ``axis``.

It is TensorFlow's ``QuantizeAndDequantize`` kernel: one fused pass, straight-through gradient, and the
op tf2onnx turns into ``QuantizeLinear -> DequantizeLinear`` with ``y_scale = amax / qmax`` (float32).
Per tensor it is ``QuantizeAndDequantizeV4`` (gradient zero outside the range); per channel
``QuantizeAndDequantizeV3``, because V2/V4 per channel fail at run time since TF 2.16 ("input_min must
be a scalar"); V3's gradient passes everything, which is what weights (their own range) need.

TensorFlow multiplies by ``qmax / amax`` where ONNX Runtime divides by the step, so a value within a
float32 rounding of a half-step boundary may round to the neighbouring level in one of them: the Keras
model and the ONNX engine agree to one step, on about 1e-6 of the values (the PyTorch path divides and
agrees bit for bit).
"""

from __future__ import annotations

from typing import Any

from qdq.keras._backend import tf

__all__ = ["AMAX_EPSILON", "dynamic_amax", "fake_quant", "weight_amax"]

#: ranges below this are raised to it (a zero range has no step; such a tensor is all zeros anyway)
AMAX_EPSILON = 2.0**-24


def fake_quant(x: Any, amax: Any, num_bits: int = 8, axis: int | None = None, *, unsigned: bool = False) -> Any:
    """Quantize-dequantize ``x`` with range ``amax`` (scalar, or 1-D along non-negative ``axis``).

    ``unsigned`` (per tensor only): the grid ``step * [0, 2**num_bits - 1]`` with ``step = amax / (2**num_bits -
    1)``, negative values to 0; tf2onnx writes it as uint8 Q/DQ with zero point 0.
    """
    t = tf()
    dtype = x.dtype
    x32 = x if dtype == t.float32 else t.cast(x, t.float32)
    amax = t.maximum(t.cast(amax, t.float32), AMAX_EPSILON)
    if axis is None:
        low = t.zeros_like(amax) if unsigned else -amax
        y = t.quantization.quantize_and_dequantize_v2(
            x32, low, amax, num_bits=num_bits, signed_input=not unsigned, range_given=True, narrow_range=False
        )
    else:
        y = t.raw_ops.QuantizeAndDequantizeV3(
            input=x32, input_min=-amax, input_max=amax, num_bits=t.constant(num_bits), signed_input=True,
            range_given=True, narrow_range=False, axis=axis,
        )  # fmt: skip
    return y if dtype == t.float32 else t.cast(y, dtype)


def dynamic_amax(x: Any, unsigned: bool = False) -> Any:
    """``max|x|`` (``max(x, 0)`` if ``unsigned``) of this batch, without gradient (an uncalibrated range)."""
    t = tf()
    x = t.cast(x, t.float32)
    return t.stop_gradient(t.reduce_max(t.nn.relu(x) if unsigned else t.abs(x)))


def weight_amax(kernel: Any, axis: int) -> Any:
    """``max|w|`` per channel along ``axis`` (the range of a per-channel weight; max calibration)."""
    t = tf()
    axes = [d for d in range(len(kernel.shape)) if d != axis]
    return t.stop_gradient(t.reduce_max(t.abs(t.cast(kernel, t.float32)), axis=axes))
