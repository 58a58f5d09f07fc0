"""Amax from a histogram of magnitudes: entropy (KL), mse and percentile, vectorised in torch.

A histogram here is ``counts`` (int, shape ``(n,)`` or ``(C, n)``) with bin ``j`` covering
``[j * w, (j + 1) * w)`` for a ``bin_width`` ``w`` (a float, or one per channel). Every function runs
on the histogram's device (CPU or GPU) and returns float32 amax values of shape ``()`` or ``(C,)``.
Loops run over channels only, never over candidate bins.

Only the bins up to the last non-empty one take part (``L`` = last non-empty bin + 1), which
reproduces the seed's histograms, whose range ends at the max. Differences from the seed
(pytorch-quantization 2.2) are listed in each function.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.validate import check_num_bits

__all__ = ["entropy_amax", "mse_amax", "percentile_amax"]

_EPS64 = torch.finfo(torch.float64).eps
#: candidate amax values evaluated per chunk (rows of the candidates x bins matrices)
_MATRIX_ELEMS = 32_000


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
    return _per_channel(counts, bin_width, lambda c, w: _entropy_bin(c, levels, start_bin, stride))


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

    def pick(c: torch.Tensor, w: float) -> float:
        return _mse_bin(c, w, max_bound, qmin, start_bin, stride) + 0.5

    return _per_channel(counts, bin_width, pick)


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


# -- per channel driver -------------------------------------------------------------------------------


def _as_batch(counts: torch.Tensor, bin_width: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(counts, torch.Tensor) or counts.is_floating_point() or counts.is_complex():
        raise QdqTypeError("counts must be an integer torch.Tensor of shape (n,) or (C, n).")
    if counts.dim() not in (1, 2) or counts.shape[-1] < 2:
        raise QdqConfigError(f"counts must have shape (n,) or (C, n) with n >= 2, got {tuple(counts.shape)}.")
    counts2d = counts.reshape(-1, counts.shape[-1]).to(torch.int64)
    widths = torch.as_tensor(bin_width, dtype=torch.float64, device=counts.device).reshape(-1)
    return counts2d, widths.expand(counts2d.shape[0])


def _per_channel(
    counts: torch.Tensor, bin_width: float | torch.Tensor, pick: Callable[[torch.Tensor, float], float]
) -> torch.Tensor:
    """Apply ``pick(counts_row, width)`` (a position in bins) to each channel; amax = position * width."""
    counts2d, widths = _as_batch(counts, bin_width)
    positions = [pick(row, width) for row, width in zip(counts2d, widths.tolist())]
    pos = torch.tensor(positions, dtype=torch.float64, device=counts.device)
    amax = (pos * widths).float()
    amax = torch.where(counts2d.sum(1) > 0, amax, torch.zeros_like(amax))
    return amax.reshape(counts.shape[:-1])


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 1-D ``values``: index_select, whose CPU kernel (unlike advanced indexing)
    stays on one thread for small sizes, which matters on a busy 2-core machine."""
    return values.index_select(0, index.reshape(-1)).view(index.shape)


def _num_used(counts: torch.Tensor) -> int:
    """``L``: index of the last non-empty bin + 1 (0 when empty)."""
    nonzero = torch.nonzero(counts)
    return int(nonzero[-1, 0]) + 1 if nonzero.numel() else 0


# -- entropy ------------------------------------------------------------------------------------------


def _entropy_bin(counts: torch.Tensor, levels: int, start_bin: int, stride: int) -> float:
    """Chosen candidate ``i`` (amax = ``i`` bin widths) for one histogram."""
    used = _num_used(counts)
    if used == 0:
        return 0.0
    bins = counts[:used].to(torch.float64)
    bins[0] = float(counts[1])  # the seed's zero-spike suppression, on a copy
    total = float(bins.sum())
    if total == 0:  # everything was in bin 0: no distribution left to compare
        return float(used)
    candidates = torch.arange(min(start_bin, used), used + 1, stride, device=counts.device)
    prefix = _Prefix(bins)
    rows = max(1, _MATRIX_ELEMS // levels)
    kl = torch.cat([_kl(prefix, candidates[s : s + rows], levels) for s in range(0, len(candidates), rows)])
    tol = max(1e-10, 8 * used * _EPS64 * (1 + math.log(total)))
    ties = torch.nonzero(kl <= kl.min() + tol)
    return float(candidates[ties[-1, 0]])


class _Prefix:
    """Prefix sums of a histogram (index ``i`` sums bins ``< i``): mass, non-empty bins, ``b log b``."""

    def __init__(self, bins: torch.Tensor) -> None:
        zero = bins.new_zeros(1)
        self.bins = bins
        self.mass = torch.cat([zero, bins.cumsum(0)])
        self.filled = torch.cat([zero, (bins > 0).to(bins.dtype).cumsum(0)])
        self.plogp = torch.cat([zero, torch.special.xlogy(bins, bins).cumsum(0)])


def _kl(prefix: _Prefix, cand: torch.Tensor, levels: int) -> torch.Tensor:
    """KL(P_i || Q_i) for each candidate ``i`` in ``cand``, in O(len(cand) * levels) from prefix sums.

    With S the total, Z = mass of bins < i, T = S - Z the tail, M_k / N_k the mass / non-empty count
    of group k, P_last = bins[i-1] + T:
    ``KL = (sum_j P_j log P_j - sum_k M_k log(M_k / N_k) - T log Q_last) / S + log(Z / S)``.
    Group k holds bins ``ceil(k i / levels) <= j < ceil((k + 1) i / levels)`` (``levels`` is a power of two).
    """
    total = prefix.mass[-1]
    inside = _take(prefix.mass, cand)
    tail = total - inside
    last = _take(prefix.bins, cand - 1)
    if levels >= len(prefix.bins):  # every bin is its own group: Q is the histogram itself
        group_term, q_last = _take(prefix.plogp, cand), last
    else:
        shift = levels.bit_length() - 1
        kc = torch.arange(levels, device=cand.device) * cand[:, None]
        lo, hi = (kc + levels - 1) >> shift, (kc + cand[:, None] + levels - 1) >> shift
        m = _take(prefix.mass, hi) - _take(prefix.mass, lo)
        nz = (_take(prefix.filled, hi) - _take(prefix.filled, lo)).clamp(min=1)
        group_term = torch.special.xlogy(m, m / nz).sum(1)
        g_last = torch.div((cand - 1) * levels, cand, rounding_mode="floor")[:, None]
        q_last = (m.gather(1, g_last) / nz.gather(1, g_last)).squeeze(1)
    p_last = last + tail
    sum_plogp = _take(prefix.plogp, cand - 1) + torch.special.xlogy(p_last, p_last)
    sum_plogq = group_term + torch.special.xlogy(tail, q_last)
    kl = (sum_plogp - sum_plogq) / total + torch.log(inside / total)
    return torch.where((last == 0) & (tail > 0), torch.full_like(kl, math.inf), kl)


# -- mse ----------------------------------------------------------------------------------------------


def _mse_bin(counts: torch.Tensor, width: float, max_bound: int, qmin: int, start_bin: int, stride: int) -> int:
    """Chosen candidate bin ``i`` (amax = centre of bin ``i``) for one histogram."""
    used = _num_used(counts)
    if used == 0:
        return 0
    centres = ((torch.arange(used, dtype=torch.float64, device=counts.device) + 0.5) * width).float()
    filled = torch.nonzero(counts[:used]).squeeze(1)
    values, weights = _take(centres, filled), _take(counts, filled).to(torch.float64)
    candidates = torch.arange(min(start_bin, used - 1), used, stride, device=counts.device)
    rows = max(1, _MATRIX_ELEMS // len(filled))
    errors = torch.cat(
        [
            _quant_errors(_take(centres, candidates[s : s + rows]), values, weights, max_bound, qmin)
            for s in range(0, len(candidates), rows)
        ]
    )
    tol = max(1e-12, 4 * len(filled) * _EPS64)
    best = torch.nonzero(errors <= errors.min() * (1 + tol))
    return int(candidates[best[0, 0]])


_ROUNDER = 1.5 * 2.0**23  # float32 spacing is 1 on [2**23, 2**24)


def _round_half_even_(x: torch.Tensor) -> torch.Tensor:
    """In-place round-half-to-even of float32 ``x``; equal to ``torch.round`` wherever ``|x| < 2**22``.

    Adding 1.5 * 2**23 moves ``x`` to where float32 holds only integers, so the IEEE addition itself
    rounds to the nearest integer, ties to even; subtracting it back is exact. Larger values are off by
    at most a few units, irrelevant here since the caller clamps to ``|q| <= 2**15``. Why not
    ``round_``: torch's CPU rounding kernels start a parallel region from 2048 elements, and on a busy
    2-core machine each such region can stall for a scheduler tick (~10 ms); additions use a 32768
    grain, above the chunk size used here.
    """
    return x.add_(_ROUNDER).sub_(_ROUNDER)


def _quant_errors(
    amax: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, max_bound: int, qmin: int
) -> torch.Tensor:
    """``sum_j weights_j * (fq(values_j; amax_r) - values_j)**2`` for each candidate ``amax_r`` (float64)."""
    step = (amax / max_bound)[:, None]  # float32, as in qdq's fake quantization
    fq = _round_half_even_(torch.div(values[None, :], step)).clamp_(qmin, max_bound).mul_(step)
    diff = fq.to(torch.float64).sub_(values.to(torch.float64))
    return diff.square_() @ weights
