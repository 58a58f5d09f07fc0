"""Output fidelity: how close a quantized model's outputs stay to the float model's, in dB, per output feature.

What ``auto`` scores its candidates by (:mod:`qdq.workflow.auto_calibration`) and the refinement its trials
(:mod:`qdq.workflow.refinement`), in every front end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["FidelityMeter", "output_fidelity"]

#: a feature reproduced better than this (dB) counts as this: an exact output does not outweigh the others
_CEILING_DB = 60.0


class FidelityMeter:
    """Accumulates, batch by batch, how far outputs are from reference outputs, per output *feature*.

    A feature is one slice along axis 1 of an output of rank 3 or more (a channel of ``[N, C, H, W]``, one row of a
    detector's ``[N, 4 + classes, anchors]``, one position of ``[N, T, D]``) and the whole tensor otherwise. Integer
    and boolean outputs are ignored. Sums are float64 over every batch added.
    """

    def __init__(self) -> None:
        self._sums: dict[tuple[int, int], np.ndarray] = {}  # (output, feature) -> [n, sum r, sum r^2, sum (q-r)^2]

    def add(self, reference: Sequence[Any], outputs: Sequence[Any]) -> None:
        """Add one batch: the float model's outputs and the quantized model's, in the same order."""
        for index, (ref, out) in enumerate(zip(reference, outputs)):
            ref, out = _array(ref), _array(out)
            if ref is None or out is None or ref.shape != out.shape or ref.size == 0:
                continue
            for feature, (r, q) in enumerate(zip(_features(ref), _features(out))):
                sums = self._sums.setdefault((index, feature), np.zeros(4))
                sums += (r.size, r.sum(), np.square(r).sum(), np.square(q - r).sum())

    def sums(self) -> dict[tuple[int, int], np.ndarray]:
        """``(output index, feature index) -> [count, sum of reference, sum of its squares, sum of squared errors]``."""
        return {key: value.copy() for key, value in self._sums.items()}

    def score(self) -> float:
        """:func:`output_fidelity` of what was added (dB); NaN when nothing comparable was added."""
        return output_fidelity(self._sums)

    def ranked(self) -> float:
        """:meth:`score` for comparisons: -inf where nothing comparable was added (a trial that could not run ranks
        below every one that did)."""
        value = self.score()
        return value if math.isfinite(value) else -math.inf

    def reduced(self, reduce: Callable[[list[float]], list[float]]) -> FidelityMeter:
        """A meter whose sums are ``reduce`` of these (flattened in key order): summed over the ranks of a sharded
        run with :func:`qdq.workflow.distributed.all_reduce_sum`, every rank then holding every rank's batches."""
        keys = sorted(self._sums)
        flat = reduce([float(v) for key in keys for v in self._sums[key]])
        merged = FidelityMeter()
        merged._sums = {key: np.asarray(flat[4 * i : 4 * i + 4], np.float64) for i, key in enumerate(keys)}
        return merged

    def __add__(self, other: FidelityMeter) -> FidelityMeter:
        """A meter holding both meters' batches."""
        merged = FidelityMeter()
        for meter in (self, other):
            for key, sums in meter._sums.items():
                merged._sums[key] = merged._sums.get(key, np.zeros(4)) + sums
        return merged


def output_fidelity(sums: Mapping[tuple[int, int], Any]) -> float:
    """How close outputs are to the reference, in dB (higher is closer): per output feature (see
    :class:`FidelityMeter`), ``10 log10(variance of the reference / mean squared error)``, capped at 60 dB; averaged
    over each output's features, then over the outputs. A feature that does not vary (a constant channel) is left
    out; an output none of whose features varies does not count. NaN when no output counts.

    The variance, not the energy, is the yardstick: an error in pixel coordinates (hundreds) and one in 0-1 class
    scores are each measured against how much that feature moves, so a detector's scores count as much as its boxes.
    """
    per_output: dict[int, list[float]] = {}
    for (output, _), (count, total, squares, error) in sums.items():
        variance = squares / count - (total / count) ** 2 if count else 0.0
        if variance <= 1e-12 * max(squares / count, 1e-30) or variance <= 0:
            continue
        mse = error / count
        decibels = _CEILING_DB if mse <= 0 else min(_CEILING_DB, 10 * math.log10(variance / mse))
        per_output.setdefault(output, []).append(decibels)
    if not per_output:
        return math.nan
    return float(np.mean([np.mean(values) for values in per_output.values()]))


def _array(value: Any) -> np.ndarray | None:
    """``value`` as a float64 array, or None for an integer or boolean tensor."""
    array = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
    return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else None


def _features(array: np.ndarray) -> Iterable[np.ndarray]:
    if array.ndim < 3:
        return (array,)
    return (array[:, i] for i in range(array.shape[1]))
