"""Quantization numerics: the one formula every other layer of qdq uses.

Conventions (read these once, they hold everywhere in qdq):

* ``amax`` is the clipping range: values in ``[-amax, amax]`` are representable (``[0, amax]`` when
  unsigned). Per-tensor amax is a scalar; per-channel amax has the input's rank with size 1 on every
  reduced axis (e.g. ``(C, 1, 1, 1)`` for a conv weight), so it broadcasts.
* ``max_bound = 2**(num_bits - 1 + unsigned) - 1``: 127 for int8, 255 for uint8.
* ``scale`` (as returned by :func:`tensor_quant`, the seed's name) is a **multiplier**:
  ``scale = max_bound / amax``, so ``q ≈ x * scale``.
* ``quant_step(amax)`` is the **step** between two adjacent quantized values, ``amax / max_bound``.
  It is the ``y_scale`` of ONNX ``QuantizeLinear`` / ``DequantizeLinear`` and TensorRT's scale.
* Range: signed values use the full two's-complement range ``[-max_bound - 1, max_bound]``
  (``[-128, 127]`` for int8) unless ``narrow_range=True`` (``[-127, 127]``). Full range is the default of
  every function, descriptor and quantizer in qdq, because it is what ONNX QuantizeLinear and
  TensorRT's explicit quantization compute; the seed trained narrow on CUDA and exported full, which
  made PyTorch and the engine disagree (TensorRT#3654).
* Arithmetic is exactly ONNX's: ``q = clamp(round_half_to_even(x / step), qmin, qmax)`` and the
  fake-quantized value is ``q * step``, both in float32. The division (not a multiplication by
  ``1/step``) matters: it is what ONNX Runtime's MLAS kernel computes, so an exported Q/DQ pair
  reproduces training bit for bit. (``torch.fake_quantize_per_tensor_affine`` multiplies by the
  reciprocal and differs from ONNX Runtime on about one element in a million.)
* The step is computed with a tensor divisor on every device (``amax / full_like(amax, max_bound)``):
  CUDA computes a division by a Python number as a multiplication by its reciprocal, which is one ulp
  off ONNX's ``y_scale`` for about 5 % of int8 ranges. The seed's ``scale`` is ``max_bound / amax``
  computed the same way.
* ``amax <= 2**-24`` (the smallest fp16 subnormal) quantizes everything to exact zeros; its step is 1.
* fp16 / bf16 inputs are computed in float32 and cast back to the input dtype.
* Unsigned quantization of a negative value gives 0, as ONNX's QuantizeLinear to uint8 does (the seed
  raised instead, which costs a device-to-host read on every call).
* Every function here computes on the device without reading values back to the host, so it never
  waits for a GPU. The work is one fused operator, :func:`qdq.ops.quantize` (a Triton kernel on CUDA).

Gradients are straight-through: ``d out / d x = 1`` where ``-amax <= x <= amax`` (``0 <= x <= amax``
unsigned), 0 elsewhere. No gradient flows to ``amax``; learnable ranges use :class:`qdq.nn.Clip`.
"""

from __future__ import annotations

import torch

from qdq import ops
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.validate import check_num_bits

__all__ = [
    "AMAX_EPSILON",
    "QuantDescriptor",
    "ScaledQuantDescriptor",
    "fake_tensor_quant",
    "low_precision_amax",
    "max_bound",
    "quant_bounds",
    "quant_scale",
    "quant_step",
    "tensor_quant",
]

#: amax at or below this quantizes to zeros (smallest fp16 subnormal, as in the seed).
AMAX_EPSILON = ops.AMAX_EPSILON


def max_bound(num_bits: int = 8, unsigned: bool = False) -> int:
    """Largest quantized value: ``2**(num_bits - 1 + unsigned) - 1`` (127 for int8, 255 for uint8)."""
    check_num_bits(num_bits)
    return (1 << (num_bits - 1 + int(unsigned))) - 1


def quant_bounds(num_bits: int = 8, unsigned: bool = False, narrow_range: bool = False) -> tuple[int, int]:
    """``(qmin, qmax)`` of the integer grid: int8 full range is (-128, 127), narrow (-127, 127), uint8 (0, 255)."""
    qmax = max_bound(num_bits, unsigned)
    if unsigned:
        return 0, qmax
    return (-qmax if narrow_range else -qmax - 1), qmax


def quant_step(amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False) -> torch.Tensor:
    """The quantization step ``amax / max_bound`` in float32: ONNX's ``y_scale``, TensorRT's scale.

    Computed as a correctly rounded float32 division on every device (equal to numpy's
    ``np.float32(amax) / np.float32(max_bound)``). Where ``amax <= AMAX_EPSILON`` the step is 1.0 (those
    channels quantize to zeros; 1 keeps an exported scale finite). Not to be confused with the seed's
    ``scale``, the reciprocal multiplier (:func:`quant_scale`).
    """
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    return ops.quant_step(amax_t, max_bound(num_bits, unsigned))


def low_precision_amax(
    amax: torch.Tensor | float, step_dtype: torch.dtype, num_bits: int = 8, unsigned: bool = False
) -> torch.Tensor:
    """The range nearest to ``amax`` whose step is a number of ``step_dtype`` (float16 or bfloat16), float32.

    ``step = quant_step(amax)`` is rounded to the nearest ``step_dtype`` number (ties to even, as every cast
    to float16 does) and multiplied back by ``max_bound``. The rounded step has at most 11 significant bits
    (bfloat16: 8), ``max_bound`` at most 8 for 8-bit grids, so the product is exact in float32 and
    ``quant_step`` of the result gives the rounded step back: a graph whose scales are in that type (TensorRT
    11's FP16 Q/DQ) quantizes exactly like this range. Relative change: at most 2**-11 of a normal float16
    step (2**-8 bfloat16). A step below float16's smallest subnormal (``amax < max_bound * 2**-25``) rounds to
    0: that range becomes 0 and quantizes to zeros, as ``amax <= 2**-24`` does. A step beyond the type's
    largest value (float16: ``amax > max_bound * 65504``) keeps ``amax``. Computed on ``amax``'s device,
    without reading it on the host.
    """
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    bound = torch.full_like(amax_t, max_bound(num_bits, unsigned))
    low = torch.div(amax_t, bound).to(step_dtype).float()
    return torch.where(torch.isinf(low), amax_t, low * bound)


def quant_scale(amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False) -> torch.Tensor:
    """The seed's multiplier ``max_bound / amax`` in float32, correctly rounded; 1.0 where ``amax <= AMAX_EPSILON``."""
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    tiny = amax_t <= AMAX_EPSILON
    bound = torch.full_like(amax_t, max_bound(num_bits, unsigned))
    return torch.where(tiny, torch.ones_like(amax_t), bound / torch.where(tiny, torch.ones_like(amax_t), amax_t))


def _check_amax_shape(inputs: torch.Tensor, amax: torch.Tensor) -> None:
    if amax.dim() > inputs.dim():
        raise QdqConfigError(
            f"amax of shape {tuple(amax.shape)} has more dimensions than the input {tuple(inputs.shape)}; "
            "per-channel amax must have the input's rank with size 1 on reduced axes, e.g. (C, 1, 1, 1)."
        )
    lead = inputs.dim() - amax.dim()
    for dim, size in enumerate(amax.shape):
        if size not in (1, inputs.shape[lead + dim]):
            raise QdqConfigError(
                f"amax of shape {tuple(amax.shape)} does not broadcast to the input {tuple(inputs.shape)} "
                f"(dimension {lead + dim}: {size} vs {inputs.shape[lead + dim]}). Per-channel amax keeps "
                "the channel axis and has size 1 elsewhere, e.g. (C, 1, 1, 1) for a conv weight."
            )


def _check_amax_values(amax: torch.Tensor) -> None:
    if amax.numel() == 0:
        raise QdqConfigError("amax is empty; calibrate the quantizer or set amax before quantizing.")
    if amax.device.type != "cpu":  # reading device values would wait for the device; quantizers check on set
        return
    if torch.isnan(amax).any():
        raise QdqConfigError("amax contains NaN; the calibration data or the stored range is corrupt.")
    if (amax < 0).any():
        raise QdqConfigError(f"amax must be non-negative, got a minimum of {amax.min().item():g}.")


def _prepare(inputs: torch.Tensor, amax: torch.Tensor | float, num_bits: int) -> torch.Tensor:
    """Validate the arguments; return amax as float32 on the input's device.

    Values of ``amax`` are checked when it is a number or a CPU tensor; a tensor on an accelerator is
    used as is (quantizers validate their ranges when they are set).
    """
    if not isinstance(inputs, torch.Tensor):
        raise QdqTypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}.")
    if not inputs.is_floating_point():
        raise QdqTypeError(f"inputs must be a floating-point tensor, got dtype {inputs.dtype}.")
    check_num_bits(num_bits)
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    _check_amax_shape(inputs, amax_t)
    _check_amax_values(amax_t)
    return amax_t.to(inputs.device)


def tensor_quant(
    inputs: torch.Tensor,
    amax: torch.Tensor | float,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``inputs`` to integers on the grid defined by ``amax``.

    Args:
        inputs: floating-point tensor (fp16/bf16 computed in float32).
        amax: clipping range, a scalar or a per-channel tensor broadcastable to ``inputs``.
        num_bits: 2 to 16.
        unsigned: quantize to ``[0, 2**num_bits - 1]``; negative values give 0.
        narrow_range: signed range ``[-max_bound, max_bound]`` instead of ``[-max_bound - 1, max_bound]``.

    Returns:
        ``(q, scale)``: ``q`` holds the integer values in ``inputs.dtype``; ``scale`` is the seed's
        multiplier ``max_bound / amax`` (1 where amax <= 2**-24), so ``q / scale`` dequantizes.

    Example:
        >>> torch.manual_seed(12345); x = torch.rand(10)
        >>> q, scale = tensor_quant(x, x.abs().max())
        >>> q.tolist()[:3], round(scale.item(), 4)
        ([126.0, 113.0, 127.0], 128.0057)
    """
    amax_t = _prepare(inputs, amax, num_bits)
    return tensor_quant_unchecked(inputs, amax_t, num_bits, unsigned, narrow_range)


def fake_tensor_quant(
    inputs: torch.Tensor,
    amax: torch.Tensor | float,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = False,
) -> torch.Tensor:
    """Quantize then dequantize: ``clamp(round(x / step), qmin, qmax) * step`` with ``step = amax / max_bound``.

    Same arguments as :func:`tensor_quant`. Returns a tensor of ``inputs``' dtype and shape holding values
    on the quantization grid, with straight-through gradients.
    """
    amax_t = _prepare(inputs, amax, num_bits)
    return fake_quant_unchecked(inputs, amax_t, num_bits, unsigned, narrow_range)


def fake_quant_unchecked(
    inputs: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> torch.Tensor:
    """:func:`fake_tensor_quant` without argument validation, for callers that validated once (quantizers)."""
    qmin, qmax = quant_bounds(num_bits, unsigned, narrow_range)
    return ops.quantize_ste(inputs, amax, qmin, qmax, True)


def tensor_quant_unchecked(
    inputs: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tensor_quant` without argument validation."""
    qmin, qmax = quant_bounds(num_bits, unsigned, narrow_range)
    q = ops.quantize_ste(inputs, amax, qmin, qmax, False)
    return q, quant_scale(amax, num_bits, unsigned).to(inputs.dtype)


# Re-exported here so that ``from qdq.tensor_quant import QuantDescriptor`` works as in the seed.
from qdq.descriptor import QuantDescriptor, ScaledQuantDescriptor  # noqa: E402
