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
* ``amax <= 2**-24`` (the smallest fp16 subnormal) quantizes everything to exact zeros.
* fp16 / bf16 inputs are computed in float32 and cast back to the input dtype.

Gradients are straight-through: ``d out / d x = 1`` where ``-amax <= x <= amax`` (``0 <= x <= amax``
unsigned), 0 elsewhere. No gradient flows to ``amax``; learnable ranges use :class:`qdq.nn.Clip`.
"""

from __future__ import annotations

import torch

from qdq.errors import QdqConfigError, QdqTypeError

__all__ = [
    "AMAX_EPSILON",
    "QuantDescriptor",
    "ScaledQuantDescriptor",
    "fake_tensor_quant",
    "max_bound",
    "quant_bounds",
    "quant_step",
    "tensor_quant",
]

#: amax at or below this quantizes to zeros (smallest fp16 subnormal, as in the seed).
AMAX_EPSILON = 2.0**-24

_MIN_BITS, _MAX_BITS = 2, 16
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def max_bound(num_bits: int = 8, unsigned: bool = False) -> int:
    """Largest quantized value: ``2**(num_bits - 1 + unsigned) - 1`` (127 for int8, 255 for uint8)."""
    _check_num_bits(num_bits)
    return (1 << (num_bits - 1 + int(unsigned))) - 1


def quant_bounds(num_bits: int = 8, unsigned: bool = False, narrow_range: bool = False) -> tuple[int, int]:
    """``(qmin, qmax)`` of the integer grid: int8 full range is (-128, 127), narrow (-127, 127), uint8 (0, 255)."""
    qmax = max_bound(num_bits, unsigned)
    if unsigned:
        return 0, qmax
    return (-qmax if narrow_range else -qmax - 1), qmax


def quant_step(amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False) -> torch.Tensor:
    """The quantization step ``amax / max_bound`` in float32: ONNX's ``y_scale``, TensorRT's scale.

    Not to be confused with the seed's ``scale``, which is the reciprocal multiplier.
    """
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    return amax_t.float() / max_bound(num_bits, unsigned)


def _check_num_bits(num_bits: object) -> None:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise QdqTypeError(
            f"num_bits must be an int between {_MIN_BITS} and {_MAX_BITS}, got {num_bits!r} "
            f"({type(num_bits).__name__}). FP8 (num_bits=(4, 3)) is not supported by qdq."
        )
    if not _MIN_BITS <= num_bits <= _MAX_BITS:
        raise QdqConfigError(
            f"num_bits={num_bits} is not supported: qdq quantizes to {_MIN_BITS}..{_MAX_BITS} bits."
        )


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
    amin = amax.min()
    if torch.isnan(amax).any():
        raise QdqConfigError("amax contains NaN; the calibration data or the stored range is corrupt.")
    if amin < 0:
        raise QdqConfigError(f"amax must be non-negative, got a minimum of {amin.item():g}.")


def _check_unsigned_input(inputs: torch.Tensor) -> None:
    if inputs.numel() and inputs.min() < 0:
        raise QdqConfigError(
            "Negative values encountered in unsigned quantization: the input has a minimum of "
            f"{inputs.min().item():g}. Use unsigned=False, or quantize a non-negative tensor (after ReLU)."
        )


def _prepare(
    inputs: torch.Tensor, amax: torch.Tensor | float, num_bits: int, unsigned: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate arguments; return float32 input and float32 amax on the input's device."""
    if not isinstance(inputs, torch.Tensor):
        raise QdqTypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}.")
    if not inputs.is_floating_point():
        raise QdqTypeError(f"inputs must be a floating-point tensor, got dtype {inputs.dtype}.")
    _check_num_bits(num_bits)
    amax_t = torch.as_tensor(amax, device=inputs.device).float()
    _check_amax_shape(inputs, amax_t)
    _check_amax_values(amax_t)
    if unsigned:
        _check_unsigned_input(inputs)
    return inputs.float(), amax_t


def _quantize_int(
    x: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer grid values (as float32) and the step, for float32 ``x`` and ``amax``. No checks."""
    qmin, qmax = quant_bounds(num_bits, unsigned, narrow_range)
    tiny = amax <= AMAX_EPSILON
    # Tiny channels get step 1 so the division stays finite; their output is zeroed below.
    step = torch.where(tiny, torch.ones_like(amax), amax / qmax)
    q = torch.div(x, step)
    q = q.clamp_(qmin, qmax).round_()
    if bool(tiny.any()):
        q = q.masked_fill_(tiny.expand_as(q), 0.0)
    return q, step


class _FakeQuant(torch.autograd.Function):
    """Fake quantization with the inclusive straight-through estimator."""

    @staticmethod
    def forward(ctx, inputs, amax, num_bits, unsigned, narrow_range):  # type: ignore[override]
        x, amax_f = inputs.float(), amax.float()
        q, step = _quantize_int(x, amax_f, num_bits, unsigned, narrow_range)
        out = q.mul_(step)
        ctx.mask = _ste_mask(x, amax_f, unsigned) if ctx.needs_input_grad[0] else None
        return out.to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        mask = ctx.mask
        if mask is None:
            return grad_output, None, None, None, None
        return grad_output * mask, None, None, None, None


class _TensorQuant(torch.autograd.Function):
    """Integer quantization; returns ``(q, scale)`` with the straight-through estimator on ``q``."""

    @staticmethod
    def forward(ctx, inputs, amax, num_bits, unsigned, narrow_range):  # type: ignore[override]
        x, amax_f = inputs.float(), amax.float()
        q, step = _quantize_int(x, amax_f, num_bits, unsigned, narrow_range)
        scale = torch.where(amax_f <= AMAX_EPSILON, torch.ones_like(step), max_bound(num_bits, unsigned) / amax_f)
        ctx.mask = _ste_mask(x, amax_f, unsigned) if ctx.needs_input_grad[0] else None
        ctx.mark_non_differentiable(scale)
        return q.to(inputs.dtype), scale.to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_q, grad_scale):  # type: ignore[override]
        mask = ctx.mask
        if mask is None:
            return grad_q, None, None, None, None
        return grad_q * mask, None, None, None, None


def _ste_mask(x: torch.Tensor, amax: torch.Tensor, unsigned: bool) -> torch.Tensor | None:
    """Boolean mask of ``-amax <= x <= amax``; None when every element is inside (identity gradient).

    The all-inside test costs one read of ``x`` (``aminmax``) and saves writing and applying a mask,
    which is the common case for weights.
    """
    lo, hi = torch.aminmax(x)
    if hi <= amax.min() and (unsigned or -lo <= amax.min()):
        return None
    if unsigned:
        return x <= amax
    return x.abs() <= amax


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
        unsigned: quantize to ``[0, 2**num_bits - 1]``; negative input is an error.
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
    _, amax_t = _prepare(inputs, amax, num_bits, unsigned)
    return _TensorQuant.apply(inputs, amax_t, num_bits, unsigned, narrow_range)


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
    _, amax_t = _prepare(inputs, amax, num_bits, unsigned)
    return _FakeQuant.apply(inputs, amax_t, num_bits, unsigned, narrow_range)


def fake_quant_unchecked(
    inputs: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> torch.Tensor:
    """:func:`fake_tensor_quant` without argument validation, for callers that validated once (quantizers)."""
    return _FakeQuant.apply(inputs, amax, num_bits, unsigned, narrow_range)


def tensor_quant_unchecked(
    inputs: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tensor_quant` without argument validation."""
    return _TensorQuant.apply(inputs, amax, num_bits, unsigned, narrow_range)


def is_finite_amax(amax: torch.Tensor) -> bool:
    """True when every entry of ``amax`` is a finite, non-negative number."""
    return bool(torch.isfinite(amax).all()) and bool((amax >= 0).all())


# Re-exported here so that ``from qdq.tensor_quant import QuantDescriptor`` works as in the seed.
from qdq.descriptor import QuantDescriptor, ScaledQuantDescriptor  # noqa: E402
