"""The fused quantization operator, ``torch.ops.qdq.quantize``, and its straight-through gradient.

``quantize(x, amax, qmin, qmax, dequantize)`` computes, in float32 and returning ``x``'s dtype::

    step = amax / qmax                       # a true division by a tensor, 1 where amax <= 2**-24
    q    = clamp(round_half_to_even(x / step), qmin, qmax)
    out  = q * step if dequantize else q     # 0 where amax <= 2**-24

``qmax`` is the grid's ``max_bound`` (127 for int8, 255 for uint8), so ``step`` is ONNX's ``y_scale``;
``amax`` broadcasts against ``x`` (a scalar, or keepdims per-channel). Its gradient is
``grad * (lo <= x <= amax)`` with ``lo = -amax`` (signed, ``qmin < 0``) or ``0`` (unsigned).

Both are ``torch.library`` custom operators with a fake (meta) implementation and a registered
autograd formula, so ``torch.compile`` traces a quantized model without graph breaks and nothing here
reads a device value on the host. Callers use :func:`quantize_ste`, which is the operator when traced and
calls the same kernels without the operator's dispatch in eager mode. Kernels:

* CPU, and any device without another kernel: ATen operations (five passes over ``x`` forward, three
  backward).
* CUDA: one Triton kernel per direction (:mod:`qdq.triton_kernels`) when triton is installed and the
  layout is simple (dense ``x``; per tensor, or ``amax`` varying along one axis of a contiguous ``x``);
  the ATen operations otherwise. Both compute the same bits.

Importing this module registers the operators (once per process); ``import qdq`` does not import it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

__all__ = ["AMAX_EPSILON", "quant_step", "quantize", "quantize_grad", "quantize_ste", "round_to_grid"]

#: amax at or below this quantizes to exact zeros (the smallest fp16 subnormal, as in the seed).
AMAX_EPSILON = 2.0**-24
_MAX_TRITON_ELEMENTS = 2**31 - 1  # int32 offsets inside the kernels


# -- ATen implementation ------------------------------------------------------------------------------


def quant_step(amax: torch.Tensor, max_bound: int) -> torch.Tensor:
    """``amax / max_bound`` as a correctly rounded float32 division on every device; 1 where ``amax`` is tiny.

    This is the one place qdq turns a range into a step (ONNX's ``y_scale``). The divisor is a tensor:
    CUDA computes a division by a Python number as a multiplication by its reciprocal, one ulp off for
    a few percent of ranges.
    """
    return _step_and_tiny(amax, max_bound)[0]


def _step_and_tiny(amax: torch.Tensor, max_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_step` and the mask of tiny ranges (``amax <= AMAX_EPSILON``) it set to 1."""
    amax = amax.float()
    tiny = amax <= AMAX_EPSILON
    return torch.div(amax, torch.full_like(amax, max_bound)).masked_fill_(tiny, 1.0), tiny


_ROUNDER = 1.5 * 2.0**23


def round_to_grid(x: torch.Tensor, step: torch.Tensor, qmin: int, qmax: int, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``clamp(round_half_to_even(x / step), qmin, qmax)`` as a new float32 tensor (or into ``out``, a float32 tensor
    of the broadcast shape): ONNX's QuantizeLinear with zero point 0, for any ``step`` broadcastable to ``x``.
    Multiply by ``step`` to dequantize.

    Rounding adds and subtracts ``1.5 * 2**23`` after the clamp: every value is then within
    ``[-2**15, 2**15]``, where the float32 addition itself rounds to the nearest integer, ties to even
    (zero comes out as +0, as from QuantizeLinear). The Triton kernels round the same way. On the CPU
    it also avoids ``round_``, whose kernel opens a parallel region from a few thousand elements, which
    can stall for a scheduler tick on a busy 2-core machine. (``addcdiv`` would fold the division and
    the addition into one pass, but its CPU kernel does not vectorise a broadcast scalar step: several times
    slower, benchmarks/RESULTS.md, code_figures.)
    """
    return torch.div(x.float(), step.float(), out=out).clamp_(qmin, qmax).add_(_ROUNDER).sub_(_ROUNDER)


def _quantize_aten(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
    step, tiny = _step_and_tiny(amax, qmax)
    q = round_to_grid(x, step, qmin, qmax)
    # Multiplying by 0 (rather than masking) zeroes tiny channels without testing whether there are any.
    q = q.mul_(step.masked_fill(tiny, 0.0) if dequantize else tiny.logical_not().float())
    return q.to(x.dtype)


def _quantize_grad_aten(grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, unsigned: bool) -> torch.Tensor:
    amax = amax.to(x.dtype) if x.dtype == torch.float64 else amax.float()
    # Compared in amax's precision, as the forward clamps: a 0-d float32 amax beside bfloat16/float16 data
    # would otherwise be rounded to the data's type first (type promotion) and move the edge of the range.
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    # In-place comparisons on a float copy write 1.0 / 0.0 and vectorise on CPU (faster than a bool mask and
    # torch.where: benchmarks/RESULTS.md, code_figures); the product zeroes the gradient outside the range.
    inside = x.clone().ge_(0.0).mul_(x.clone().le_(amax)) if unsigned else x.abs().le_(amax)
    return inside.mul_(grad) if inside.dtype == grad.dtype else inside.to(grad.dtype).mul_(grad)


# -- Triton dispatch ----------------------------------------------------------------------------------


@functools.cache
def _triton_module() -> Any:
    """:mod:`qdq.triton_kernels`, or None when triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("qdq.triton_kernels")


def _dense(x: torch.Tensor) -> bool:
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))


def _triton_layout(x: torch.Tensor, amax: torch.Tensor) -> int | None:
    """Elements per channel block (``inner``) for the Triton kernels, or None for the ATen path.

    Per tensor, any dense layout works (every element uses the same range). Per channel, ``x`` must be
    contiguous and ``amax`` vary along at most one axis.
    """
    n = x.numel()
    if n > _MAX_TRITON_ELEMENTS or x.dtype == torch.float64 or not _dense(x):
        return None
    if amax.numel() == 1:
        return max(n, 1)
    if amax.dim() > x.dim() or not x.is_contiguous():
        return None
    shape = [1] * (x.dim() - amax.dim()) + list(amax.shape)
    varying = [d for d, size in enumerate(shape) if size != 1]
    if len(varying) != 1 or shape[varying[0]] != x.shape[varying[0]]:
        return None
    return math.prod(x.shape[varying[0] + 1 :])


# -- kernels: the device's implementation, shared by the operators and the eager path ------------------


def _triton_for(x: torch.Tensor, amax: torch.Tensor) -> tuple[Any, int] | None:
    """:mod:`qdq.triton_kernels` and the ``inner`` block size for ``x`` on CUDA, or None for the ATen path (also
    where ``amax`` lives on another device: ATen reads a 0-d CPU range beside CUDA data, Triton cannot)."""
    if not x.is_cuda:
        return None
    kernels = _triton_module()
    inner = None if kernels is None or amax.device != x.device else _triton_layout(x, amax)
    return None if inner is None else (kernels, inner)


def _quantize_kernel(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
    """Triton on CUDA where the layout allows (:func:`_triton_layout`), ATen otherwise; the same bits."""
    triton = _triton_for(x, amax)
    if triton is None:
        return _quantize_aten(x, amax, qmin, qmax, dequantize)
    kernels, inner = triton
    return kernels.quantize_triton(x, amax.float().contiguous(), inner, qmin, qmax, dequantize)


def _quantize_grad_kernel(grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, unsigned: bool) -> torch.Tensor:
    triton = None if grad.stride() != x.stride() or grad.dtype == torch.float64 else _triton_for(x, amax)
    if triton is None:
        return _quantize_grad_aten(grad, x, amax, unsigned)
    kernels, inner = triton
    return kernels.quantize_backward_triton(grad, x, amax.float().contiguous(), inner, unsigned)


# -- operators ----------------------------------------------------------------------------------------


@torch.library.custom_op("qdq::quantize", mutates_args=())
def quantize(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
    """Quantize ``x`` to the integer grid ``[qmin, qmax]`` of range ``amax`` (see the module docstring)."""
    return _quantize_kernel(x, amax, qmin, qmax, dequantize)


@quantize.register_fake
def _quantize_fake(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("qdq::quantize_grad", mutates_args=())
def quantize_grad(grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, unsigned: bool) -> torch.Tensor:
    """Straight-through gradient of :func:`quantize`: ``grad`` inside the range, 0 outside."""
    return _quantize_grad_kernel(grad, x, amax, unsigned)


@quantize_grad.register_fake
def _quantize_grad_fake(grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, unsigned: bool) -> torch.Tensor:
    return torch.empty_like(grad)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, amax, qmin, _, _ = inputs
    ctx.save_for_backward(x, amax)
    ctx.unsigned = qmin == 0


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, amax = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    # Traced (torch.compile): on CUDA the Triton kernel as one opaque op; on the CPU the ATen formula,
    # which the compiler fuses with its neighbours.
    grad_fn = quantize_grad if x.is_cuda else _quantize_grad_aten
    return grad_fn(grad, x, amax, ctx.unsigned), None, None, None, None


quantize.register_autograd(_backward, setup_context=_setup_context)


# -- the entry point ----------------------------------------------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """:func:`quantize` and its gradient in eager mode: the same kernels, without the custom-op dispatch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
        out = _quantize_kernel(x, amax, qmin, qmax, dequantize)
        _setup_context(ctx, (x, amax, qmin, qmax, dequantize), out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, amax = ctx.saved_tensors
        return _quantize_grad_kernel(grad, x, amax, ctx.unsigned), None, None, None, None


def quantize_ste(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int, dequantize: bool) -> torch.Tensor:
    """:func:`quantize` with its straight-through gradient: what every caller in qdq uses.

    Traced by ``torch.compile``, it is the custom operator (one node, no graph break). In eager mode it
    calls the same kernels through a plain ``autograd.Function``, or directly when no gradient is needed:
    the custom-op dispatch costs host time per call with autograd (benchmarks/RESULTS.md, code_figures),
    which on a GPU is time the host is not queuing kernels.
    """
    if torch.compiler.is_compiling():
        return quantize(x, amax, qmin, qmax, dequantize)
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, amax, qmin, qmax, dequantize)
    return _quantize_kernel(x, amax, qmin, qmax, dequantize)
