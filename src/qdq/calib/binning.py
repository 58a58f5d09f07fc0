"""Power-of-two histograms of magnitudes: exact to merge, re-bin and all-reduce.

Each channel has ``num_bins`` equal bins covering ``[0, 2**k)``, where the *range exponent* ``k`` is
the smallest integer with ``max|x| < 2**k`` over everything the channel has seen. The bin of a
magnitude ``m`` is ``floor(fl32(m * num_bins * 2**-k))``: one float32 product, truncated.

Why this layout (the seed instead fixes the bin width from the first batch and appends bins):

* **Order independence.** The final range depends only on the overall max, never on which batch came
  first, so the histogram of a set of batches does not depend on their order or on how they were
  split between calibrators, processes or machines.
* **Exact re-binning.** Doubling the range ``m`` times maps bin ``j`` to bin ``j >> m``. Scaling a
  float by a power of two is exact, so ``fl(m * c * 2**-s) == fl(m * c) * 2**-s`` and
  ``floor(floor(z) / 2**s) == floor(z / 2**s)``: re-binning old counts gives exactly the counts the
  data would have had if it had been histogrammed at the larger range in the first place. Counts
  are int64 (no float32 saturation at 2**24), so merging is exact integer addition.
* **Bounded size.** The bin count never changes; a larger later batch coarsens the bins instead.

The price: the data max lies in the upper half of the range, so 1/2 to all of the bins are used
(>= 2048 of the default 4096). Magnitudes below ``2**MIN_EXPONENT`` (about 8e-31) share bin 0 with zero; an
all-zero channel keeps ``k = MIN_EXPONENT`` until it sees a non-zero value.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from .base import ChannelLayout

__all__ = ["MIN_EXPONENT", "bin_width", "histogram", "range_exponent", "rebin"]

#: lowest range exponent: everything below 2**MIN_EXPONENT lands in bin 0
MIN_EXPONENT = -100
#: elements histogrammed per chunk on CPU: bounds temporary memory, and stays below torch's 32768-element
#: parallel grain, so the elementwise ops run inline (a parallel region on a busy 2-core machine can
#: stall for a scheduler tick; the single-threaded pass costs a few ns per value)
_CHUNK = 32_000
#: elements per chunk on accelerators, where each chunk costs kernel launches instead
_DEVICE_CHUNK = 1 << 22


def range_exponent(max_mag: torch.Tensor) -> torch.Tensor:
    """Smallest ``k >= MIN_EXPONENT`` with ``max_mag < 2**k``, elementwise (int64)."""
    exponent = torch.frexp(max_mag).exponent.to(torch.int64)  # max_mag = f * 2**e with f in [0.5, 1)
    exponent = torch.where(max_mag > 0, exponent, torch.full_like(exponent, MIN_EXPONENT))
    return exponent.clamp_(min=MIN_EXPONENT)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**exponent`` in float64, built from the IEEE bit pattern (device independent)."""
    return ((exponent + 1023) << 52).view(torch.float64)


def bin_width(exponent: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Bin width ``2**k / num_bins`` per channel (float64)."""
    return _pow2(exponent) / num_bins


def rebin(counts: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Re-bin ``counts`` (C, n) to ranges ``2**shift`` times larger per channel (exact, int64).

    Always a scatter over the ``C * n`` counts (``shift = 0`` maps every bin to itself): testing first
    whether any channel grew would read a device value on the host.
    """
    n = counts.shape[1]
    target = torch.arange(n, device=counts.device) >> shift.clamp(0, 62)[:, None]
    return torch.zeros_like(counts).scatter_add_(1, target, counts)


def histogram(
    x: torch.Tensor,
    exponent: torch.Tensor,
    layout: ChannelLayout,
    num_bins: int,
    *,
    unsigned: bool,
    skip_zeros: bool,
) -> torch.Tensor:
    """Histogram the magnitudes of float32 ``x`` at range ``2**exponent`` per channel.

    Args:
        x: float32 data, every magnitude below ``2**exponent`` of its channel.
        exponent: int64 range exponents, shape ``(C,)``.
        layout: the channel layout of ``x``.
        num_bins: bins per channel.
        unsigned: histogram ``max(x, 0)`` instead of ``|x|``.
        skip_zeros: leave out elements whose magnitude is exactly 0.

    Returns:
        int64 counts of shape ``(C, num_bins)`` on ``x``'s device.
    """
    channels = layout.num_channels
    stride = num_bins + int(skip_zeros)  # with skip_zeros, zeros go to an extra bin that is dropped
    bshape = layout.shape if layout.rank is not None else ()
    scale = (_pow2(-exponent.to(x.device)) * num_bins).float().reshape(bshape)
    kernel = _per_tensor_kernel(x, channels, num_bins)
    if kernel is not None:
        return kernel(x, scale.reshape(()), num_bins, unsigned=unsigned, skip_zeros=skip_zeros)
    offsets = None
    if channels > 1:
        offsets = (torch.arange(channels, device=x.device) * stride).reshape(bshape)
    counts = torch.zeros(channels * stride, dtype=torch.int64, device=x.device)
    chunk_size = _CHUNK if x.device.type == "cpu" else _DEVICE_CHUNK
    ones = torch.ones(min(chunk_size, x.numel()), dtype=torch.int64, device=x.device)
    for chunk, chunk_scale, chunk_offsets in _chunks(x, layout, scale, offsets, chunk_size):
        mag = chunk.clamp(min=0) if unsigned else chunk.abs()
        # truncation == floor for magnitudes >= 0; the clamp only acts on NaN/Inf data (reported later)
        idx = mag.mul_(chunk_scale).to(torch.int64).clamp_(0, num_bins - 1)
        if skip_zeros:
            idx.masked_fill_(mag == 0, num_bins)
        if chunk_offsets is not None:
            idx.add_(chunk_offsets)
        # scatter_add_ touches only the chunk's bins (bincount would zero and add all C * n of them)
        counts.scatter_add_(0, idx.reshape(-1), ones[: idx.numel()])
    return counts.view(channels, stride)[:, :num_bins].contiguous()


def _per_tensor_kernel(x: torch.Tensor, channels: int, num_bins: int) -> Any:
    """The kernel of a per-tensor histogram, or None for the per-channel scatter (one offset per channel).

    On the CPU ``torch.bincount`` of int32 indices. With power-of-two bins on CUDA, one Triton kernel where triton
    is installed, else ``torch.histc`` on any accelerator. Both count in memory private to a block or program
    where ``scatter_add_`` or ``bincount`` would make every element an atomic add on a few global bins (half the
    elements of a post-ReLU tensor on bin 0).
    """
    if channels != 1:
        return None
    if x.device.type == "cpu":
        return _histogram_bincount
    if num_bins & (num_bins - 1):
        return None
    if x.device.type == "cuda" and _triton_kernels() is not None:
        return _histogram_triton
    return _histogram_histc


def _triton_kernels() -> Any:
    """:mod:`qdq.triton_kernels` where triton is installed (imported on first use), else None."""
    from .. import ops

    return ops._triton_module()


def _histogram_triton(
    x: torch.Tensor, scale: torch.Tensor, num_bins: int, *, unsigned: bool, skip_zeros: bool
) -> torch.Tensor:
    """Per-tensor histogram in one Triton launch (:func:`qdq.triton_kernels.histogram_triton`) per ``2**30``
    elements, equal bit for bit to the ``scatter_add_`` path. One kernel where the histc path makes ten per
    ``2**22`` elements: calibration on a GPU is bound by launches (benchmarks/RESULTS.md, gpu_histogram)."""
    kernels = _triton_kernels()
    flat = x.reshape(-1)
    step = kernels.HISTOGRAM_CHUNK
    counts = sum(
        kernels.histogram_triton(flat[start : start + step], scale, num_bins, unsigned, not skip_zeros)
        for start in range(0, flat.numel(), step)
    )
    return counts.view(1, num_bins)


def _histogram_bincount(
    x: torch.Tensor, scale: torch.Tensor, num_bins: int, *, unsigned: bool, skip_zeros: bool
) -> torch.Tensor:
    """Per-tensor histogram on the CPU: the bin index ``floor(fl32(m * scale))`` as int32 (truncation), then
    ``torch.bincount`` (faster on the CPU than ``histc`` and ``scatter_add_``: benchmarks/RESULTS.md,
    code_figures). Indices are clamped to ``[0, num_bins - 1]`` (only NaN/Inf, reported later, fall
    outside); excluded zeros (``skip_zeros``) go to an extra bin that is dropped. ``torch.bincount`` reads
    the largest index on the host to size its output: free on the CPU, which is why accelerators use histc."""
    counts = torch.zeros(num_bins + 1, dtype=torch.int64)
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), _DEVICE_CHUNK):
        chunk = flat[start : start + _DEVICE_CHUNK]
        # unsigned: a negative value truncates to a bin <= 0 and the clamp puts it in bin 0, where
        # clamping it to zero first would have put it; no separate clamp pass
        scaled = chunk.mul(scale) if unsigned else chunk.abs().mul_(scale)
        index = scaled.to(torch.int32).clamp_(0, num_bins - 1)
        if skip_zeros:
            index.masked_fill_(chunk <= 0 if unsigned else chunk == 0, num_bins)
        counts += torch.bincount(index, minlength=num_bins + 1)
    return counts[:num_bins].reshape(1, num_bins)


def _histogram_histc(
    x: torch.Tensor, scale: torch.Tensor, num_bins: int, *, unsigned: bool, skip_zeros: bool
) -> torch.Tensor:
    """Per-tensor histogram with ``torch.histc``, equal bit for bit to the ``scatter_add_`` path.

    The bin index ``floor(fl32(m * scale))`` is computed as a float32 integer ``v``; ``histc`` with
    ``min=0, max=num_bins, bins=num_bins`` puts ``v`` in bin ``(v - 0) * num_bins / num_bins``, exact in
    float32 for a power-of-two ``num_bins``. Its float32 counts are exact integers because a chunk holds
    at most ``2**24`` elements. Values outside ``[0, num_bins]`` and NaN (bad data, reported later) are
    left out.

    Zeros are moved to -1 (out of range) and counted by a sum instead: histc adds each element to its bin
    with a shared-memory atomic, and the zeros of a post-ReLU tensor (half of it) all hit bin 0, which
    serialises the warps (most of a GPU's histogram calibration pass went to histc before this:
    benchmarks/RESULTS.md, gpu_qat).
    """
    counts = torch.zeros(num_bins, dtype=torch.int64, device=x.device)
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), _DEVICE_CHUNK):
        chunk = flat[start : start + _DEVICE_CHUNK]
        mag = chunk.clamp(min=0) if unsigned else chunk.abs()
        v = mag.mul(scale).floor_().clamp_(max=num_bins - 1)
        zeros = mag == 0
        v.masked_fill_(zeros, -1.0)
        counts += torch.histc(v, bins=num_bins, min=0, max=num_bins).to(torch.int64)
        if not skip_zeros:
            counts[0] += zeros.sum()
    return counts.view(1, num_bins)


def _chunks(
    x: torch.Tensor, layout: ChannelLayout, scale: torch.Tensor, offsets: torch.Tensor | None, size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Split ``x`` into pieces of at most ``size`` elements, with matching ``scale``/``offsets``.

    Per tensor, ``x`` is flattened. Per channel, the pieces are ``x[i0, ..., i(d-1)]`` narrowed along
    dimension ``d``, the first dimension whose trailing block fits in a chunk; the keepdims-shaped
    ``scale`` and ``offsets`` are indexed the same way on kept dimensions (size 1 elsewhere).
    """
    if layout.rank is None or x.dim() == 0:
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), size):
            yield flat[start : start + size], scale, offsets
        return
    shape = x.shape
    split = next(d for d in range(x.dim()) if math.prod(shape[d + 1 :]) <= size)
    step = size // math.prod(shape[split + 1 :])
    for lead in itertools.product(*(range(n) for n in shape[:split])):
        kept = tuple(i if d in layout.keep else 0 for d, i in enumerate(lead))
        part, part_scale = x[lead], scale[kept]
        part_offsets = None if offsets is None else offsets[kept]
        for start in range(0, shape[split], step):
            length = min(step, shape[split] - start)
            if split in layout.keep:
                yield (
                    part.narrow(0, start, length),
                    part_scale.narrow(0, start, length),
                    None if part_offsets is None else part_offsets.narrow(0, start, length),
                )
            else:
                yield part.narrow(0, start, length), part_scale, part_offsets
