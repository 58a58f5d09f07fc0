"""Independent numpy oracles of histogram calibration, written from the documented conventions.

* Histogram (``qdq.calib.binning``'s layout): ``num_bins`` equal bins over ``[0, 2**k)``, ``k`` the
  smallest integer with ``max|x| < 2**k``; the bin of a magnitude ``m`` is
  ``floor(float32(m * float32(num_bins * 2**-k)))``.
* percentile: the left edge of the bin holding the ``ceil(n * p / 100)``-th smallest magnitude.
* mse: the bin centre ``(i + 0.5) * w`` (``i`` from ``start_bin`` to the last non-empty bin, exclusive)
  minimising ``sum count_j * (fq(c_j) - c_j)**2`` over the bin centres, fake-quantized in float32 with
  ``step = amax / 127`` and ``q = clamp(round_half_even(c / step), -128, 127)``; the first of equals.
* entropy: TensorRT's KL divergence (scipy), one candidate bin ``i`` at a time, bin 0 replaced by
  bin 1 as the seed does; amax ``i * w``, the last of equals.
* Every method's amax is at most ``max|x|`` (a bin centre or upper edge can lie above it).

Used by the workflow and weight-calibration tests; nothing here imports qdq.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import entropy as scipy_kl

__all__ = ["entropy_amax", "mse_amax", "percentile_amax", "pow2_histogram"]


def pow2_histogram(values: np.ndarray, num_bins: int = 2048) -> tuple[np.ndarray, float]:
    """``(counts, bin width)`` of the magnitudes of ``values`` (signed quantization: ``|x|``)."""
    mags = np.abs(np.asarray(values, dtype=np.float32)).reshape(-1)
    _, exponent = np.frexp(np.float64(mags.max()))  # max = f * 2**e with f in [0.5, 1): max < 2**e
    scale = np.float32(num_bins * 2.0 ** -int(exponent))
    index = (mags * scale).astype(np.int64)
    return np.bincount(index, minlength=num_bins), 2.0 ** int(exponent) / num_bins


def percentile_amax(values: np.ndarray, percentile: float, num_bins: int = 2048) -> float:
    """Left edge of the bin of the ``ceil(n * p / 100)``-th smallest magnitude."""
    _, width = pow2_histogram(values, num_bins)
    mags = np.sort(np.abs(np.asarray(values, dtype=np.float32)).reshape(-1))
    rank = math.ceil(mags.size * percentile / 100)
    value = float(mags[max(rank, 1) - 1])
    return math.floor(value / width) * width


def _used(counts: np.ndarray) -> int:
    return int(np.nonzero(counts)[0].max()) + 1


def mse_amax(values: np.ndarray, num_bins: int = 2048, start_bin: int = 128) -> float:
    """The bin centre with the least squared fake-quantization error of the bin centres (signed 8 bit)."""
    counts, width = pow2_histogram(values, num_bins)
    used = _used(counts)
    centres = ((np.arange(used) + 0.5) * width).astype(np.float32)
    errors = []
    candidates = range(min(start_bin, used - 1), used)
    for i in candidates:
        step = np.float32(centres[i] / np.float32(127))
        fq = (np.clip(np.rint(centres / step), -128, 127) * step).astype(np.float32)
        errors.append(float(np.sum(counts[:used] * (fq.astype(np.float64) - centres.astype(np.float64)) ** 2)))
    best = min(errors)
    first = next(i for i, e in zip(candidates, errors) if e <= best * (1 + 1e-9))
    return min(float(centres[first]), _max(values))


def entropy_amax(values: np.ndarray, num_bins: int = 2048, start_bin: int = 128, levels: int = 128) -> float:
    """TensorRT's entropy calibration (signed 8 bit: 128 levels), the last candidate of least KL."""
    counts, width = pow2_histogram(values, num_bins)
    used = _used(counts)
    bins = counts[:used].astype(np.float64)
    bins[0] = counts[1]
    candidates = range(min(start_bin, used), used + 1)
    kls = []
    for i in candidates:
        p = bins[:i].copy()
        p[i - 1] += bins[i:].sum()
        group = np.digitize(np.arange(i), np.linspace(0, i, levels + 1)) - 1
        mass = np.bincount(group, weights=bins[:i], minlength=levels)
        filled = np.bincount(group, weights=(bins[:i] > 0).astype(float), minlength=levels)
        q = np.where(bins[:i] > 0, mass[group] / np.maximum(filled[group], 1), 0.0)
        kls.append(scipy_kl(p, q) if q.sum() > 0 else np.inf)
    best = min(kls)
    last = [i for i, kl in zip(candidates, kls) if kl <= best + 1e-9][-1]
    return min(float(np.float32(last * width)), _max(values))


def _max(values: np.ndarray) -> float:
    return float(np.abs(np.asarray(values, dtype=np.float32)).max())
