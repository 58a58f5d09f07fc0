"""Triton kernels of the fused quantization operators and of calibration's histograms (CUDA; importing this module
imports triton).

One pass over the data each: the forward reads ``x`` and writes the (fake-)quantized values; the
backward reads the upstream gradient and ``x`` and writes the straight-through gradient. The per-channel
range is found from the flat element index (``channel = (i // inner) % C``), so there is no broadcast
copy of ``amax``. The arithmetic is the one of :mod:`qdq.ops` (and of ONNX's QuantizeLinear):

* ``step = amax / qmax`` and ``x / step`` are correctly rounded IEEE divisions (``div_rn``), never a
  multiplication by a reciprocal;
* rounding is half to even, done by adding and subtracting ``1.5 * 2**23`` after the clamp: every value
  is then within ``[-2**15, 2**15]``, where the float32 addition itself rounds to the nearest integer,
  ties to even (this also runs under ``TRITON_INTERPRET=1``, which has no ``libdevice.rint``);
* NaN propagates through the clamp, as in ``torch.clamp``.

The histogram (:func:`histogram_triton`) bins a whole tensor in one launch, with the bin index of
:mod:`qdq.calib.binning` (``floor(fl32(m * scale))``, exact: ``scale`` is a power of two).

The launchers accept any tensors Triton can address: CUDA tensors, or CPU tensors under the Triton
interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which the tests use to check
the kernels bit for bit against the ATen implementation on machines without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["histogram_triton", "quantize_backward_triton", "quantize_triton"]

_BLOCK = 1024
# Globals a kernel reads must be tl.constexpr: the compiler refuses plain Python globals (the interpreter
# does not, so only a compilation catches it: tests/test_ops.py compiles the kernels for sm_90 on any machine).
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23
_AMAX_EPSILON = tl.constexpr(2.0**-24)  # qdq.tensor_quant.AMAX_EPSILON (kept literal: the kernel needs a constant)


@triton.jit
def _channel_amax(amax_ptr, offs, mask, inner, channels, PER_TENSOR: tl.constexpr):
    # One return of either shape: a constexpr branch compiles only the taken side (two returns must agree).
    if PER_TENSOR:
        amax = tl.load(amax_ptr).to(tl.float32)
    else:
        amax = tl.load(amax_ptr + (offs // inner) % channels, mask=mask, other=1.0).to(tl.float32)
    return amax


@triton.jit
def _quantize_kernel(
    x_ptr,
    amax_ptr,
    out_ptr,
    n,
    inner,
    channels,
    qmin,
    qmax,
    PER_TENSOR: tl.constexpr,
    DEQUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = _channel_amax(amax_ptr, offs, mask, inner, channels, PER_TENSOR)
    tiny = amax <= _AMAX_EPSILON
    step = tl.where(tiny, 1.0, tl.math.div_rn(amax, tl.zeros_like(amax) + qmax))
    v = tl.math.div_rn(x, step)
    v = tl.minimum(tl.maximum(v, qmin, propagate_nan=tl.PropagateNan.ALL), qmax, propagate_nan=tl.PropagateNan.ALL)
    v = (v + _ROUNDER) - _ROUNDER
    if DEQUANTIZE:
        v = v * step
    out = tl.where(tiny, 0.0, v)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _quantize_backward_kernel(
    grad_ptr,
    x_ptr,
    amax_ptr,
    out_ptr,
    n,
    inner,
    channels,
    PER_TENSOR: tl.constexpr,
    UNSIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = _channel_amax(amax_ptr, offs, mask, inner, channels, PER_TENSOR)
    if UNSIGNED:
        inside = (x >= 0.0) & (x <= amax)
    else:
        inside = (x >= -amax) & (x <= amax)
    tl.store(out_ptr + offs, tl.where(inside, grad, tl.zeros_like(grad)), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def quantize_triton(
    x: torch.Tensor,
    amax: torch.Tensor,
    inner: int,
    qmin: int,
    qmax: int,
    dequantize: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused quantization of dense ``x`` with ``amax`` flattened to ``(C,)`` (``C = 1``: per tensor).

    Element ``i`` of ``x``'s storage uses ``amax[(i // inner) % C]``. The output has ``x``'s memory
    format and dtype (or ``out_dtype``: the tests read the float32 result of a bf16 input this way,
    because the interpreter's float downcast truncates instead of rounding to nearest even).
    """
    out = torch.empty_like(x, dtype=out_dtype)
    n = x.numel()
    if n:
        channels = amax.numel()
        _quantize_kernel[_grid(n)](
            x, amax, out, n, inner, channels, float(qmin), float(qmax),
            PER_TENSOR=channels == 1, DEQUANTIZE=dequantize, BLOCK=_BLOCK,
        )  # fmt: skip
    return out


def quantize_backward_triton(
    grad: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, inner: int, unsigned: bool
) -> torch.Tensor:
    """Straight-through gradient: ``grad`` where ``-amax <= x <= amax`` (``0 <= x`` unsigned), else 0."""
    out = torch.empty_like(grad)
    n = x.numel()
    if n:
        channels = amax.numel()
        _quantize_backward_kernel[_grid(n)](
            grad, x, amax, out, n, inner, channels, PER_TENSOR=channels == 1, UNSIGNED=unsigned, BLOCK=_BLOCK
        )
    return out


# -- histograms of magnitudes (qdq.calib.binning) --------------------------------------------------------------------


@triton.jit
def _histogram_kernel(
    x_ptr,
    scale_ptr,
    counts_ptr,
    n,
    NUM_BINS: tl.constexpr,
    UNSIGNED: tl.constexpr,
    COUNT_ZEROS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A persistent program strides over the data and counts into its own row of counts_ptr: atomics on a row
    # only one program writes (in L2) contend far less than on one shared row, and the rows are summed after.
    pid = tl.program_id(0)
    row = counts_ptr + pid * NUM_BINS
    scale = tl.load(scale_ptr)
    zeros = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        mag = x if UNSIGNED else tl.abs(x)
        counted = inside & (mag > 0.0)  # not NaN, not zero (nor negative, unsigned)
        index = tl.minimum(tl.floor(mag * scale), NUM_BINS - 1.0)
        tl.atomic_add(row + tl.where(counted, index, 0.0).to(tl.int32), 1, mask=counted, sem="relaxed")
        if COUNT_ZEROS:
            zeros += (inside & (mag <= 0.0)).to(tl.int32)
    if COUNT_ZEROS:
        tl.atomic_add(row, tl.sum(zeros), sem="relaxed")


_HISTOGRAM_BLOCK = 1024
_PROGRAMS_PER_SM = 4
#: elements per launch of the histogram kernel: its offsets are int32
HISTOGRAM_CHUNK = 1 << 30


@functools.cache
def _histogram_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count * _PROGRAMS_PER_SM


def histogram_triton(
    flat: torch.Tensor, scale: torch.Tensor, num_bins: int, unsigned: bool, count_zeros: bool
) -> torch.Tensor:
    """Counts (int64, ``(num_bins,)``) of the bin indices ``min(floor(fl32(m * scale)), num_bins - 1)`` of the
    magnitudes ``m`` (``x`` unsigned, ``|x|`` signed) of a flat float tensor of at most :data:`HISTOGRAM_CHUNK`
    elements, in one launch. ``m <= 0`` goes to bin 0 with ``count_zeros``, nowhere without; NaN goes nowhere.
    ``num_bins`` is a power of two and ``scale`` a float32 scalar tensor on ``flat``'s device."""
    n = flat.numel()
    programs = max(1, min(triton.cdiv(n, _HISTOGRAM_BLOCK), _histogram_programs(flat.device)))
    counts = torch.zeros(programs, num_bins, dtype=torch.int32, device=flat.device)
    _histogram_kernel[(programs,)](
        flat, scale.reshape(1), counts, n,
        NUM_BINS=num_bins, UNSIGNED=unsigned, COUNT_ZEROS=count_zeros, BLOCK=_HISTOGRAM_BLOCK,
    )  # fmt: skip
    return counts.sum(0, dtype=torch.int64)
