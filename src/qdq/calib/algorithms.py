"""Amax from a histogram of magnitudes: entropy (KL), mse and percentile, vectorised in torch.

A histogram here is ``counts`` (int, shape ``(n,)`` or ``(C, n)``) with bin ``j`` covering
``[j * w, (j + 1) * w)`` for a ``bin_width`` ``w`` (a float, or one per channel). Every function runs
on the histogram's device (CPU or GPU) and returns float32 amax values of shape ``()`` or ``(C,)``.
Every channel is computed at once (candidates x channels matrices, in chunks that bound memory); one
value is read back to the host per call (the longest used range, to trim the work), none per channel.

Only the bins up to the last non-empty one take part (``L`` = last non-empty bin + 1), which
reproduces the seed's histograms, whose range ends at the max. Differences from the seed
(pytorch-quantization 2.2) are listed in each function.
"""

from __future__ import annotations

import math

import torch

from qdq import ops
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.validate import check_num_bits

__all__ = ["entropy_amax", "mse_amax", "percentile_amax"]

_EPS64 = torch.finfo(torch.float64).eps
#: elements of one chunk of the channels x candidates x bins work: on the CPU a few hundred thousand (a 4096-bin
#: histogram's candidates in tens of chunks: fewer, and each op's fixed cost would dominate; more, and the
#: float64 work leaves the cache); on an accelerator large, since each chunk costs kernel launches. The chunking
#: does not change the result (each candidate's error is summed whole).
_CPU_CHUNK_ELEMS = 1 << 18
_DEVICE_CHUNK_ELEMS = 1 << 24


def check_percentile(percentile: float) -> float:
    """Validate a percentile in [0, 100]."""
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or math.isnan(percentile):
        raise QdqConfigError(f"percentile must be a number in the range [0, 100], got {percentile!r}.")
    if not 0 <= percentile <= 100:
        raise QdqConfigError(f"percentile must be in the range [0, 100], got {percentile}.")
    return float(percentile)


def check_positive_int(value: int, name: str) -> int:
    """Validate an int >= 1 (``start_bin``, ``stride``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QdqConfigError(f"{name} must be an int >= 1, got {value!r}.")
    return value


def entropy_amax(
    counts: torch.Tensor,
    bin_width: float | torch.Tensor,
    *,
    num_bits: int = 8,
    unsigned: bool = False,
    start_bin: int = 128,
    stride: int = 1,
) -> torch.Tensor:
    """Amax minimising KL(P || Q) between the histogram and its quantized version (TensorRT's algorithm).

    For each candidate ``i`` in ``start_bin, start_bin + stride, ... <= L``: ``P`` is the first ``i``
    bins with the mass of bins ``>= i`` added to bin ``i - 1``; the ``i`` bins are split into
    ``nq = 2**(num_bits - 1 + unsigned)`` groups (bin ``j`` in group ``floor(j * nq / i)``) and ``Q``
    spreads each group's mass evenly over its non-empty bins. Both are normalised and the amax is the
    left edge of bin ``i`` (``i * w``) for the **last** ``i`` of minimal KL.

    Differences from the seed: like the seed, bin 0 is replaced by bin 1 (it suppresses the spike of
    exact zeros after ReLU, which quantize without error) but on a copy, not the stored histogram;
    candidates stop at ``L`` instead of the histogram's end; ``start_bin > L`` starts at ``L``; KL
    values within a float64 rounding bound of the minimum count as ties (the seed's last-argmin acts
    on rounding noise there); an all-zero histogram returns 0.

    Args:
        counts: integer counts, ``(n,)`` or ``(C, n)``.
        bin_width: width of a bin in data units (a float, or a tensor with one per channel).
        num_bits: bit width of the target format (sets the number of levels).
        unsigned: whether the target format is unsigned (twice the levels).
        start_bin: first candidate bin (amax >= ``start_bin * w`` unless the data ends earlier).
        stride: step between candidate bins.

    Returns:
        float32 amax, shape ``()`` or ``(C,)``.

    Raises:
        QdqConfigError: ``num_bits``, ``start_bin`` or ``stride`` out of range, or a bad ``counts`` shape.
        QdqTypeError: ``counts`` is not an integer tensor.
    """
    check_num_bits(num_bits)
    check_positive_int(start_bin, "start_bin")
    check_positive_int(stride, "stride")
    levels = 2 ** (num_bits - 1 + int(unsigned))
    counts2d, widths = _as_batch(counts, bin_width)
    return _to_amax(_entropy_bins(counts2d, levels, start_bin, stride), widths, counts2d, counts.shape[:-1])


def mse_amax(
    counts: torch.Tensor,
    bin_width: float | torch.Tensor,
    *,
    num_bits: int = 8,
    unsigned: bool = False,
    start_bin: int = 128,
    stride: int = 1,
) -> torch.Tensor:
    """Amax minimising the squared fake-quantization error of the bin centres.

    Candidates are the centres ``(i + 0.5) * w`` for ``i`` in ``start_bin, start_bin + stride, ... < L``;
    the error of a candidate ``a`` is ``sum_j count_j * (fq(c_j; a) - c_j)**2`` over the bin centres
    ``c_j``, with qdq's fake quantization in float32: ``step = a / max_bound``,
    ``q = clamp(round_half_even(c / step), qmin, qmax)``, ``fq = q * step``, where
    ``max_bound = 2**(num_bits - 1 + unsigned) - 1``, ``qmax = max_bound`` and ``qmin = -max_bound - 1``
    (signed, full range) or 0 (unsigned). Errors are summed in float64; the **first** candidate
    within a relative rounding bound of the minimum wins.

    Differences from the seed: runs on any device (the seed hard-codes CUDA); the seed fake-quantizes
    with narrow range and a ``max_bound / amax`` multiplier; the seed's error is a mean (same argmin);
    ``start_bin > L - 1`` starts at ``L - 1``; an all-zero histogram returns 0.

    Args and Raises are those of :func:`entropy_amax`. Returns float32 amax, shape ``()`` or ``(C,)``.
    """
    check_num_bits(num_bits)
    check_positive_int(start_bin, "start_bin")
    check_positive_int(stride, "stride")
    max_bound = 2 ** (num_bits - 1 + int(unsigned)) - 1
    qmin = 0 if unsigned else -max_bound - 1
    counts2d, widths = _as_batch(counts, bin_width)
    positions = _mse_bins(counts2d, widths, max_bound, qmin, start_bin, stride) + 0.5
    return _to_amax(positions, widths, counts2d, counts.shape[:-1])


def percentile_amax(counts: torch.Tensor, bin_width: float | torch.Tensor, percentile: float = 99.99) -> torch.Tensor:
    """Left edge of the bin where the cumulative count first reaches ``percentile`` % of the total.

    The crossing bin is found with exact integer counts (``cumsum >= percentile / 100 * total``).
    Like the seed, the **left** edge is returned: the true percentile lies in ``[left, left + w)``, so
    the amax is low by less than one bin, and it never exceeds the largest value seen (the right edge
    of the last bin would), so ``percentile_amax <= max`` holds for every percentile, 100 included.
    An all-zero histogram returns 0.

    Args:
        counts: integer counts, ``(n,)`` or ``(C, n)``.
        bin_width: width of a bin in data units (a float, or a tensor with one per channel).
        percentile: in [0, 100].

    Returns:
        float32 amax, shape ``()`` or ``(C,)``.

    Raises:
        QdqConfigError: ``percentile`` is outside [0, 100], or a bad ``counts`` shape.
        QdqTypeError: ``counts`` is not an integer tensor.
    """
    fraction = check_percentile(percentile) / 100
    counts2d, widths = _as_batch(counts, bin_width)
    cum = counts2d.cumsum(1).to(torch.float64)
    threshold = cum[:, -1:] * fraction
    crossing = (cum < threshold).sum(1)
    amax = (crossing.to(torch.float64) * widths).float()
    return amax.reshape(counts.shape[:-1])


# -- shared helpers -----------------------------------------------------------------------------------


def _as_batch(counts: torch.Tensor, bin_width: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(counts, torch.Tensor) or counts.is_floating_point() or counts.is_complex():
        raise QdqTypeError("counts must be an integer torch.Tensor of shape (n,) or (C, n).")
    if counts.dim() not in (1, 2) or counts.shape[-1] < 2:
        raise QdqConfigError(f"counts must have shape (n,) or (C, n) with n >= 2, got {tuple(counts.shape)}.")
    counts2d = counts.reshape(-1, counts.shape[-1]).to(torch.int64)
    widths = torch.as_tensor(bin_width, dtype=torch.float64, device=counts.device).reshape(-1)
    return counts2d, widths.expand(counts2d.shape[0])


def _to_amax(positions: torch.Tensor, widths: torch.Tensor, counts2d: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """amax = position (in bins) * width, float32; 0 for an empty histogram."""
    amax = (positions * widths).float()
    return torch.where(counts2d.sum(1) > 0, amax, torch.zeros_like(amax)).reshape(shape)


def _used(counts2d: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``L`` per channel (index of the last non-empty bin + 1, 0 when empty) and the largest (one host read)."""
    columns = torch.arange(1, counts2d.shape[1] + 1, device=counts2d.device)
    used = torch.where(counts2d > 0, columns, torch.zeros_like(columns)).amax(1)
    return used, int(used.max())


def _chunk_rows(device: torch.device, per_row: int) -> int:
    budget = _CPU_CHUNK_ELEMS if device.type == "cpu" else _DEVICE_CHUNK_ELEMS
    return max(1, budget // max(1, per_row))


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[:, index]`` for ``(C, n)`` values: index_select, whose CPU kernel (unlike advanced indexing)
    stays on one thread for small sizes, which matters on a busy 2-core machine."""
    return values.index_select(1, index.reshape(-1)).view(values.shape[0], *index.shape)


def _pick(objective: torch.Tensor, tol: torch.Tensor, *, last: bool, relative: bool) -> torch.Tensor:
    """Index per channel of the first (or last) candidate within ``tol`` of the channel's minimum."""
    best = objective.min(1, keepdim=True).values
    bound = best * (1 + tol[:, None]) if relative else best + tol[:, None]
    near = objective <= bound
    index = torch.arange(objective.shape[1], device=objective.device).expand_as(objective)
    if last:
        return torch.where(near, index, torch.full_like(index, -1)).amax(1).clamp(min=0)
    return torch.where(near, index, torch.full_like(index, objective.shape[1])).amin(1).clamp(max=index.shape[1] - 1)


# -- entropy ------------------------------------------------------------------------------------------


def _entropy_bins(counts2d: torch.Tensor, levels: int, start_bin: int, stride: int) -> torch.Tensor:
    """Chosen candidate ``i`` per channel (amax = ``i`` bin widths), float64 ``(C,)``."""
    used, longest = _used(counts2d)
    positions = used.to(torch.float64)  # L: the only candidate when L < start_bin, and for empty P
    if longest == 0 or start_bin > longest:
        return positions
    bins = counts2d[:, :longest].to(torch.float64)
    bins[:, 0] = counts2d[:, 1].to(torch.float64)  # the seed's zero-spike suppression, on a copy
    total = bins.sum(1)
    grid = torch.arange(start_bin, longest + 1, stride, device=counts2d.device)
    prefix = _Prefix(bins)
    rows = _chunk_rows(counts2d.device, counts2d.shape[0] * min(levels, longest))
    kl = torch.cat([_kl(prefix, grid[s : s + rows], levels, used) for s in range(0, len(grid), rows)], dim=1)
    kl = torch.where(grid[None, :] <= used[:, None], kl, torch.full_like(kl, math.inf))
    tol = (8 * used * _EPS64 * (1 + torch.log(total.clamp(min=1)))).clamp(min=1e-10)
    chosen = grid[_pick(kl, tol, last=True, relative=False)].to(torch.float64)
    return torch.where((used >= start_bin) & (total > 0), chosen, positions)


class _Prefix:
    """Prefix sums per channel (index ``i`` sums bins ``< i``): mass, non-empty bins, ``b log b``."""

    def __init__(self, bins: torch.Tensor) -> None:
        zero = bins.new_zeros(bins.shape[0], 1)
        self.bins = bins
        self.mass = torch.cat([zero, bins.cumsum(1)], 1)
        self.filled = torch.cat([zero, (bins > 0).to(bins.dtype).cumsum(1)], 1)
        self.plogp = torch.cat([zero, torch.special.xlogy(bins, bins).cumsum(1)], 1)


def _kl(prefix: _Prefix, cand: torch.Tensor, levels: int, used: torch.Tensor) -> torch.Tensor:
    """KL(P_i || Q_i), shape ``(C, len(cand))``, in O(C * len(cand) * levels) from prefix sums.

    With S the total, Z = mass of bins < i, T = S - Z the tail, M_k / N_k the mass / non-empty count
    of group k, P_last = bins[i-1] + T:
    ``KL = (sum_j P_j log P_j - sum_k M_k log(M_k / N_k) - T log Q_last) / S + log(Z / S)``.
    Group k holds bins ``ceil(k i / levels) <= j < ceil((k + 1) i / levels)`` (``levels`` is a power of two).
    Where a channel's ``L <= levels`` every bin is its own group and Q is the histogram itself.
    """
    total = prefix.mass[:, -1:]
    inside = _take(prefix.mass, cand)
    tail = total - inside
    last = _take(prefix.bins, cand - 1)
    own_group, q_own = _take(prefix.plogp, cand), last
    if levels >= prefix.bins.shape[1]:
        group_term, q_last = own_group, q_own
    else:
        shift = levels.bit_length() - 1
        kc = torch.arange(levels, device=cand.device) * cand[:, None]
        lo, hi = (kc + levels - 1) >> shift, (kc + cand[:, None] + levels - 1) >> shift
        m = _take(prefix.mass, hi) - _take(prefix.mass, lo)
        nz = (_take(prefix.filled, hi) - _take(prefix.filled, lo)).clamp(min=1)
        g_last = torch.div((cand - 1) * levels, cand, rounding_mode="floor")
        rows = torch.arange(len(cand), device=cand.device)
        q_group = m[:, rows, g_last] / nz[:, rows, g_last]
        own = (used <= levels)[:, None]
        group_term = torch.where(own, own_group, torch.special.xlogy(m, m / nz).sum(2))
        q_last = torch.where(own, q_own, q_group)
    p_last = last + tail
    sum_plogp = _take(prefix.plogp, cand - 1) + torch.special.xlogy(p_last, p_last)
    sum_plogq = group_term + torch.special.xlogy(tail, q_last)
    kl = (sum_plogp - sum_plogq) / total + torch.log(inside / total)
    return torch.where((last == 0) & (tail > 0), torch.full_like(kl, math.inf), kl)


# -- mse ----------------------------------------------------------------------------------------------


def _mse_bins(
    counts2d: torch.Tensor, widths: torch.Tensor, max_bound: int, qmin: int, start_bin: int, stride: int
) -> torch.Tensor:
    """Chosen candidate bin ``i`` per channel (amax = centre of bin ``i``), float64 ``(C,)``."""
    used, longest = _used(counts2d)
    positions = (used - 1).clamp(min=0).to(torch.float64)  # the only candidate when L - 1 < start_bin
    if longest == 0 or start_bin > longest - 1:
        return positions
    counts2d = counts2d[:, :longest]
    device = counts2d.device
    centres = ((torch.arange(longest, dtype=torch.float64, device=device) + 0.5) * widths[:, None]).float()
    values, weights = _filled(centres, counts2d)
    grid = torch.arange(start_bin, longest, stride, device=device)
    rows = _chunk_rows(device, values.numel())
    scratch: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    exact = values.to(torch.float64)
    errors = torch.cat(
        [
            _quant_errors(centres[:, grid[s : s + rows]], (values, exact), weights, max_bound, qmin, scratch)
            for s in range(0, len(grid), rows)
        ],
        dim=1,
    )
    errors = torch.where(grid[None, :] < used[:, None], errors, torch.full_like(errors, math.inf))
    tol = (4 * (counts2d > 0).sum(1) * _EPS64).clamp(min=1e-12)
    chosen = grid[_pick(errors, tol, last=False, relative=True)].to(torch.float64)
    return torch.where(used - 1 >= start_bin, chosen, positions)


def _filled(centres: torch.Tensor, counts2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's non-empty bins, in bin order: their centres and float64 counts, ``(C, F)`` with ``F`` the most
    any channel has (a channel with fewer is padded with weight 0). Per channel, not the bins non-empty in some
    channel: per-channel weights fill few bins each, at bin positions that differ from channel to channel."""
    filled = counts2d > 0
    width = max(int(filled.sum(1).max()), 1)
    order = torch.sort(filled.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    return torch.gather(centres, 1, order), torch.gather(counts2d, 1, order).to(torch.float64)


def _quant_errors(
    amax: torch.Tensor, values: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, max_bound: int, qmin: int,
    scratch: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``sum_j weights_cj * (fq(values_cj; amax_cr) - values_cj)**2`` per channel and candidate (float64).

    ``amax`` is ``(C, R)`` candidates, ``values`` ``(C, F)`` in float32 and float64, ``weights`` ``(C, F)``; fake
    quantization is qdq's (:func:`qdq.ops.round_to_grid` with :func:`qdq.ops.quant_step`), in float32. ``scratch``
    keeps the two ``(C, R, F)`` buffers between calls, by shape: a search of thousands of chunks allocating them each
    time grew the heap by gigabytes (glibc's adaptive mmap threshold keeps freed chunks of that size).
    """
    single, exact = values
    step = ops.quant_step(amax, max_bound)[:, :, None]
    shape = (single.shape[0], amax.shape[1], single.shape[1])
    if shape not in scratch:
        scratch[shape] = (torch.empty(shape, dtype=torch.float32, device=single.device),
                          torch.empty(shape, dtype=torch.float64, device=single.device))  # fmt: skip
    fq, diff = scratch[shape]
    ops.round_to_grid(single[:, None, :], step, qmin, max_bound, out=fq).mul_(step)
    diff.copy_(fq).sub_(exact[:, None, :])
    return torch.einsum("crf,cf->cr", diff.square_(), weights)
