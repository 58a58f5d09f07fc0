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

from qdq.errors import QdqConfigError
from qdq.keras._backend import tf

__all__ = ["AMAX_EPSILON", "dynamic_amax", "fake_quant", "weight_amax"]

#: ranges below this are raised to it (a zero range has no step; such a tensor is all zeros anyway)
AMAX_EPSILON = 2.0**-24


def fake_quant(x: Any, amax: Any, num_bits: int = 8, axis: int | None = None, *, unsigned: bool = False) -> Any:
    """Quantize-dequantize ``x`` with range ``amax`` (scalar, or 1-D along non-negative ``axis``).

    ``unsigned`` (per tensor only): the grid ``step * [0, 2**num_bits - 1]`` with ``step = amax / (2**num_bits -
    1)``, negative values to 0; tf2onnx writes it as uint8 Q/DQ with zero point 0.

    Below 8 bits the values are first clipped to the ``num_bits`` levels, then quantized on the 8-bit grid of
    the same step: the same result, and the form ONNX has for it (``Clip -> QuantizeLinear -> DequantizeLinear``
    with that step, as the PyTorch export writes it; tf2onnx would otherwise give any width an 8-bit scale).
    """
    t = tf()
    if not 2 <= num_bits <= 8:
        raise QdqConfigError(f"qdq.keras quantizes to 2..8 bits (int8 / uint8 Q/DQ in ONNX), got num_bits={num_bits}.")
    dtype = x.dtype
    x32 = x if dtype == t.float32 else t.cast(x, t.float32)
    amax = t.maximum(t.cast(amax, t.float32), AMAX_EPSILON)
    low, high = (t.zeros_like(amax), amax) if unsigned else (-amax, amax)
    if num_bits < 8:
        x32, low, high = _on_the_8bit_grid(x32, amax, num_bits, axis, unsigned)
    if axis is None:
        y = t.quantization.quantize_and_dequantize_v2(
            x32, low, high, num_bits=8, signed_input=not unsigned, range_given=True, narrow_range=False
        )
    else:
        y = t.raw_ops.QuantizeAndDequantizeV3(
            input=x32, input_min=low, input_max=high, num_bits=t.constant(8), signed_input=True,
            range_given=True, narrow_range=False, axis=axis,
        )  # fmt: skip
    return y if dtype == t.float32 else t.cast(y, dtype)


def _on_the_8bit_grid(x: Any, amax: Any, num_bits: int, axis: int | None, unsigned: bool) -> tuple[Any, Any, Any]:
    """``x`` clipped to the ``num_bits`` levels of ``step = amax / qmax``, and the 8-bit range of that step.

    The 8-bit range's step must come out as ``step`` in TensorFlow and in tf2onnx, which both take
    ``max(low / -128, high / 127)``: ``low = -128 * step`` is exact, and ``high`` is put a few ulps below
    ``127 * step`` so that its side never wins by a rounding.
    """
    t = tf()
    qmax = 2**num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    qmin = 0 if unsigned else -qmax - 1
    step = amax / float(qmax)
    bound = step if axis is None else t.reshape(step, [-1 if d == axis else 1 for d in range(len(x.shape))])
    clipped = t.clip_by_value(x, float(qmin) * bound, float(qmax) * bound)
    if unsigned:
        return clipped, t.zeros_like(step), 255.0 * step
    return clipped, -128.0 * step, 127.0 * step * (1.0 - 2.0**-22)


def dense(x: Any) -> Any:
    """``x`` as a dense tensor (a ``tf.SparseTensor`` made dense; anything else as it is)."""
    t = tf()
    return t.sparse.to_dense(x) if isinstance(x, t.sparse.SparseTensor) else x


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
